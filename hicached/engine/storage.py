"""The one place the engine calls hicached (L2 = the daemon's arena, L3 = its backends).

It goes through the SGLang plugin (``hicached/plugin/sglang.py``), the same path an SGLang
deployment uses, and ``hicached/client/prefetch.py`` for the stop policies. Everything else in the
engine speaks two methods:

    prefetch(keys, usable_pages, kv_pages_have, reserve)   exists + get of the longest prefix
                                                           every pool can restore
    store(kv_keys, kv_pages, state_keys, state_slots,      one atomic multi-pool batch_set_v2
          prefix_keys)                                     (SGLang's prefix keys: the chain)

Pools registered with the daemon (the device pools' host geometry, ``pools.py``):

    kv       one page per key (MHA K/V or the MLA latent)            ALL_PAGES
    indexer  DSA indexer keys, same keys and page ids as kv          ALL_PAGES
    mamba    one state per key: the state after that page            TRAILING_PAGES, window 1

Stop policies (``prefetch_policy``, SGLang's names, ``hicached.client.prefetch``): ``wait_complete``
gets every page the exists answer named in one call. ``timeout`` and ``best_effort`` run the get
as a ``PrefetchOperation`` (chunks on a background thread) and keep what arrived when the policy
says stop: up to the timeout (base + per 1024 tokens, capped), or nothing more than is there at
once. A partial KV prefix is usable only for pools without trailing state; a hybrid model's
prefix needs its Mamba state, which arrives after all its KV pages.

A daemon that is down, restarting or failing never fails a request: the plugin answers misses
(or unstored pages), logs once per outage and counts them (``errors``); its client re-joins a
restarted daemon by itself.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import NamedTuple

import torch

from hicached.engine.pools import IndexerPool, KVPool, StatePool
from hicached.errors import HicachedError
from hicached.types import PoolHitPolicy, PoolName, PoolTransfer

log = logging.getLogger(__name__)

# Where a PD prefill's pages must be before it says "ready" (``Storage.wait_visible``): in the
# daemon's L2 (the decode uses the same daemon: one node), or in its L3 (the decode's daemon
# shares the store: two nodes).
TRANSFER_TIERS = ("l2", "l3")


class Reservation(NamedTuple):
    """Device room for a load: KV (and indexer) pages, and a state slot (hybrid models)."""

    kv_pages: list[int]
    state: int | None


class Fetched(NamedTuple):
    """``end_pages``: the prefix (pages) restorable on the device after the load (0: nothing
    loaded; the caller frees ``reservation``); keys ``[first_page, end_pages)`` were loaded into
    ``reservation.kv_pages``; ``l3_fraction`` estimates how much came from L3 (daemon counters,
    exact when the engine is the daemon's only client)."""

    end_pages: int
    first_page: int
    reservation: Reservation | None
    l3_fraction: float


MISS = Fetched(0, 0, None, 0.0)


class Storage(abc.ABC):
    """L2/L3 as the engine sees it. Calls never raise for a storage failure: they miss."""

    name = "abstract"
    enabled = True

    @abc.abstractmethod
    def prefetch(self, keys: Sequence[str], usable_pages: int, kv_pages_have: int,
                 reserve: Callable[[int], Reservation | None], kv_only: bool = False
                 ) -> Fetched:
        """Load the longest prefix of ``keys`` that every pool can restore, if it is longer
        than ``usable_pages`` (what the device can already resume from). The device holds KV
        for keys ``[0, kv_pages_have)``: only later KV pages are loaded (plus the state at the
        end). ``reserve(n)`` allocates n device pages (and a slot), or None when it cannot.
        ``kv_only``: a load that would bring only a state (no KV page past ``kv_pages_have``)
        is not made. hicached is asked about keys from the first that could matter on
        (``kv_pages_have`` with ``kv_only``, else ``usable_pages``), never about pages only
        the device needs (a daemon pulls L3-only pages into L2 when asked about them)."""

    @abc.abstractmethod
    def store(self, kv_keys: Sequence[str], kv_pages: Sequence[int], state_keys: Sequence[str],
              state_slots: Sequence[int], prefix_keys: Sequence[str] | None = None
              ) -> tuple[bool, bool]:
        """Write KV (and indexer) pages and states in one call; (all KV stored, all states
        stored). ``prefix_keys``: the keys of every page before the call's first key (its
        first KV key, else its only state key), as SGLang passes them; None: not known."""

    def load(self, kv_keys: Sequence[str], kv_pages: Sequence[int], state_keys: Sequence[str],
             state_slots: Sequence[int]) -> bool:
        """Get exactly these keys into these device pages (and slots): no exists, no prefix
        rule (the PD decode's delta, whose earlier pages the device already holds). True when
        every page and state arrived; False leaves the pages' contents undefined."""
        return False

    def wait_visible(self, kv_keys: Sequence[str] = (), state_keys: Sequence[str] = (), *,
                     tier: str = "l2", timeout_s: float | None = None) -> None:
        """Block until stored pages are visible to other engines (the PD prefill's "ready");
        raise ``HicachedError`` when that cannot be known. ``tier``: ``l2``, every store so
        far is visible to the daemon's other clients (one node); ``l3``, the pages of
        ``kv_keys`` (and the indexer's) and the states of ``state_keys`` are stored in L3,
        visible to every daemon sharing the store (two nodes)."""
        raise HicachedError(f"storage {self.name!r} shares nothing with other processes")

    def close(self) -> None:
        """Release connections (idempotent)."""


class NullStorage(Storage):
    """``--hicache-storage-backend none``: every lookup misses, nothing is stored."""

    name = "none"
    enabled = False

    def prefetch(self, keys, usable_pages, kv_pages_have, reserve, kv_only=False) -> Fetched:
        return MISS

    def store(self, kv_keys, kv_pages, state_keys, state_slots, prefix_keys=None
              ) -> tuple[bool, bool]:
        return False, False


def _token_indices(pages: Sequence[int], page_size: int) -> torch.Tensor:
    """Token-granular host indices of whole pages (page i starts at ``idx[i * page_size]``)."""
    p = torch.as_tensor(list(pages), dtype=torch.long)
    return (p[:, None] * page_size + torch.arange(page_size)).reshape(-1)


class HicachedStorage(Storage):
    """The engine's pools in a hicached daemon, through the SGLang plugin
    (``hicached.plugin.sglang.HicachedStorage``: the path an SGLang deployment uses; it never
    raises, a daemon that is down or slow is a miss)."""

    name = "hicached"

    def __init__(self, endpoint: str, namespace: str, kv: KVPool, indexer: IndexerPool | None,
                 states: StatePool | None, *, prefetch_policy: str = "wait_complete",
                 timeout_s: float = 5.0, retry_s: float = 1.0):
        """``timeout_s``: deadline of one daemon call; ``retry_s``: after a failed connect,
        calls miss at once for this long (a dead daemon costs one timeout, not one per call).
        ``namespace`` (model, weights, dtype, layout, slice, tenant: ``hicached.keys``) is the
        plugin's model name, so the plugin's namespace carries all of it."""
        from hicached.client.prefetch import make_policy
        from hicached.plugin.sglang import HicachedStorage as Plugin

        self.policy = make_policy(prefetch_policy)  # ValueError names the valid ones
        self.endpoint, self.namespace, self.timeout_s = endpoint, namespace, timeout_s
        self.prefetch_policy = prefetch_policy
        self.kv, self.indexer, self.states = kv, indexer, states
        self.page_size = kv.page_size
        config = SimpleNamespace(
            model_name=namespace, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
            is_mla_model=False, enable_storage_metrics=False,
            extra_config={"endpoint": endpoint, "timeout_s": timeout_s,
                          "retry_interval_s": retry_s, "clear_tier": "none"})
        self.plugin = Plugin(config, {})
        self.plugin.register_mem_pool_host(kv.host)
        self.plugin.register_mem_host_pool_v2(kv.host, PoolName.KV)
        if indexer is not None:
            self.plugin.register_mem_host_pool_v2(indexer.host, PoolName.INDEXER)
        if states is not None:
            self.plugin.register_mem_host_pool_v2(states.host, PoolName.MAMBA)
        self.plugin.on_host_pools_registered()

    @property
    def errors(self) -> int:
        """Daemon calls that were answered as misses (down, slow or failing)."""
        return self.plugin.failures

    @property
    def client(self):
        """The plugin's connected client, or None (for stats, flush and prefetch)."""
        return self.plugin.client()

    def _l3_loads(self) -> int:
        c = self.plugin.client()
        try:
            return c.stats().get("l3_loads", 0) if c is not None else 0
        except HicachedError:
            return 0

    def _sidecars_query(self) -> list[PoolTransfer]:
        out = []
        if self.states is not None:
            out.append(PoolTransfer(PoolName.MAMBA, keys=["_"],
                                    hit_policy=PoolHitPolicy.TRAILING_PAGES))
        if self.indexer is not None:
            out.append(PoolTransfer(PoolName.INDEXER, hit_policy=PoolHitPolicy.ALL_PAGES))
        return out

    def prefetch(self, keys, usable_pages, kv_pages_have, reserve, kv_only=False) -> Fetched:
        # Asked from the first page that could matter: the device holds KV pages [0, have),
        # and a state at the end of [0, usable] or before is of no use. The keys are chain
        # hashes (each names its whole prefix), so a run from ``start`` is this prompt's; and
        # exists starts pulling L3-only pages into L2, which pages the device holds would waste
        # (the PD decode asked for its whole prompt: every page of its match crossed the store)
        start = min(kv_pages_have if kv_only else usable_pages, len(keys))
        if start == len(keys):
            return MISS
        # exists already starts pulling L3-only pages into L2: count L3 loads from here
        before = self._l3_loads()
        hit = self.plugin.batch_exists_v2(list(keys[start:]), self._sidecars_query())
        ends = [start + e for e in (getattr(hit, "restorable_prefix_pages", None) or ())
                if start + e > usable_pages]
        if not ends:
            return MISS
        end = max(ends)
        if kv_only and end <= kv_pages_have:
            return MISS
        first = min(kv_pages_have, end)
        room = reserve(end - first)
        if room is None:
            return MISS
        if self.policy.name != "wait_complete":
            c = self.plugin.client()
            if c is None:
                return Fetched(0, first, room, 0.0)
            return self._prefetch_op(c, keys, first, end, room, before)
        got = self.plugin.batch_get_v2(self._transfers(keys[first:end], room.kv_pages,
                                                       [keys[end - 1]] if room.state is not None
                                                       else [], [room.state]))
        if not all(all(row) for row in got.values()):
            return Fetched(0, first, room, 0.0)
        loaded = self._l3_loads() - before
        return self._arrived(end, first, room, loaded, sum(len(r) for r in got.values()))

    def _prefetch_op(self, c, keys, first: int, end: int, room: Reservation, before: int
                     ) -> Fetched:
        """Get pages ``first..end-1`` as a ``PrefetchOperation`` and stop when the policy says
        so; keep the restorable prefix that arrived (the caller frees the rest of ``room``)."""
        idx = _token_indices(room.kv_pages, self.page_size)
        sidecars = []
        if self.indexer is not None:
            sidecars.append(PoolTransfer(PoolName.INDEXER, idx, keys=["_"],
                                         hit_policy=PoolHitPolicy.ALL_PAGES))
        if room.state is not None:
            sidecars.append(PoolTransfer(PoolName.MAMBA, torch.as_tensor([room.state]),
                                         keys=["_"], hit_policy=PoolHitPolicy.TRAILING_PAGES))
        op = c.prefetch(list(keys[first:end]), idx, sidecars, policy=self.policy)
        while not op.should_stop():
            op.wait(0.001)
        pages = op.terminate()
        if op.error is not None:
            log.warning("hicached prefetch failed (%s): computing instead", op.error)
            return Fetched(0, first, room, 0.0)
        if pages == 0:
            return Fetched(0, first, room, 0.0)
        loaded = self._l3_loads() - before
        return self._arrived(first + pages, first, room, loaded, pages)

    def _arrived(self, end: int, first: int, room: Reservation, loaded: int, asked: int
                 ) -> Fetched:
        """Pages ``first..end-1`` (and the state, if any) are in the host view: to the device."""
        room = room._replace(kv_pages=room.kv_pages[:end - first])
        self.kv.to_device(room.kv_pages)
        if self.indexer is not None:
            self.indexer.to_device(room.kv_pages)
        if room.state is not None:
            self.states.to_device([room.state])
        return Fetched(end, first, room, min(1.0, loaded / asked) if asked else 0.0)

    def _transfers(self, kv_keys, kv_pages, state_keys, state_slots) -> list[PoolTransfer]:
        out = []
        if kv_keys:
            idx = _token_indices(kv_pages, self.page_size)
            out.append(PoolTransfer(PoolName.KV, idx, keys=list(kv_keys)))
            if self.indexer is not None:
                out.append(PoolTransfer(PoolName.INDEXER, idx, keys=list(kv_keys)))
        if state_keys:
            out.append(PoolTransfer(PoolName.MAMBA, torch.as_tensor(list(state_slots)),
                                    keys=list(state_keys),
                                    hit_policy=PoolHitPolicy.TRAILING_PAGES))
        return out

    # ------------------------------------------------------------ write

    def store(self, kv_keys, kv_pages, state_keys, state_slots, prefix_keys=None
              ) -> tuple[bool, bool]:
        if not (kv_keys or state_keys):
            return False, False
        self.kv.to_host(kv_pages)
        if self.indexer is not None:
            self.indexer.to_host(kv_pages)
        if state_keys:
            self.states.to_host(state_slots)
        extra = None if prefix_keys is None else SimpleNamespace(prefix_keys=list(prefix_keys))
        res = {_pool(k): v for k, v in self.plugin.batch_set_v2(
            self._transfers(kv_keys, kv_pages, state_keys, state_slots), extra).items()}
        kv_ok = all(res.get(PoolName.KV.value, [])) and all(res.get(PoolName.INDEXER.value, []))
        return kv_ok, all(res.get(PoolName.MAMBA.value, []))

    def load(self, kv_keys, kv_pages, state_keys, state_slots) -> bool:
        if not (kv_keys or state_keys):
            return True
        got = self.plugin.batch_get_v2(self._transfers(kv_keys, kv_pages, state_keys,
                                                       state_slots))
        if not got or not all(all(row) for row in got.values()):
            return False
        self.kv.to_device(list(kv_pages))
        if self.indexer is not None:
            self.indexer.to_device(list(kv_pages))
        if state_keys:
            self.states.to_device(list(state_slots))
        return True

    def wait_visible(self, kv_keys=(), state_keys=(), *, tier="l2", timeout_s=None) -> None:
        """``l2``: ``Client.wait_committed``; ``l3``: ``Client.wait_stored`` of the pages
        (read after their commit on the same socket)."""
        from hicached.errors import DaemonUnavailable

        if tier not in TRANSFER_TIERS:
            raise ValueError(f"unknown transfer tier {tier!r}; valid: {list(TRANSFER_TIERS)}")
        c = self.plugin.client()
        if c is None:
            raise DaemonUnavailable(f"no hicached daemon at {self.endpoint}")
        if tier == "l2":
            c.wait_committed(timeout_s or self.timeout_s)
            return
        pools = [PoolName.KV.value]
        if self.indexer is not None:  # DSA: the indexer's pages go with the KV ones
            pools.append(PoolName.INDEXER.value)
        wanted = [PoolTransfer(p, keys=list(kv_keys)) for p in pools if kv_keys]
        if state_keys:
            wanted.append(PoolTransfer(PoolName.MAMBA.value, keys=list(state_keys)))
        c.wait_stored(wanted, timeout_s or self.timeout_s)

    def close(self) -> None:
        self.plugin.close()


def _pool(name) -> str:
    return getattr(name, "value", name)


def make_storage(backend: str, endpoint: str, namespace: str, kv: KVPool,
                 indexer: IndexerPool | None, states: StatePool | None, *,
                 prefetch_policy: str = "wait_complete", timeout_s: float = 5.0,
                 retry_s: float = 1.0) -> Storage:
    """The storage named by ``--hicache-storage-backend``."""
    if backend == "none":
        return NullStorage()
    if backend == "hicached":
        if not endpoint:
            raise ValueError("the hicached storage backend needs an endpoint")
        return HicachedStorage(endpoint, namespace, kv, indexer, states,
                               prefetch_policy=prefetch_policy, timeout_s=timeout_s,
                               retry_s=retry_s)
    raise ValueError(f"unknown storage backend {backend!r}; valid: ['hicached', 'none']")
