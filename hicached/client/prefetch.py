"""Prefetch: exists + chunked get on a background thread, stopped by SGLang's policies.

An engine that finds a prefix in storage starts a prefetch and keeps scheduling; each time it
would like to run the request it asks the operation whether it may stop waiting
(``should_stop``), and if so ``terminate``s it and uses the pages that arrived:

    op = client.prefetch(keys, kv_host_indices,
                         [PoolTransfer("mamba", slot, keys=["_"], hit_policy="trailing_pages")],
                         policy="timeout")
    ...                                  # the scheduler loop
    if op.should_stop():
        pages = op.terminate()           # pages [0, pages) are in the host pools

What the operation does, in pages (one thread, one client call at a time):

    exists   hit_pages = L, the largest prefix every pool can restore
    chunk 0  [0, c)   KV + ALL_PAGES sidecars (DSA indexer) of the same keys, one batch_get_v2
    chunk 1  [c, 2c)  ... stops early on terminate() or a short chunk (completed_pages < L)
    tail     TRAILING_PAGES sidecars (Mamba, SWA): keys = the last N keys of [0, L), read only
             once all L KV pages arrived and nobody terminated (as SGLang does)

Stop policies (SGLang's ``--hicache-storage-prefetch-policy``):

    best_effort    may stop at any time: should_stop() is always True; keep what arrived
    wait_complete  stops only once the operation is done (no deadline: a slow store stalls)
    timeout        stops when done or when now - started >= timeout_s(tokens), where
                   timeout_s = min(max_s, base_s + tokens / 1024 * per_ki_token_s)

The timeout knobs keep SGLang's names and defaults (``prefetch_timeout_base`` = 1 s and
``prefetch_timeout_per_ki_token`` = 0.25 s in sglang 0.5.23, where a "ki token" is 1024 tokens;
``prefetch_timeout_max`` = 30 s as in newer SGLang's ``PrefetchTimeoutConfig``), so an engine can
hand its extra-config dict to ``make_policy``. SGLang itself runs these policies in its scheduler
(it pops the knobs before a storage backend sees them); this module is for engines that drive
hicached directly (the reference engine, tools).
"""

from __future__ import annotations

import abc
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicached.errors import LengthMismatch
from hicached.hits import leading_run
from hicached.types import PoolHitPolicy, PoolTransfer, key_list, policy_value, pool_value

if TYPE_CHECKING:
    from hicached.client.api import Client

log = logging.getLogger(__name__)

KI_TOKENS = 1024  # SGLang's "per_ki_token": per 1024 tokens
KV = "kv"


class StopPolicy(abc.ABC):
    """When a caller may stop waiting for a prefetch. Stateless: safe to share between ops."""

    name = "abstract"

    @abc.abstractmethod
    def should_stop(self, op: PrefetchOperation, now: float) -> bool:
        """True when the caller may terminate ``op`` at monotonic time ``now``."""

    def deadline_s(self, num_tokens: int) -> float | None:
        """Seconds after the start at which the policy gives up waiting (None: never)."""
        return None


class BestEffort(StopPolicy):
    """Stop whenever the caller wants to run the request; keep whatever has arrived."""

    name = "best_effort"

    def should_stop(self, op: PrefetchOperation, now: float) -> bool:
        return True


class WaitComplete(StopPolicy):
    """Stop only when every page the exists answer promised has been handled."""

    name = "wait_complete"

    def should_stop(self, op: PrefetchOperation, now: float) -> bool:
        return op.done


@dataclass(frozen=True)
class Timeout(StopPolicy):
    """Stop when done, or once ``timeout_s(tokens)`` has passed since the operation started."""

    base_s: float = 1.0
    per_ki_token_s: float = 0.25
    max_s: float = 30.0

    name = "timeout"

    def __post_init__(self) -> None:
        for field, value in (("base_s", self.base_s), ("per_ki_token_s", self.per_ki_token_s),
                             ("max_s", self.max_s)):
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"timeout policy: {field} must be a number >= 0, got {value!r}")

    def timeout_s(self, num_tokens: int) -> float:
        """``min(max_s, base_s + num_tokens / 1024 * per_ki_token_s)``."""
        return min(self.max_s, self.base_s + num_tokens / KI_TOKENS * self.per_ki_token_s)

    def deadline_s(self, num_tokens: int) -> float:
        return self.timeout_s(num_tokens)

    def should_stop(self, op: PrefetchOperation, now: float) -> bool:
        return op.done or now - op.started_s >= self.timeout_s(op.num_tokens)


POLICIES: dict[str, type[StopPolicy]] = {
    "best_effort": BestEffort, "wait_complete": WaitComplete, "timeout": Timeout,
}
# SGLang's extra-config keys for the timeout policy -> our field names.
TIMEOUT_KEYS = {"prefetch_timeout_base": "base_s", "prefetch_timeout_per_ki_token": "per_ki_token_s",
                "prefetch_timeout_max": "max_s"}


