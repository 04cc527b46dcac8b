"""The pools a client registered, and the plan of a call over them.

A *plan* is what a set or get call copies, one row per pool named in the call:

    (pool name, its PageIO, the keys, the token start of each key's host page)

``PoolTable.plan`` turns SGLang's ``PoolTransfer`` list into one (checking every transfer: a
registered pool, named once, one page of host indices per key, page starts inside the pool);
``PoolTable.pages_plan`` turns SGLang's flat page tensors (v0) into one. Both the set and the get
calls (``sets.py``, ``get.py``) read their plans here.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from hicached.client.flatpages import TensorPages
from hicached.errors import InvalidTransfer, LengthMismatch, UnknownPool
from hicached.kernels.pageio import PageIO
from hicached.types import key_list, pool_value

Plan = list[tuple[str, PageIO, list[str], list[int]]]  # (pool, io, keys, token starts) per pool


def token_starts(host_indices: Any, num_keys: int, page_size: int, pool: str,
                 capacity: int | None = None) -> list[int]:
    """Page-start token indices (``host_indices[i * page_size]``), checked: one page per key,
    integers at page starts inside the pool (``capacity`` tokens; None: unknown)."""
    n = len(host_indices) if host_indices is not None else 0
    if n != num_keys * page_size:
        raise LengthMismatch(
            f"pool {pool!r}: {num_keys} keys need {num_keys * page_size} host indices "
            f"(page_size {page_size}), got {n}"
        )
    starts = host_indices[::page_size]
    starts = starts.tolist() if hasattr(starts, "tolist") else list(starts)
    if not starts:
        return starts
    if not all(type(t) is int for t in starts):
        try:  # e.g. numpy integers in a list
            starts = [operator.index(t) for t in starts]
        except TypeError:
            bad = next(t for t in starts if not hasattr(t, "__index__"))
            raise InvalidTransfer(f"pool {pool!r}: host indices must be integers, got "
                                  f"{bad!r}") from None
    low, high = min(starts), max(starts)
    if low < 0 or (capacity is not None and high + page_size > capacity):
        raise InvalidTransfer(f"pool {pool!r}: host indices {low}..{high + page_size - 1} are "
                              f"outside the pool of {capacity} tokens")
    if page_size > 1 and any(t % page_size for t in starts):
        bad = next(t for t in starts if t % page_size)
        raise InvalidTransfer(f"pool {pool!r}: host index {bad} is not a page start (page_size "
                              f"{page_size})")
    return starts


class PoolTable:
    """The registered pools of one client: name -> (``PageIO``, KV-event settings).

    Owns the table; mutated only by ``add`` (``Client.register_mem_host_pool_v2``, after the
    daemon accepted the pool). The connection reads ``items()`` to register them again with a
    restarted daemon and ``release_all()`` at close. Reads are safe from any thread (each
    pool's entry is replaced whole)."""

    def __init__(self):
        # pool -> (its page path, (event_hash, tokens_per_page)), one entry replaced at once
        self._pools: dict[str, tuple[PageIO, tuple[str, int]]] = {}

    def add(self, name: str, io: PageIO, events: tuple[str, int]) -> None:
        """Record pool ``name`` (registering a name again replaces its page path)."""
        self._pools[name] = (io, events)

    def io(self, name: str) -> PageIO:
        """The page path of pool ``name``; ``UnknownPool`` (naming the registered ones) if none."""
        try:
            return self._pools[name][0]
        except KeyError:
            raise UnknownPool(f"pool {name!r} is not registered (registered: "
                              f"{sorted(self._pools)})") from None

    def items(self) -> list[tuple[str, PageIO, tuple[str, int]]]:
        """(name, io, (event_hash, tokens_per_page)) of every registered pool."""
        return [(name, io, events) for name, (io, events) in list(self._pools.items())]

    def release_all(self) -> None:
        """Let every page path drop what it holds of the arena (CUDA registrations of
        ``kernels/cuda.DevicePageIO``) before the client unmaps it."""
        for io, _ in list(self._pools.values()):
            release = getattr(io, "release_arena", None)
            if release is not None:
                release()

    def plan(self, transfers: Sequence[Any]) -> Plan:
        """The plan of ``transfers`` (``PoolTransfer``-shaped: name, keys, host_indices).
        Raises ``UnknownPool``, ``InvalidTransfer`` (a pool named twice, bad indices) or
        ``LengthMismatch`` (host indices that are not one page per key)."""
        plan = []
        for t in transfers:
            name = pool_value(t.name)
            if any(name == p[0] for p in plan):  # results are per pool: one would be lost
                raise InvalidTransfer(f"pool {name!r} is named twice in one call: put its "
                                      "keys in one transfer")
            keys = key_list(t.keys or (), f"pool {name!r}: keys")
            io = self.io(name)
            plan.append((name, io, keys, token_starts(t.host_indices, len(keys),
                                                       io.page_size, name, io.capacity_tokens)))
        return plan

    def pages_plan(self, pool_name: Any, keys: Sequence[str], pages: Sequence[torch.Tensor]
                   ) -> tuple[str, Plan]:
        """(pool name, the plan of one pool) copying ``pages[i]`` (flat tensors of the pool's
        page size) for ``keys[i]``. Raises ``LengthMismatch`` or ``InvalidTransfer``."""
        name = pool_value(pool_name)
        keys = key_list(keys)
        if len(keys) != len(pages):
            raise LengthMismatch(f"pool {name!r}: {len(keys)} keys but {len(pages)} pages")
        try:
            io = TensorPages(pages, self.io(name).page_bytes)
        except ValueError as e:
            raise InvalidTransfer(f"pool {name!r}: {e}") from None
        return name, [(name, io, keys, list(range(len(keys))))]
