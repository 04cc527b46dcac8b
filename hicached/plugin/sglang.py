"""SGLang HiCache L3 storage backend backed by the node's hicached daemon.

Enable it with SGLang's dynamic backend loader (``cls(storage_config, {})`` is how it is built):

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicached",
        "module_path": "hicached.plugin.sglang", "class_name": "HicachedStorage",
        "endpoint": "ipc:///run/hicached/hicached.sock", "interface_v1": 1}'

(or ``'@/path/conf.json|.toml|.yaml'``). extra_config keys read here (``PluginSettings``):
``endpoint`` (default ``ipc://<runtime dir>/hicached.sock``; ``socket`` = a path also works),
``timeout_s`` (6.0: a daemon slower than this is a miss; a little over the daemon's own bound on
waiting for L3 loads, ``get_wait_s``, 2 s by default, so that answer comes first), ``retry_interval_s`` (1.0:
after a call failed for a daemon down, hung or restarting, every call misses at once for this
long, then twice as long after each further failure, up to 30 s; a success resets it), ``model_name``, ``model_revision``, ``namespace_salt``, ``kv_cache_dtype`` (see
``namespace.py``), ``token`` (the daemon's ``client_token``; default: the engine's
``HICACHED_CLIENT_TOKEN`` variable), ``clear_tier`` ("all" | "l2" | "none": which tiers ``clear()``
flushes), ``clear_scope`` ("namespace": this rank's namespace's pages only, the default; "node":
every page of the daemon, whoever stored it).
SGLang itself reads ``interface_v1`` (1: KV through ``batch_get_v1``/``batch_set_v1``, one copy
per page; otherwise the generic ``batch_get``/``batch_set`` with a staging page, two copies) and
``allocator``.

Which SGLang call does what (each SGLang thread has a ``hicached.Client`` of its own,
``sessions.py``, so an exists never waits behind another thread's set):

    register_mem_pool_host / register_mem_host_pool_v2   remember the pool; KV fixes the namespace
    on_host_pools_registered                             connect + register the pools (eager)
    exists / batch_exists                                KV prefix length
    batch_exists_v2                                      restorable prefix over every pool
    batch_get_v1 / batch_set_v1                          KV pages <-> the registered KV host pool
    get / batch_get / set / batch_set                    KV pages <-> flat page tensors (v0)
    batch_get_v2 / batch_set_v2                          every registered pool (``pools.py``)
    clear / get_stats / close                            flush, counters + metrics, disconnect

Every pool SGLang registers is served under its name (Mamba, SWA, DSA indexer, draft pools,
DeepSeek V4's compressed pools and states, ...); ``pools.py`` lists SGLang 0.5.23's pools and
which of them TP ranks share. DeepSeek V4's KV anchor holds no bytes: its pages are stored as
marker bytes, so its presence gates the other pools as SGLang expects.

Failure behaviour: the I/O methods never raise. A daemon that is down, restarting or slower than
``timeout_s`` answers a miss (False / 0 / None); the first failure of an episode is logged, every
one counted (``get_stats().counters``); the client reconnects on its own (a restarted daemon is
re-joined, pools registered again). Pools never registered, pools whose registration failed and
``BLOCK_GROUPS`` queries (no producer in SGLang 0.5.23) answer misses. Writes of replicated pools
on a non-writer MLA rank are skipped and reported stored (the writer rank stores them). A caller's
bug is not a miss: keys given as one ``str`` or ``bytes`` instead of a list of keys raise
``InvalidArgument`` naming the argument (iterating one would make each character a key).

``"allocator": "shm"``: SGLang then allocates the host pools as memfd shared memory. hicached has
no use for that: this plugin runs inside the engine process and already copies straight between
the host pool's own memory (its tensors or ``get_page_buffer_meta`` pointers) and the daemon's
arena, one memcpy per page. Mapping the engine's pool into the daemon would save a copy only if
the daemon read/wrote L3 from engine memory, bypassing the node-wide L2 that lets other engines
and restarts hit; and SGLang's memfds have no path, so the daemon could only get them by fd
passing, which the ZeroMQ control socket cannot do. The setting is accepted and logged.

Without SGLang installed the module still imports and ``HicachedStorage`` is a plain class with
the same methods (for engines that mimic SGLang's calls); with SGLang installed it subclasses
SGLang's ``HiCacheStorage`` ABC (imported through ``_sglang_compat`` when SGLang is not loaded),
which SGLang's factory requires. Result types are SGLang's (``PoolTransferResult``) when present.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hicached.client.api import Client
from hicached.errors import DaemonUnavailable
from hicached.plugin._sglang_compat import import_sglang
from hicached.plugin.health import PluginHealth
from hicached.plugin.namespace import RankNamespace
from hicached.plugin.sessions import RankSessions
from hicached.plugin.settings import PluginSettings
from hicached.types import PoolTransfer, key_list
from hicached.types import PoolTransferResult as _OwnResult

_hs = import_sglang()
_Base: type = _hs.HiCacheStorage if _hs is not None else object
_Result: type = _hs.PoolTransferResult if _hs is not None else _OwnResult
_RESULT_HAS_RESTORABLE = any(f.name == "restorable_prefix_pages"
                             for f in dataclasses.fields(_Result))

POLICIES = ("all_pages", "trailing_pages")
T = TypeVar("T")


def _value(x: Any) -> str:
    """The plain string of a pool name / hit policy (SGLang's str enums or strings)."""
    return str(getattr(x, "value", x))


def _chain(extra_info: Any) -> dict[str, Any]:
    """The ``parent`` / ``depth`` keyword arguments of a set call from SGLang's
    ``HiCacheStorageExtraInfo.prefix_keys`` (the keys of every page before the call's first,
    sent only with ``hicache_storage_pass_prefix_keys: true``): its last key and its length.
    Nothing (a root of unknown depth) without them, or when they are not a list of keys."""
    prefix = getattr(extra_info, "prefix_keys", None)
    if not isinstance(prefix, (list, tuple)) or (prefix and not isinstance(prefix[-1], str)):
        return {}
    return {"parent": prefix[-1] if prefix else None, "depth": len(prefix)}


def _result(kv_hit_pages: int, hits: dict[str, int], restorable: list[int]) -> Any:
    """SGLang's ``PoolTransferResult`` (``restorable_prefix_pages`` only where it exists)."""
    if _RESULT_HAS_RESTORABLE:
        return _Result(kv_hit_pages, hits, restorable)
    return _Result(kv_hit_pages, hits)


class HicachedStorage(_Base):
    """SGLang ``HiCacheStorage`` over a hicached daemon. Thread-safe; I/O methods never raise."""

    def __init__(self, storage_config: Any, kwargs: dict | None = None):
        self.storage_config = storage_config
        self.settings = PluginSettings.from_extra_config(  # the engine side's edge: its env
            getattr(storage_config, "extra_config", None), os.environ)
        tp_rank = getattr(storage_config, "tp_rank", 0)
        self.name = f"hicached plugin (tp{tp_rank})"
        self._health = PluginHealth(self.name, bool(getattr(storage_config,
                                                            "enable_storage_metrics", False)))
        self._sessions = RankSessions(self.settings, storage_config, self.name, self._health)
        self.mem_pool_host: Any = None
        self.registered_pools: dict[Any, Any] = {}
        if self.settings.allocator == "shm":
            self._health.warn_once("shm", f"{self.name}: allocator 'shm' accepted; hicached "
                                   "copies from the host pool in-process either way (see "
                                   "hicached.plugin.sglang)", level=logging.INFO)

    @property
    def namespace(self) -> RankNamespace | None:
        """This rank's namespace (fixed by the KV pool), None before one is registered."""
        return self._sessions.namespace

    # ------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The anchor KV host pool (called first, right after construction)."""
        self.mem_pool_host = mem_pool_host
        self._sessions.add_pool("kv", mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Every pool of the host pool group (KV again, then sidecars; later dynamic ones)."""
        self.registered_pools[host_pool_name] = host_pool
        self._sessions.add_pool(_value(host_pool_name), host_pool)

    def on_host_pools_registered(self) -> None:
        """Connect now (not on the first request) so problems show at attach. Never raises."""
        try:
            self._sessions.connect()
        except DaemonUnavailable as e:  # a down daemon must not fail the attach
            self._health.unavailable("on_host_pools_registered", e)
        except Exception as e:  # noqa: BLE001 - nor anything else: I/O answers misses
            self._health.error("on_host_pools_registered", e)
        else:
            self._health.warn_once("connected", f"{self.name}: namespace "
                                   f"{self.namespace.namespace!r} at {self.settings.endpoint}",
                                   level=logging.INFO)

    def _guard(self, op: str, miss: Callable[[], T], fn: Callable[[Client], T]) -> T:
        return self._sessions.guard(op, miss, fn)

    def _sample(self, client: Client, kind: str, wire: str, pages: int, t0: float) -> None:
        if self._health.record_metrics and pages:
            nbytes = pages * client.pool_io(wire).page_bytes
            self._health.sample(kind, pages, nbytes, time.perf_counter() - t0)

    # ------------------------------------------------------------ exists

    def exists(self, key: str) -> bool:
        """Whether the KV page of ``key`` is stored."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading keys whose KV page is stored (0 when the daemon is unavailable)."""
        keys = key_list(keys)
        if not keys:
            return 0

        def run(client: Client) -> int:
            n = client.batch_exists(keys)
            self._health.add(calls=1, exists_pages=len(keys), hit_pages=n)
            return n

        return self._guard("batch_exists", lambda: 0, run)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[Any] | None = None,
                        extra_info: Any = None) -> Any:
        """SGLang's hit semantics over every pool (hicached.hits): ``kv_hit_pages`` = the
        largest prefix all pools can restore, per-pool hits, ``restorable_prefix_pages``."""
        keys = key_list(keys)
        transfers = list(pool_transfers or ())
        for t in transfers:
            key_list(t.keys or (), f"pool {_value(t.name)!r}: keys")
        if not keys:
            return _result(0, {}, [])

        def run(client: Client) -> Any:
            queries, miss_all = [], False
            for t in transfers:
                name, policy = _value(t.name), _value(t.hit_policy)
                if name == "kv":
                    continue  # the anchor itself: an ALL_PAGES KV query adds nothing
                if not self._sessions.usable(name) or policy not in POLICIES:
                    miss_all = True  # this pool restores nothing, so no prefix is restorable
                    self._health.warn_once(f"exists:{name}:{policy}", f"{self.name}: exists "
                                           f"query for pool {name!r} ({policy}) answers a miss")
                    continue
                queries.append(PoolTransfer(self._sessions.wire(name),
                                            keys=key_list(t.keys or ()), hit_policy=policy))
            res = client.batch_exists_v2(keys, queries)
            hits = {wire.split("@")[0]: n for wire, n in res.extra_pool_hit_pages.items()}
            final, restorable = res.kv_hit_pages, list(res.restorable_prefix_pages or [])
            if miss_all:
                final, restorable = 0, []
            self._health.add(calls=1, exists_pages=len(keys), hit_pages=final)
            return _result(final, hits, restorable)

        return self._guard("batch_exists_v2", lambda: _result(0, {}, []), run)

    # ------------------------------------------------------------ KV: v1 (zero-copy) path

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None
                     ) -> list[bool]:
        """Load KV pages into the registered KV host pool at ``host_indices``."""
        return self.batch_get_v2([PoolTransfer("kv", host_indices, keys=key_list(keys))])["kv"]

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None
                     ) -> list[bool]:
        """Store KV pages from the registered KV host pool at ``host_indices``."""
        return self.batch_set_v2([PoolTransfer("kv", host_indices, keys=key_list(keys))],
                                 extra_info)["kv"]

    # ------------------------------------------------------------ KV: generic (v0) path

    def _flat(self, name: str, pages: list[Any], fresh: bool = False) -> list[Any]:
        """Flat page tensors as the client takes them: a pool whose pages hold no bytes
        (DeepSeek V4's KV anchor) is stored as one marker byte per page (``pools.MarkerPages``);
        ``fresh``: buffers to read into (the caller's empty pages are returned as they are)."""
        if not self._sessions.is_marker(name):
            return pages
        if fresh:
            return [torch.zeros(1, dtype=torch.uint8) for _ in pages]
        return [torch.ones(1, dtype=torch.uint8) for _ in pages]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """One KV page into ``target_location`` (a flat page tensor); None on a miss."""
        targets = None if target_location is None else [target_location]
        return self.batch_get([key], targets)[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        """KV pages into flat page tensors (SGLang passes ``get_dummy_flat_data_page()`` each);
        the filled tensor per hit, None per miss."""
        keys = key_list(keys)
        if not keys:
            return []
        misses = [None] * len(keys)
        if not self._sessions.usable("kv"):
            self._health.add(calls=1, unsupported_pool_pages=len(keys))
            return misses

        def run(client: Client) -> list[Any]:
            targets = (list(target_locations) if target_locations is not None else
                       [self._sessions.pools["kv"].get_dummy_flat_data_page() for _ in keys])
            t0 = time.perf_counter()
            ok = client.batch_get_pages("kv", keys, self._flat("kv", targets, fresh=True))
            self._sample(client, "prefetch", "kv", sum(ok), t0)
            self._health.add(calls=1, read_pages=len(keys), read_hit_pages=sum(ok))
            return [t if hit else None for t, hit in zip(targets, ok, strict=True)]

        return self._guard("batch_get", lambda: misses, run)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store one flat KV page."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat KV pages (``get_data_page(i)`` each); True when all are stored. (SGLang
        passes no prefix keys on this path: its pages are roots of unknown depth.)"""
        keys = key_list(keys)
        if not keys:
            return True
        if not self._sessions.writes("kv"):
            self._health.add(calls=1, skipped_write_pages=len(keys))
            return True
        if not self._sessions.usable("kv") or values is None:
            self._health.add(calls=1, unsupported_pool_pages=len(keys))
            return False

        def run(client: Client) -> bool:
            t0 = time.perf_counter()
            ok = client.batch_set_pages("kv", keys, self._flat("kv", list(values)))
            self._sample(client, "backup", "kv", sum(ok), t0)
            self._health.add(calls=1, write_pages=len(keys), written_pages=sum(ok))
            return all(ok)

        return self._guard("batch_set", lambda: False, run)

    # ------------------------------------------------------------ v2: every pool

    def _split(self, transfers: list[Any], writing: bool
               ) -> tuple[dict[Any, list[bool]], list[tuple[Any, PoolTransfer]]]:
        """Answer what needs no daemon (unknown pools, bad indices, skipped writes) and build
        the daemon transfers (wire pool names) for the rest."""
        done: dict[Any, list[bool]] = {}
        todo: list[tuple[Any, PoolTransfer]] = []
        for t in transfers:
            name = _value(t.name)
            keys = key_list(t.keys or (), f"pool {name!r}: keys")
            if not keys:
                done[t.name] = []
            elif writing and not self._sessions.writes(name):
                done[t.name] = [True] * len(keys)
                self._health.add(skipped_write_pages=len(keys))
            elif not self._sessions.usable(name):
                done[t.name] = [False] * len(keys)
                self._health.add(unsupported_pool_pages=len(keys))
            else:
                page_size = self._sessions.page_size(name)
                n = 0 if t.host_indices is None else len(t.host_indices)
                if n != len(keys) * page_size:
                    self._health.warn_once(f"indices:{name}", f"{self.name}: pool {name!r}: "
                                           f"{len(keys)} keys need {len(keys) * page_size} host "
                                           f"indices, got {n}; answering misses")
                    done[t.name] = [False] * len(keys)
                else:
                    policy = _value(getattr(t, "hit_policy", None)) or "all_pages"
                    todo.append((t.name, PoolTransfer(  # the policy: the daemon keeps states
                        self._sessions.wire(name), t.host_indices, keys=keys,  # with their KV
                        hit_policy=policy if policy in POLICIES else "all_pages")))
        return done, todo

    def _batch_v2(self, transfers: list[Any], writing: bool, extra_info: Any = None
                  ) -> dict[Any, list[bool]]:
        done, todo = self._split(list(transfers), writing)
        if not todo:
            if transfers:
                self._health.add(calls=1)
            return done
        op, kind = ("batch_set_v2", "backup") if writing else ("batch_get_v2", "prefetch")

        def run(client: Client) -> dict[str, list[bool]]:
            t0 = time.perf_counter()
            calls = [pt for _, pt in todo]
            got = (client.batch_set_v2(calls, **_chain(extra_info)) if writing
                   else client.batch_get_v2(calls))
            pages = sum(len(pt.keys) for pt in calls)
            ok = sum(sum(row) for row in got.values())
            for pt in calls:
                self._sample(client, kind, pt.name, sum(got[pt.name]), t0)
            if writing:
                self._health.add(calls=1, write_pages=pages, written_pages=ok)
            else:
                self._health.add(calls=1, read_pages=pages, read_hit_pages=ok)
            return got

        got = self._guard(op, lambda: {pt.name: [False] * len(pt.keys) for _, pt in todo}, run)
        for key, pt in todo:
            done[key] = got[pt.name]
        return done

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None
                     ) -> dict[Any, list[bool]]:
        """Load each transfer's pages into its registered host pool; one bool per key."""
        return self._batch_v2(transfers, writing=False)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None
                     ) -> dict[Any, list[bool]]:
        """Store each transfer's pages, all pools of the call published at once. With
        ``extra_info.prefix_keys`` the daemon learns where the pages hang (``_chain``): SGLang
        gives every transfer of one call the same prefix (``_trailing_chain_groups``)."""
        return self._batch_v2(transfers, writing=True, extra_info=extra_info)

    # ------------------------------------------------------------ admin

    def clear(self) -> bool:
        """SGLang's "clear storage": flush ``clear_tier`` of this rank's namespace (its pages in
        L2, and in L3 where the backend finds them by namespace: file, Mooncake), or of the
        whole node with ``clear_scope`` "node" (every engine's pages). Other engines of the
        same namespace (same model and geometry) share its pages: they lose them too. Never
        raises; False when not done (a daemon too old to flush one namespace, an L3 backend
        that cannot find a namespace's pages: nothing is flushed then)."""
        if self.settings.clear_tier == "none":
            self._health.warn_once("clear", f"{self.name}: clear() ignored (clear_tier none)")
            return False
        node = self.settings.clear_scope == "node"

        def run(client: Client) -> bool:
            client.flush(self.settings.clear_tier, namespace=None if node else client.namespace)
            return True

        return self._guard("clear", lambda: False, run)

    def client(self) -> Client | None:
        """The connected ``hicached.Client`` (pools registered), or None while the daemon is
        unavailable: for engines that drive hicached through this plugin and also want daemon
        stats or ``Client.prefetch`` with a stop policy. Never raises."""
        try:
            return self._sessions.connect()
        except Exception as e:  # noqa: BLE001 - unavailable is an answer here
            self._health.unavailable("client", e)
            return None

    @property
    def failures(self) -> int:
        """Calls answered as misses because the daemon was unavailable or failing."""
        return self._health.counters["unavailable"] + self._health.counters["errors"]

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (or ``PluginStats``): read/write pages and GB/s per call
        since the last call (recorded when SGLang enables storage metrics), plus ``counters``."""
        return self._health.get_stats()

    def close(self) -> None:
        """Disconnect every thread's session (idempotent); later calls answer misses."""
        self._sessions.close()
