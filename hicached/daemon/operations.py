"""What other threads ask of a running daemon: attach / detach an L3 backend, flush, stats.

``Operations`` owns no state of its own but whether a backend is being attached; it acts on the
L3 tier (attach, detach, policies, clear), the controller (the L2 flush, KV events of a full
flush) and reads both, the presence table and the arena for stats. Every public method is
thread-safe: the bookkeeping runs on the control loop through ``calls`` (``loop_calls.py``),
and slow work (connecting a backend, clearing a large L3) runs in the caller's thread or on the
L3 writer thread, never on the loop. The admin HTTP API (``daemon.operations``) and the
``Attach`` / ``Detach`` / ``Flush`` protocol messages (``server.py``) both come here.
A new admin endpoint is a method here, called from ``ops/admin.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from hicached import protocol as P
from hicached.arena import Arena
from hicached.backends.base import BACKENDS, L3Backend, create_backend, is_backend_name
from hicached.daemon.adoption import Adopted
from hicached.daemon.config import DaemonConfig
from hicached.daemon.l3.tier import close_quietly
from hicached.daemon.loop_calls import LoopCalls
from hicached.daemon.orphans import orphans
from hicached.daemon.sessions import ParkedExists, ParkedGet, ParkedStore, namespace_digest
from hicached.errors import (
    BackendConflict,
    BackendError,
    BackendUnavailable,
    HicachedError,
    ProtocolError,
    ShuttingDown,
)
from hicached.settings import WRITE_POLICIES

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


def open_backend(name: str, config: DaemonConfig, arena: Arena, options: dict | None
                 ) -> L3Backend:
    """Create and open backend ``name`` on ``arena`` (blocking: never on the control loop once
    it runs); ``BackendError`` / ``BackendUnavailable`` name what failed."""
    opts = backend_options(name, config, options)
    try:
        backend = create_backend(name, **opts)
    except HicachedError:
        raise
    except (ValueError, TypeError) as e:
        raise BackendError(f"L3 backend {name!r}: {e}") from None
    except OSError as e:  # its directory / device cannot be made or opened
        raise BackendUnavailable(f"L3 backend {name!r}: {e}") from None
    try:
        backend.open(arena)
    except Exception as e:
        close_quietly(backend)
        if isinstance(e, HicachedError):
            raise
        raise BackendUnavailable(f"L3 backend {name!r} failed to open: "
                                 f"{type(e).__name__}: {e}") from None
    backend.opened_with = opts  # a re-attach with other options is refused (``_same_options``)
    return backend


class Operations:
    """Attach / detach / flush / stats for other threads (see the module docstring).

    ``stopped()``: whether the loop is stopping (no attach starts); ``draining()``: whether the
    daemon refuses new work (also from a signal the loop has not seen yet); ``frames_read()``:
    the requests the socket read (for ``loop_stats``)."""

    def __init__(self, config: DaemonConfig, calls: LoopCalls, controller, tier, arena: Arena,
                 presence, stopped: Callable[[], bool], draining: Callable[[], bool],
                 frames_read: Callable[[], int],
                 adoption: Callable[[], dict] | None = None) -> None:
        self.config = config
        self.adoption = adoption or Adopted(cold_reason="no arena kept").stats
        self.calls = calls
        self.controller = controller
        self.tier = tier
        self.arena = arena
        self.presence = presence  # PresenceTable or None
        self.stopped = stopped
        self.draining = draining
        self.frames_read = frames_read
        self.attaching = False  # a backend is being connected (loop thread only)

    def call(self, fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
        return self.calls.call(fn, timeout_s)

    # ------------------------------------------------------------ operations

    def attach_backend(self, name: str, options: dict | None = None, *,
                       write_policy: str | None = None, threshold: int | None = None,
                       prefetch: bool | None = None, timeout_s: float = 120.0) -> dict:
        """Attach L3 backend ``name`` while clients run (thread-safe; blocks the caller, never
        the loop, while the backend connects). The backend already attached: only the policies
        given change. Another one attached (or attaching): ``BackendConflict``."""

        def begin() -> bool:
            if self.stopped():
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
            if t.attached or self.attaching:
                busy = t.backend.name if t.attached else "another backend"
                raise BackendConflict(f"L3 backend {busy!r} is attached (or attaching); "
                                      f"detach it before attaching {name!r}")
            self.attaching = True
            return True

        if self.call(begin):
            try:  # one detached with these options and kept open (``L3Backend.slow_close``)
                opts = backend_options(name, self.config, options)
                backend = (self.call(lambda: self.tier.unpark(name, opts))
                           or open_backend(name, self.config, self.arena, options))
            except BaseException:
                self.call(lambda: setattr(self, "attaching", False))
                raise

            def install() -> None:
                self.attaching = False
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
        tier, writes = self.tier, self.tier.writes
        while self.call(lambda: writes.write_back_all() or len(writes.dirty) if tier.attached
                        else 0) and time.monotonic() < deadline:
            time.sleep(0.02)

        def detach() -> tuple[bool, int]:
            dropped = len(writes.dirty)
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
            if self.calls.on_loop():  # nobody else would walk it
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
        reasons = [r for r, bad in (("draining", self.draining()),
                                    ("L3 backend failing", tier["degraded"])) if bad]
        return {"ready": not reasons, "arena": self.arena.path,
                "arena_bytes": self.arena.size_bytes, "l3_backend": tier["backend"],
                "l3_attached": tier["attached"], "reasons": reasons}

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
            "parked_gets": sum(isinstance(p, ParkedGet) for p in c.parking.values()),
            "parked_exists": sum(isinstance(p, ParkedExists) for p in c.parking.values()),
            "parked_store_waits": sum(isinstance(p, ParkedStore) for p in c.parking.values()),
            "l2_flush": c.flusher.status(),
            "sliced": c.slicer.status(),
            "l3_backend": c.tier.backend.name,
            "l3_tier": c.tier.status(),
            "l3": c.tier.backend_stats(),
            "kv_events": {"published": c.kv_events.publisher.published,
                          "dropped": c.kv_events.publisher.dropped},
            **c.counters,
            **c.tier.counters,
            "requests": self.frames_read(),
            "presence": table.stats() if table is not None else None,
            "adoption": self.adoption(),  # what this daemon adopted at start (adoption.py)
        }

    def _orphan_bytes(self) -> int | None:
        """Slot bytes of L2's orphans (``orphans.orphans``), None in an index too large to
        count them on every stats call."""
        self.controller.reclaim.settle()
        found = orphans(self.controller.index.records, l3=self.controller.tier.attached,
                        leaving=self.controller.reclaim.leaving())
        return None if found is None else found[1]

    def attach_for(self, msg: P.Attach, reply: Callable[[Any], None]) -> None:
        """A client's Attach: connect off the loop, answer (``reply``) from the loop."""
        self.off_loop(
            reply, msg.req_id,
            lambda: self.attach_backend(msg.backend, msg.options,
                                        write_policy=msg.write_policy or None,
                                        prefetch=msg.prefetch),
            lambda status: P.BackendStatus(msg.req_id, status))

    def off_loop(self, reply: Callable[[Any], None], req_id: int, work: Callable[[], Any],
                 answer: Callable[[Any], Any]) -> None:
        """Run a slow request (attach, L3 flush) on its own thread; ``reply(answer(result))``
        (or its ``Error``) from the loop."""

        send = reply

        def run() -> None:
            try:
                reply = answer(work())
            except HicachedError as e:
                reply = P.Error(req_id, e.code, str(e))
            except Exception as e:  # a bug costs this request only
                log.exception("request failed")
                reply = P.Error(req_id, "internal", f"{type(e).__name__}: {e}")
            self.calls.call_soon(lambda: send(reply))

        threading.Thread(target=run, name="hicached-slow-request", daemon=True).start()

