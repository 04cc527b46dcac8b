"""The SGLang plugin's daemon sessions: the rank's pools, its namespace, and one ``Client`` per
SGLang thread.

SGLang calls one storage backend from several threads at once: the backup thread (large sets),
the prefetch thread (exists), the prefetch I/O thread (gets) and the scheduler (attach, clear,
stats). A ``hicached.Client`` is thread-safe, but its one socket serves one request at a time
under one lock, and a set copies its pages into set-ahead slots (and a get speculatively) while
its request travels, inside that lock: one shared client made every exists wait for the copy of
a whole set in another thread (tens of ms for a batch of large pages, unbounded by
``timeout_s``). So each thread gets a client (a daemon session) of its own, made on its first
call; a client whose thread ended is closed when another thread makes one, all of them by
``close()``. What that costs: a handshake per thread, and a thread reads another thread's writes
only once the daemon read their commit (microseconds; a miss meanwhile only costs a recompute).

Pools (``add_pool``) are registered with every client (``pools.page_source``: zero-byte pools as
marker pages), under their wire names: ``pools.rank_sharing`` decides which pools carry the TP
rank in a replicated namespace (``namespace.RankNamespace.wire_pool``). A pool the daemon refuses
(another page size under the namespace, say) is broken for all threads: its pages miss.

Failures (``guard``): a daemon that is down, hung or restarting makes the call answer a miss, and
every call of every thread misses at once for ``retry_interval_s``, doubling up to
``backoff.MAX_BACKOFF_S`` while it keeps failing; a daemon that binds the endpoint anew (a
restart) ends the back-off at the next call (``backoff.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hicached.client.api import Client
from hicached.errors import DaemonUnavailable, HicachedError, UnknownPool
from hicached.plugin.backoff import RetryClock
from hicached.plugin.health import PluginHealth
from hicached.plugin.namespace import RankNamespace, build_namespace
from hicached.plugin.pools import MarkerPages, page_source, rank_sharing
from hicached.plugin.settings import PluginSettings

T = TypeVar("T")


class Backoff(DaemonUnavailable):
    """A call not tried: the daemon failed one a moment ago."""


@dataclass
class ThreadSession:
    """One thread's client and the pools not yet registered with it."""

    thread: threading.Thread
    client: Client
    pending: set[str] = field(default_factory=set)