def make_policy(policy: str | StopPolicy = "best_effort",
                extra_config: Mapping[str, Any] | None = None) -> StopPolicy:
    """A policy from its SGLang name (timeout knobs from SGLang's ``extra_config`` keys), or
    ``policy`` itself. Raises ValueError naming the valid policies."""
    if isinstance(policy, StopPolicy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown prefetch policy {policy!r}; valid: {sorted(POLICIES)}")
    if policy != "timeout":
        return POLICIES[policy]()
    knobs = {ours: extra_config[key] for key, ours in TIMEOUT_KEYS.items()
             if extra_config and key in extra_config}
    return Timeout(**knobs)


class PrefetchOperation:
    """One prefetch (see the module docstring). Created by ``Client.prefetch``.

    Progress fields are written by the operation's thread and safe to read from any thread:
    ``hit_pages`` (None until the exists answer), ``restorable`` (the endpoints it named),
    ``completed_pages`` (KV + ALL_PAGES sidecar pages that arrived; always a prefix),
    ``sidecar_results`` (per trailing pool, one bool per key), ``error`` (what ended it early).
    ``on_progress(op, completed_pages)`` runs on the operation's thread after every chunk.
    """

    def __init__(self, client: Client, keys: Sequence[str], host_indices: Any,
                 sidecars: Sequence[Any] = (), policy: StopPolicy | None = None, *,
                 chunk_pages: int = 128,
                 on_progress: Callable[[PrefetchOperation, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if chunk_pages < 1:
            raise ValueError(f"chunk_pages must be >= 1, got {chunk_pages}")
        self.client = client
        self.keys = key_list(keys)
        self.page_size = client.pool_io(KV).page_size
        self.num_tokens = len(self.keys) * self.page_size
        n = len(host_indices) if host_indices is not None else 0
        if n != self.num_tokens:
            raise LengthMismatch(f"prefetch of {len(self.keys)} pages needs {self.num_tokens} KV "
                                 f"host indices (page_size {self.page_size}), got {n}")
        self.host_indices = host_indices
        self.all_pages: list[Any] = []
        self.trailing: list[Any] = []
        for t in sidecars:
            name = pool_value(t.name)
            key_list(t.keys or (), f"pool {name!r}: keys")  # (only their number is used)
            client.pool_io(name)  # UnknownPool now rather than on the thread
            policy_name = policy_value(t.hit_policy)
            (self.all_pages if policy_name == PoolHitPolicy.ALL_PAGES.value
             else self.trailing).append(t)
        self.policy = policy or BestEffort()
        self.chunk_pages = chunk_pages
        self.on_progress = on_progress
        self._clock = clock
        self.started_s = clock()
        self.hit_pages: int | None = None
        self.restorable: list[int] = []
        self.completed_pages = 0
        self.sidecar_results: dict[str, list[bool]] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hicached-prefetch", daemon=True)

    def start(self) -> None:
        """Start the operation's thread (``Client.prefetch`` does this)."""
        self._thread.start()

    # ------------------------------------------------------------ the caller's side

    @property
    def done(self) -> bool:
        """The thread finished: all promised pages handled, terminated, or failed."""
        return self._done.is_set()

    @property
    def terminated(self) -> bool:
        return self._stop.is_set()

    @property
    def restorable_pages(self) -> int:
        """Pages the caller can use now: ``completed_pages``, or 0 when a trailing sidecar was
        requested and its state did not arrive (a Mamba prefix is useless without its state)."""
        if self.trailing and not all(
                all(self.sidecar_results.get(pool_value(t.name), [False])) for t in self.trailing):
            return 0
        return self.completed_pages

    def should_stop(self, now: float | None = None) -> bool:
        """Whether the policy lets the caller stop waiting at ``now`` (default: the clock)."""
        return self.policy.should_stop(self, self._clock() if now is None else now)

    def terminate(self, wait: bool = True, timeout_s: float | None = None) -> int:
        """Stop at the next chunk boundary. With ``wait``, join the thread (the current chunk
        finishes; each call is bounded by the client's deadline) and return ``restorable_pages``:
        after that nothing writes into the host pools any more."""
        self._stop.set()
        if wait:
            self._thread.join(timeout_s)
        return self.restorable_pages

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until done (or ``timeout_s``); returns ``done``."""
        return self._done.wait(timeout_s)

    # ------------------------------------------------------------ the operation's thread

    def _run(self) -> None:
        try:
            self._exists()
            self._read_chunks()
            self._read_trailing()
        except Exception as e:  # noqa: BLE001 - a failed prefetch is a short one, never a crash
            self.error = e
            log.warning("prefetch of %d pages stopped after %d: %s: %s", len(self.keys),
                        self.completed_pages, type(e).__name__, e)
        finally:
            self._done.set()

    def _exists(self) -> None:
        queries = [PoolTransfer(t.name, keys=list(t.keys or ()), hit_policy=t.hit_policy)
                   for t in (*self.all_pages, *self.trailing)]
        res = self.client.batch_exists_v2(self.keys, queries)
        self.restorable = list(res.restorable_prefix_pages or [])
        self.hit_pages = res.kv_hit_pages

    def _read_chunks(self) -> None:
        hit, chunk = self.hit_pages or 0, self.chunk_pages
        for start in range(0, hit, chunk):
            if self._stop.is_set():
                return
            end = min(hit, start + chunk)
            keys = self.keys[start:end]
            transfers = [PoolTransfer(KV, self.host_indices[start * self.page_size:
                                                            end * self.page_size], keys=keys)]
            for t in self.all_pages:
                p = self.client.pool_io(pool_value(t.name)).page_size
                transfers.append(PoolTransfer(t.name, t.host_indices[start * p:end * p],
                                              keys=keys))
            got = self.client.batch_get_v2(transfers)
            arrived = min(leading_run(row) for row in got.values())
            self.completed_pages = start + arrived
            if self.on_progress is not None:
                self.on_progress(self, self.completed_pages)
            if arrived < end - start:
                return

    def _read_trailing(self) -> None:
        hit = self.hit_pages or 0
        if not self.trailing or hit == 0 or self.completed_pages < hit or self._stop.is_set():
            return
        transfers = []
        for t in self.trailing:
            window = max(1, len(t.keys or ()))
            keys = self.keys[max(0, hit - window):hit]
            p = self.client.pool_io(pool_value(t.name)).page_size
            transfers.append(PoolTransfer(t.name, t.host_indices[:len(keys) * p], keys=keys,
                                          hit_policy=t.hit_policy))
        self.sidecar_results = self.client.batch_get_v2(transfers)
