"""Public value types of the v2 storage API, shaped exactly like SGLang's.

``PoolName`` / ``PoolHitPolicy`` are ``str`` enums whose values are SGLang's lowercase strings, so
results keyed by ``pool.value`` are what SGLang's controller looks up. ``PoolTransfer`` and
``PoolTransferResult`` carry the same fields as SGLang's dataclasses; the client accepts SGLang's own
objects too (anything with ``name``, ``keys``, ``host_indices`` and ``hit_policy`` attributes).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from hicached.errors import InvalidArgument

# What ``list(keys)`` would split into characters (or byte values): one key, not a sequence.
_NOT_KEY_SEQUENCES = (str, bytes, bytearray, memoryview)


class PoolName(str, enum.Enum):
    """Names of the pools a hybrid model has; ``str()`` is the wire value."""

    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"
    INDEXER = "indexer"
    DRAFT = "draft"
    DRAFT_INDEXER = "draft_indexer"
    DRAFT_SWA = "draft_swa"

    def __str__(self) -> str:
        return self.value


class PoolHitPolicy(str, enum.Enum):
    """How a pool takes part in the restorable prefix (see ARCHITECTURE.md, hit semantics)."""

    ALL_PAGES = "all_pages"  # every page 0..L-1 must exist (KV, DSA indexer)
    TRAILING_PAGES = "trailing_pages"  # pages L-N..L-1 must exist (Mamba N=1, SWA N=window)

    def __str__(self) -> str:
        return self.value


def pool_value(name: Any) -> str:
    """The wire string of a pool name given as a ``PoolName``, SGLang's enum, or a plain string."""
    value = getattr(name, "value", name)
    if not isinstance(value, str) or not value:
        raise TypeError(f"pool name must be a non-empty string or str enum, got {name!r}")
    return value


def policy_value(policy: Any) -> str:
    """The wire string of a hit policy given as our enum, SGLang's enum, or a plain string."""
    value = getattr(policy, "value", policy)
    if value not in (PoolHitPolicy.ALL_PAGES.value, PoolHitPolicy.TRAILING_PAGES.value):
        raise ValueError(
            f"unknown hit policy {policy!r}; valid: "
            f"{[p.value for p in PoolHitPolicy]}"
        )
    return value


def key_list(keys: Any, what: str = "keys") -> list[str]:
    """``keys`` (a sequence of page keys) as a list. ``InvalidArgument`` naming ``what`` when it
    is one ``str`` or ``bytes``: iterating it would make each character a key (``"abc"`` would
    ask for keys 'a', 'b', 'c', and hit pages stored under them)."""
    if isinstance(keys, _NOT_KEY_SEQUENCES):
        raise InvalidArgument(f"{what} must be a sequence of keys (a list of str), got one "
                              f"{type(keys).__name__} {keys!r:.80}: wrap a single key in a list")
    return list(keys)


@dataclass
class PoolTransfer:
    """One pool's part of a v2 call.

    ``host_indices`` are token-granular slots of that pool's registered host pool: page i of
    ``keys`` starts at ``host_indices[i * page_size]`` (len == len(keys) * page_size).
    In ``batch_exists_v2`` only ``name``, ``hit_policy`` and ``len(keys)`` (the trailing window N)
    matter. ``keys`` given as one ``str`` or ``bytes`` raises ``InvalidArgument``.
    """

    name: PoolName | str
    host_indices: Any = None
    device_indices: Any = None
    keys: list[str] | None = None
    hit_policy: PoolHitPolicy | str = PoolHitPolicy.ALL_PAGES
    nodes_to_load: list | None = None
    indices_from_pool: PoolName | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.keys, _NOT_KEY_SEQUENCES):
            key_list(self.keys, f"PoolTransfer({self.name!r}).keys")


@dataclass
class PoolTransferResult:
    """Answer of ``batch_exists_v2``.

    ``kv_hit_pages`` is the largest restorable prefix (pages) every pool agrees on;
    ``extra_pool_hit_pages`` the per-pool hit counts (pool value -> pages);
    ``restorable_prefix_pages`` every endpoint L (1..kv prefix) all pools can restore, ascending, so
    callers can intersect across TP ranks.
    """

    kv_hit_pages: int = 0
    extra_pool_hit_pages: dict[str, int] = field(default_factory=dict)
    restorable_prefix_pages: list[int] | None = None

    @classmethod
    def empty(cls) -> PoolTransferResult:
        return cls(0, {}, [])