class RankSessions:
    """The pools, namespace and per-thread clients of one SGLang rank's plugin."""

    def __init__(self, settings: PluginSettings, storage_config: Any, name: str,
                 health: PluginHealth, *, namespace: RankNamespace | None = None,
                 event_hash: str = "sglang_int64"):
        """``namespace``: fixed up front (the vLLM connector); None: built from SGLang's
        ``storage_config`` when the KV pool registers. ``event_hash``: how the engine publishes
        its KV pages' block hashes (``docs/kv-events.md``)."""
        self.settings = settings
        self.storage_config = storage_config
        self.name = name
        self.health = health
        self.namespace: RankNamespace | None = namespace
        self._fixed_namespace = namespace is not None
        self._event_hash = event_hash
        self.pools: dict[str, Any] = {}  # SGLang pool value -> host pool (as SGLang gave it)
        self._sources: dict[str, Any] = {}  # what is registered: the pool, or its MarkerPages
        self._sharded: dict[str, bool] = {}  # pool -> its pages differ per TP rank
        self._broken: dict[str, str] = {}  # pools the daemon refused -> why
        self._threads: dict[int, ThreadSession] = {}  # thread ident -> its session
        # calls answer misses without trying while it backs off (up to ``backoff.MAX_BACKOFF_S``)
        self._backoff = RetryClock(settings.endpoint, settings.retry_interval_s)
        self._closed = False
        self._lock = threading.Lock()  # pools, namespace, the sessions table

    # ------------------------------------------------------------ pools

    def add_pool(self, name: str, pool: Any) -> None:
        """Serve ``pool`` as ``name`` (registered with every client before its next call). A
        KV pool fixes the namespace; another namespace ends every session (new ones follow)."""
        sharded, why = rank_sharing(name, pool)
        stale: list[Client] = []
        with self._lock:
            if self.pools.get(name) is pool:
                return
            self.pools[name] = pool
            self._sources[name] = page_source(pool)
            self._sharded[name] = sharded
            self._broken.pop(name, None)
            for ts in self._threads.values():
                ts.pending.add(name)
            if name == "kv" and not self._fixed_namespace:
                ns = build_namespace(self.storage_config, pool,
                                     model_name=self.settings.model_name,
                                     model_revision=self.settings.model_revision,
                                     namespace_salt=self.settings.namespace_salt,
                                     kv_cache_dtype=self.settings.kv_cache_dtype)
                if self.namespace is not None and ns != self.namespace:
                    stale = [ts.client for ts in self._threads.values()]  # fixed per session
                    self._threads.clear()
                self.namespace = ns
            replicated = self.namespace is not None and self.namespace.replicated
        self._close_all(stale)
        if replicated and name != "kv":
            self.health.warn_once(f"pool:{name}", f"{self.name}: pool {name!r} ({why}) is "
                                  f"{'kept per TP rank' if sharded else 'shared by TP ranks'}",
                                  level=logging.INFO)

    def usable(self, name: str) -> bool:
        """Registered (with a KV pool, so a namespace) and not refused by the daemon."""
        return self.namespace is not None and name in self.pools and name not in self._broken

    def wire(self, name: str) -> str:
        """``name`` as the daemon sees it (``RankNamespace.wire_pool``)."""
        return self.namespace.wire_pool(name, self._sharded.get(name, True))

    def writes(self, name: str) -> bool:
        """Whether this rank stores ``name``'s pages (non-writers skip the shared pools)."""
        return self.namespace is None or self.namespace.writes(self._sharded.get(name, True))

    def page_size(self, name: str) -> int:
        """Tokens per page of the pool ``name`` (registered)."""
        return int(getattr(self.pools[name], "page_size", 1) or 1)

    def is_marker(self, name: str) -> bool:
        """Whether ``name``'s pages hold no bytes (stored as marker bytes)."""
        return isinstance(self._sources.get(name), MarkerPages)

    # ------------------------------------------------------------ clients

    def connect(self) -> Client:
        """This thread's client with every pool registered; raises DaemonUnavailable (or
        ``Backoff``) and typed errors, which ``guard`` turns into misses."""
        wait_s = self._backoff.wait_s()
        if wait_s > 0:  # the daemon failed a call lately: misses, at once
            raise Backoff(f"not retrying {self.settings.endpoint} for {wait_s:.1f} s")
        me = threading.current_thread()
        mine = self._threads.get(me.ident)
        if mine is not None and mine.thread is me and not mine.pending:
            return mine.client
        ended: list[Client] = []
        try:
            with self._lock:
                if self._closed:
                    raise DaemonUnavailable("the plugin is closed")
                if self.namespace is None:
                    raise UnknownPool("no KV host pool registered (register_mem_pool_host)")
                mine = self._threads.get(me.ident)
                if mine is None or mine.thread is not me:
                    ended = self._reap()
                    client = Client(self.settings.endpoint, self.namespace.namespace,
                                    timeout_s=self.settings.timeout_s, token=self.settings.token,
                                    client_name=f"{self.name} {me.name}")
                    mine = self._threads[me.ident] = ThreadSession(me, client, set(self.pools))
                for name in sorted(mine.pending):
                    self._register(mine.client, name)
                    mine.pending.discard(name)
                return mine.client
        finally:
            self._close_all(ended)

    def _register(self, client: Client, name: str) -> None:
        try:
            # KV pages are the engine's blocks for the daemon's KV events (docs/kv-events.md):
            # SGLang publishes its page hash as ``hash_str_to_int64``, vLLM its block hash
            # bytes; other pools are not blocks
            events = (self._event_hash, self.page_size(name)) if name == "kv" else ("", 0)
            client.register_mem_host_pool_v2(self._sources[name], self.wire(name), *events)
        except DaemonUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - a pool hicached cannot take: it misses
            self._broken[name] = f"{type(e).__name__}: {e}"
            self.health.warn_once(f"register:{name}", f"{self.name}: pool {name!r} cannot be "
                                  f"registered ({self._broken[name]}); its pages miss")

    def _reap(self) -> list[Client]:
        """Take the sessions of threads that ended (their clients are closed by the caller)."""
        gone = [i for i, ts in self._threads.items() if not ts.thread.is_alive()]
        return [self._threads.pop(i).client for i in gone]

    def current(self) -> Client | None:
        """This thread's client if it has one (no connect)."""
        mine = self._threads.get(threading.get_ident())
        return mine.client if mine is not None else None

    def guard(self, op: str, miss: Callable[[], T], fn: Callable[[Client], T]) -> T:
        """Run ``fn(client)``; any failure is counted and answered with ``miss()``."""
        try:
            result = fn(self.connect())
        except Backoff as e:
            self.health.unavailable(op, e)
            return miss()
        except DaemonUnavailable as e:  # down, hung or restarting: every call would wait its
            self.health.unavailable(op, e)  # timeout; answer misses at once for a while
            self._backoff.failed()
            return miss()
        except Exception as e:  # noqa: BLE001 - I/O methods answer misses, never raise
            self.health.error(op, e)
            return miss()
        self.health.ok()
        self._backoff.succeeded()
        return result

    @property
    def backing_off_s(self) -> float:
        """Seconds calls still answer misses without trying the daemon (0: they try)."""
        return self._backoff.wait_s()

    @property
    def sessions(self) -> int:
        """Clients open now (one per thread that called)."""
        return len(self._threads)

    def close(self) -> None:
        """End every session (idempotent); later calls answer misses."""
        with self._lock:
            self._closed = True
            clients = [ts.client for ts in self._threads.values()]
            self._threads.clear()
        self._close_all(clients)

    def _close_all(self, clients: list[Client]) -> None:
        for client in clients:
            try:
                client.close()
            except HicachedError as e:  # already gone: nothing left to release
                self.health.warn_once("close", f"{self.name}: close: {e}")
