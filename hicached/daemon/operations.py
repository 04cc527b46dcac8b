"""What other threads ask of a running daemon: attach / detach an L3 backend, flush, stats.

Mixed into ``hicached.daemon.server.Daemon``. Every method here is thread-safe: the bookkeeping runs on
the control loop through ``call`` (``call_soon`` queues a function and wakes the loop through a
pipe; the loop runs it in ``_run_calls``), and slow work (connecting a backend, clearing a large
L3) runs in the caller's thread or on the L3 writer thread, never on the loop. The admin HTTP
API and the ``Attach`` / ``Detach`` / ``Flush`` protocol messages both come here.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from hicached import protocol as P
from hicached.backends.base import BACKENDS, is_backend_name
from hicached.daemon.l3.tier import close_quietly
from hicached.daemon.orphans import orphans
from hicached.daemon.sessions import ParkedExists, ParkedGet, ParkedStore, namespace_digest
from hicached.errors import (
    BackendConflict,
    BackendError,
    HicachedError,
    ProtocolError,
    ShuttingDown,
)
from hicached.daemon.config import DaemonConfig
from hicached.settings import WRITE_POLICIES
from hicached.daemon.metrics import stats_json

log = logging.getLogger(__name__)

FLUSH_TIERS = ("l2", "l3", "all")


def backend_options(name: str, config: DaemonConfig, options: dict | None = None) -> dict:
    """Keyword options for backend ``name``: ``options`` (or the config's ``l3_options``), with
    the file backend's root defaulting to the config's ``l3_dir``, and Mooncake's unset keys
    looked up in the environment the config captured (SGLang's ``MOONCAKE_*`` variables)."""
    opts = dict(config.l3_options if options is None else options)
    if name == "file" and opts.get("root") in (None, ""):  # "" as in the config: the default
        opts["root"] = config.l3_dir
    elif name == "mooncake":
        opts.setdefault("env", dict(config.store_env))
    return opts


class DaemonOperations:
    """Attach / detach / flush / stats for other threads (see the module docstring)."""

    # ------------------------------------------------------------ calls from other threads

    def call_soon(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the control loop; thread-safe. The future holds its result."""
        fut: Future = Future()
        if self._closed:
            fut.set_exception(ShuttingDown("daemon is stopped"))
            return fut
        self._calls.put((fn, fut))
        try:
            os.write(self._call_w, b"x")
        except OSError:
            pass
        return fut

    def call(self, fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
        """``fn()`` run on the control loop, its result returned (or its exception raised)."""
        if threading.get_ident() == self._loop_thread:
            return fn()
        try:
            return self.call_soon(fn).result(timeout_s)
        except FutureTimeout:
            raise HicachedError(f"daemon control loop did not answer within {timeout_s} s") from None

    def _run_calls(self, error: Exception | None = None) -> None:
        try:
            os.read(self._call_r, 65536)
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            if error is not None:
                fut.set_exception(error)
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
            if self.controller.books:  # (as after every step of the loop: server.py)
                self.controller.keep_books()

    # ------------------------------------------------------------ operations

    def attach_backend(self, name: str, options: dict | None = None, *,
                       write_policy: str | None = None, threshold: int | None = None,
                       prefetch: bool | None = None, timeout_s: float = 120.0) -> dict:
        """Attach L3 backend ``name`` while clients run (thread-safe; blocks the caller, never
        the loop, while the backend connects). The backend already attached: only the policies
        given change. Another one attached (or attaching): ``BackendConflict``."""

        def begin() -> bool:
            if self._stop.is_set():
                raise ShuttingDown("daemon is shutting down")
            if write_policy and write_policy not in WRITE_POLICIES:
                raise ProtocolError(f"unknown write policy {write_policy!r}; "
                                    f"valid: {list(WRITE_POLICIES)}")
            if not is_backend_name(name):  # before any conflict: a typo is no reason to detach
                raise BackendError(f"unknown L3 backend {name!r}; valid: {sorted(BACKENDS)} or "
                                   "'package.module:Class'")
            t = self.tier
            if t.attached and t.backend.name == name:
                self._same_options(t.backend, options)
                t.set_policies(write_policy, threshold, prefetch)
                return False
            if t.attached or self._attaching:
                busy = t.backend.name if t.attached else "another backend"
                raise BackendConflict(f"L3 backend {busy!r} is attached (or attaching); "
                                      f"detach it before attaching {name!r}")
            self._attaching = True
            return True

        if self.call(begin):
            try:  # one detached with these options and kept open (``L3Backend.slow_close``)
                opts = backend_options(name, self.config, options)
                backend = (self.call(lambda: self.tier.unpark(name, opts))
                           or self._open_backend(name, options))
            except BaseException:
                self.call(lambda: setattr(self, "_attaching", False))
                raise

            def install() -> None:
                self._attaching = False
                self.tier.set_policies(write_policy, threshold, prefetch)
                self.tier.attach(backend)

            try:
                self.call(install, timeout_s)
            except BaseException:
                close_quietly(backend)
                raise
            return self.backend_status()
        return {**self.backend_status(), "reattached": True}

    def _same_options(self, backend: Any, options: dict | None) -> None:
        """A re-attach of the attached backend changes its policies only: options it gives
        (none: keep them) must be those it was opened with, else ``BackendConflict``."""
        if not options:
            return
        have = getattr(backend, "opened_with", None)
        want = backend_options(backend.name, self.config, options)
        if have is not None and want != have:
            differ = sorted(k for k in {*have, *want} if have.get(k) != want.get(k))
            raise BackendConflict(
                f"L3 backend {backend.name!r} is attached with other options (they differ in "
                f"{', '.join(differ)}); a re-attach changes only policies: detach it first "
                "to attach it with new options")

    def detach_backend(self, timeout_s: float | None = None) -> dict:
        """Detach the L3 backend (idempotent; thread-safe; blocks the caller, never the loop).
        L2 keeps its pages; L3 I/O in flight finishes against the old backend, which is then
        closed. Under write_back, L2 holds the only copy of dirty pages: they are written first,
        for at most ``timeout_s`` (default ``drain_timeout_s``); those left then (a failing
        store) stay in L2 only, counted in ``l3_dirty_dropped`` and the answer's
        ``dirty_dropped``."""
        wait = self.config.drain_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        tier = self.tier
        while self.call(lambda: tier.write_back_all() or len(tier.dirty) if tier.attached
                        else 0) and time.monotonic() < deadline:
            time.sleep(0.02)

        def detach() -> tuple[bool, int]:
            dropped = len(tier.dirty)
            return tier.detach(), dropped

        detached, dropped = self.call(detach)
        return {**self.backend_status(), "detached": detached, "dirty_dropped": dropped}

    def backend_status(self) -> dict:
        return self.call(lambda: {**self.tier.status(), "backend_stats": self.tier.backend_stats()})

    def flush(self, tier: str = "l2", timeout_s: float = 600.0, namespace: str = "") -> int:
        """Drop unpinned L2 pages (``l2``), every L3 page (``l3``) or both (``all``); returns how
        many. ``namespace`` (a name, as clients give it): only that namespace's pages, in L2 and
        in an L3 backend that can find them by namespace (``L3Backend.clears_namespaces``;
        another one is refused with ``BackendError`` before anything is dropped); "": every
        page of the node. Thread-safe; blocks the caller, never the loop: L3 is cleared on the
        writer thread behind the writes queued before it (a large store takes a while, and no
        page written before the flush may survive it)."""
        if tier not in FLUSH_TIERS:
            raise ProtocolError(f"unknown tier {tier!r}; valid: {list(FLUSH_TIERS)}")
        ns = namespace_digest(namespace) if namespace else None
        if ns is not None and tier in ("l3", "all"):
            backend = self.call(lambda: self.tier.backend if self.tier.attached else None)
            if backend is not None and not backend.clears_namespaces:
                raise BackendError(
                    f"L3 backend {backend.name} cannot find one namespace's pages to clear "
                    f"them: nothing was flushed (flush tier l2 for the namespace's L2 pages, "
                    f"or the whole node)")
        n = 0
        if tier in ("l2", "all"):
            walk: Future = Future()
            self.call(lambda: self.controller.flush_l2(walk.set_result, ns))
            if threading.get_ident() == self._loop_thread:  # nobody else would walk it
                self.controller.flusher.finish_now()
            try:
                n = walk.result(timeout_s)
            except FutureTimeout:
                raise HicachedError(f"L2 flush did not finish within {timeout_s} s") from None
        if tier in ("l3", "all"):
            fut: Future = Future()
            self.call(lambda: self.tier.clear(fut.set_result, ns))
            try:
                got = fut.result(timeout_s)
            except FutureTimeout:
                raise BackendError(f"L3 clear did not finish within {timeout_s} s") from None
            if isinstance(got, HicachedError):
                raise got
            if isinstance(got, Exception):
                raise BackendError(f"L3 {self.tier.backend.name} clear failed: "
                                   f"{type(got).__name__}: {got}")
            n += got
        if tier == "all":  # every tier: what routers knew of this node (or namespace) is gone
            self.call(lambda: self.controller.kv_events.all_cleared(ns))
        return n

    def stats(self) -> dict:
        return self.call(self.loop_stats)

    def describe(self) -> str:
        c = self.config
        l3 = c.l3_backend
        b = self.tier.backend
        if b is not None and b.name == "file":
            l3 = (f"file at {b.root} (capacity {b.capacity / 1024**3:.2f} GiB, "
                  f"keeps {b.min_free / 1024**3:.2f} GiB of its disk free)")
        t = self.presence
        table = "off" if t is None else f"{t.slots} slots" + (
            f", slot tags per {t.grain // 1024} KiB" if t.grain else ", no slot tags")
        return (f"hicached listening on {c.endpoint} (pid {os.getpid()}); "
                f"arena {c.l2_size / 1024**3:.2f} GiB at {c.arena_path}; L3 {l3}; "
                f"presence table {table}")

    def readiness(self) -> dict:
        """The admin API's ``/ready`` body (loop thread): ready unless draining or the L3 backend
        is failing."""
        tier = self.tier.status()
        reasons = [r for r, bad in (("draining", self.draining),
                                    ("L3 backend failing", tier["degraded"])) if bad]
        return {"ready": not reasons, "arena": self.arena.path,
                "arena_bytes": self.arena.size_bytes, "l3_backend": tier["backend"],
                "l3_attached": tier["attached"], "reasons": reasons}

    def status_view(self) -> dict:
        """What ``hicached status`` shows, in one answer over the socket (loop thread): the
        admin API's ``/health``, ``/ready`` and ``/stats`` bodies."""
        return {"health": {"status": "draining" if self.draining else "ok"},
                "ready": self.readiness(), "stats": stats_json(self.metrics.snapshot())}

    def loop_stats(self, orphans: bool = True) -> dict:
        """The controller's state and counters, frames read and the presence table (loop thread
        only). ``orphans=False``: ``l2_orphan_bytes`` is None, not counted (the status page's
        sampler counts them less often: about a microsecond a key record)."""
        c, table = self.controller, self.presence
        pools: dict[str, int] = {}
        for (_, pool), n in c.index.counts().items():
            pools[pool] = pools.get(pool, 0) + n
        return {
            "l2_pages": len(c.index),
            "l2_pages_by_pool": pools,
            "l2_used_bytes": c.index.alloc.used_bytes(),
            "arena_free_slabs": c.index.alloc.free_slab_count,
            "evictions": c.index.evictions,
            "evictions_ahead": c.reclaim.evicted,
            "eviction": c.index.policy.name,
            "l2_orphan_bytes": self._orphan_bytes() if orphans else None,
            "reservations": len(c.leases.reservations),
            "leases": len(c.leases.leases),
            "expired_reservations": c.leases.expired_reservations,
            "expired_leases": c.leases.expired_leases,
            "set_ahead_slots": sum(len(slots) for a in c.leases.ahead.values()
                                   for slots in a.pools.values()),
            "set_ahead_bytes": c.leases.ahead_bytes,
            "fenced_bytes": c.leases.fenced_bytes,
            "sessions": len(c.sessions),
            "parked_gets": sum(isinstance(p, ParkedGet) for p in c.parked.values()),
            "parked_exists": sum(isinstance(p, ParkedExists) for p in c.parked.values()),
            "parked_store_waits": sum(isinstance(p, ParkedStore) for p in c.parked.values()),
            "l2_flush": c.flusher.status(),
            "sliced": c.slicer.status(),
            "l3_backend": c.tier.backend.name,
            "l3_tier": c.tier.status(),
            "l3": c.tier.backend_stats(),
            "kv_events": {"published": c.kv_events.publisher.published,
                          "dropped": c.kv_events.publisher.dropped},
            **c.counters,
            **c.tier.counters,
            "requests": self.requests,
            "presence": table.stats() if table is not None else None,
        }

    def _orphan_bytes(self) -> int | None:
        """Slot bytes of L2's orphans (``orphans.orphans``), None in an index too large to
        count them on every stats call."""
        self.controller.reclaim.settle()
        found = orphans(self.controller.index, l3=self.controller.tier.attached,
                        leaving=self.controller.reclaim.leaving())
        return None if found is None else found[1]

    def _attach_for(self, identity: bytes, msg: P.Attach) -> None:
        """A client's Attach: connect off the loop, answer from the loop."""
        self._off_loop(
            identity, msg.req_id,
            lambda: self.attach_backend(msg.backend, msg.options,
                                        write_policy=msg.write_policy or None,
                                        prefetch=msg.prefetch),
            lambda status: P.BackendStatus(msg.req_id, status))

    def _off_loop(self, identity: bytes, req_id: int, work: Callable[[], Any],
                  answer: Callable[[Any], Any]) -> None:
        """Run a slow request (attach, L3 flush) on its own thread; answer from the loop."""

        def run() -> None:
            try:
                reply = answer(work())
            except HicachedError as e:
                reply = P.Error(req_id, e.code, str(e))
            except Exception as e:  # a bug costs this request only
                log.exception("request failed")
                reply = P.Error(req_id, "internal", f"{type(e).__name__}: {e}")
            self.call_soon(lambda: self._send(identity, reply))

        threading.Thread(target=run, name="hicached-slow-request", daemon=True).start()

