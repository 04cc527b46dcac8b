"""The daemon: one object owning the socket, the arena, the index, the controller and the L3 tier.

``Daemon.__init__`` builds the object graph, in one place (``docs/development.md`` draws it):
its files (``DaemonFiles``: the state lock, the socket file), the arena, the index and the
presence table, the leases, the L3 tier and its I/O workers, the controller, the calls from
other threads (``LoopCalls``), the handshakes, the admin operations (``Operations``), the auth
and the metrics. Each gets its collaborators in its constructor; nothing is assigned into
another object afterwards, and a reload goes through a method of the object that owns what it
changes (``reload``).

The control loop is single-threaded. It polls the ROUTER socket and the I/O workers' wake pipe,
answers each request, and between batches sweeps expired reservations / leases and clients whose
process is gone. A request that cannot be decoded or is invalid gets a typed ``Error`` answer;
nothing a client sends can stop the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import numpy as np
import zmq

from hicached import protocol as P
from hicached.arena import Arena, arena_progress, release_if_made
from hicached.daemon.adoption import Adopted, adopt, read_window
from hicached.daemon.auth import make_auth
from hicached.daemon.config import DaemonConfig
from hicached.daemon.controller import Controller
from hicached.daemon.files import DaemonFiles
from hicached.daemon.handshake import Handshakes
from hicached.daemon.eviction.registry import make_policy
from hicached.daemon.index import COMMITTED, PageIndex
from hicached.daemon.journal import GRAIN, CrashPoint, Journal, first_gen
from hicached.daemon.journal import file_bytes as journal_bytes
from hicached.daemon.kv_events import make_kv_events
from hicached.daemon.l3.tier import L3Tier, close_quietly
from hicached.daemon.l3.workers import IOWorkers
from hicached.daemon.leases import LeaseTable
from hicached.daemon.loop_calls import LoopCalls
from hicached.daemon.loop_gc import tune_for_the_loop
from hicached.daemon.metrics import make_metrics, stats_json
from hicached.daemon.notifier import NullNotifier
from hicached.daemon.operations import Operations, open_backend
from hicached.daemon.quotas import make_quotas
from hicached.daemon.room import allocated_bytes, check_room, read_room
from hicached.daemon.sessions import Session, namespace_digest
from hicached.daemon.slabs import SlabAllocator
from hicached.daemon import slicing
from hicached.daemon.slicing import Slicer, Steps, as_answer, drive
from hicached.errors import (
    HicachedError,
    ProtocolError,
    ShuttingDown,
    UnknownSession,
)
from hicached.presence import (
    TAG_GRAIN,
    PresenceTable,
    close_left,
    default_slots,
    table_bytes,
)

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 0.5
MAX_BATCH = 256  # requests handled before the loop looks at I/O completions and timers
# answered while draining (they finish work in flight); everything else gets ShuttingDown
_DRAIN_OK = (P.Commit, P.Release, P.Bye, P.ExistsTally)


class _Sliced(NamedTuple):
    """What ``_dispatch`` returns for a call worked in slices (``slicing.py``): its steps."""

    steps: Steps


class Daemon:
    """``Daemon(config).serve_forever()`` runs until ``stop()`` (or SIGTERM/SIGINT via ``run``).

    Owns the ROUTER socket and the control loop; reads requests, dispatches them to the
    controller (the data path), the handshakes and the operations (attach, detach, flush,
    stats), sends the answers, and runs the periodic sweep (``_tick``)."""

    def __init__(self, config: DaemonConfig,
                 on_phase: Callable[[str], None] | None = None,
                 notifier: NullNotifier | None = None, crash_at: str | None = None):
        """Make the daemon: state lock, arena, index, L3 backend, socket. ``on_phase(name)`` is
        called as the start reaches "lock", "arena" (after each step of the reservation), "l3"
        and "socket" (``ops/phases.py``); whatever it raises abandons the start, which undoes
        what it made (lock, arena file, backend, socket) and lets the exception go on.
        ``notifier``: what the service manager is told (``notifier.py``; None: nothing);
        ``crash_at``: a test's kill at a point of the journal (``journal.CrashPoint``)."""
        self.config = config
        self.notifier = notifier or NullNotifier()
        self._stop = threading.Event()
        self._stop_asked = False  # set by a signal handler (stop_on_signal)
        on_phase = on_phase or (lambda name: None)
        log_progress = arena_progress()

        def progress(done: int, total: int) -> None:
            log_progress(done, total)
            on_phase("arena")

        self.files = DaemonFiles(config)  # the state dir's lock, taken
        kept = None  # the journal's records, when the arena is adopted (``adoption.py``)
        crash = CrashPoint(crash_at) if crash_at else None
        adopting = False
        try:
            on_phase("lock")
            self.files.check_endpoint(config.endpoint)  # taken: say so before the arena and L3
            recorded = self.files.recorded_arena(config.arena_path)
            cold = self._why_cold(config, recorded)
            if recorded:  # (this state dir's last daemon, dead: its lock is ours now)
                close_left(config.arena_path + ".presence")  # its clients: before any slot
            if cold is None:
                adopting = True
                kept, cold = self._open_kept(config, crash)
                adopting = kept is not None
            if cold is not None:
                self._make_arena(config, crash, progress)
            self.adopted = Adopted(cold_reason=cold)
            self.files.record_arena(config.arena_path)
            self.files.set_group(config.arena_path)
            self.files.set_group(config.arena_path + ".meta")
        except BaseException:
            if hasattr(self, "journal"):
                self.journal.close(keep=adopting)
            if hasattr(self, "arena"):
                self.arena.close(keep=adopting)
            else:
                release_if_made(config.arena_path + ".meta")
            self.files.close(keep=adopting)
            raise
        try:
            self._compose(config, kept, on_phase)
            if kept is not None:
                try:
                    self._adopt(kept)
                except Exception as e:  # adoption never stops the start: cold instead
                    self._go_cold(config, crash, progress, on_phase,
                                  f"adoption failed ({e!r})")
            self.adopted.kept_on_stop = config.on_stop == "keep"  # (what this one will do)
            log.info("%s", self.adopted.line())
            self.ctx = zmq.Context()
            self.sock = self.files.bind(self.ctx, config.endpoint)
            on_phase("socket")
        except BaseException:
            self._close_composed()
            if hasattr(self, "sock"):  # (ctx.term waits for every socket to be closed)
                self.sock.close(linger=0)
                self.files.remove_socket_file()
            if hasattr(self, "ctx"):
                self.ctx.term()
            self._discard(config)
            self.files.close()
            raise
        self.requests = 0
        self._closed = False
        self.calls = LoopCalls(self._keep_books)
        self.auth = make_auth(config.client_token)
        self.handshakes = Handshakes(config, self.controller.sessions, self.auth, self.arena,
                                     self.presence, self.index)
        self.operations = Operations(config, self.calls, self.controller, self.tier, self.arena,
                                     self.presence, self._stop.is_set, lambda: self.draining,
                                     lambda: self.requests, self.adopted.stats)
        self._drained = False  # the drain ran to its end (a clean stop: ``close``)
        self.kept_pages = 0  # committed pages left in a kept arena (``close``)
        self.metrics = make_metrics(self, enabled=bool(config.admin_port))

    # ------------------------------------------------------------ setup

    @staticmethod
    def _why_cold(config: DaemonConfig, recorded: bool) -> str | None:
        """Why the arena at ``config.arena_path`` is not adopted (one line), None when it is:
        it was kept (or left by a crash) by this state dir's last daemon (``recorded``), with
        its journal, of this geometry, and ``cold`` is not set."""
        path = config.arena_path
        if not os.path.exists(path):
            return "no arena kept"
        if config.cold:
            return f"cold = true (--cold): the kept arena {path} is discarded"
        if not recorded:
            return f"the arena {path} was not made by this state dir's last daemon"
        size = os.path.getsize(path)
        if size != config.l2_size:
            return (f"l2_size changed: the kept arena has {size} bytes, this daemon asks for "
                    f"{config.l2_size}")
        return Journal.mismatch(path + ".meta", config.l2_size, config.slab_size)

    def _open_kept(self, config: DaemonConfig, crash: CrashPoint | None):
        """Map the kept arena and its journal and read the journal's records: ``(kept,
        None)``; or, when any of that fails (a journal whose header or tables do not parse, a
        bug), ``(None, why)`` with the kept files removed: the start goes on cold."""
        meta = config.arena_path + ".meta"
        try:
            self.arena = Arena.adopt(config.arena_path, config.l2_size)
            self.journal = Journal.adopt(meta, config.l2_size, config.slab_size, crash)
            kept = self.journal.kept()
            self.journal.reset()  # re-journaled as adopted: a record dropped stays dropped
            return kept, None
        except Exception as e:  # (Ctrl-C and exits go on: the outer handler keeps the files)
            why = f"adoption failed ({e!r})"
            log.warning("%s: the kept arena %s is discarded", why, config.arena_path)
            self._discard(config)
            return None, f"{why}: the kept arena is discarded"

    def _discard(self, config: DaemonConfig) -> None:
        """Remove the arena and its journal this daemon mapped: a cold start makes new files
        (new inodes: an old client re-maps, and never writes into the new arena)."""
        for name, path in (("journal", config.arena_path + ".meta"),
                           ("arena", config.arena_path)):
            made = self.__dict__.pop(name, None)
            if made is not None:
                made.close(keep=False)
            release_if_made(path)  # (mapped, no object yet; a file not mapped is replaced)

    def _make_arena(self, config: DaemonConfig, crash: CrashPoint | None, progress) -> None:
        """A fresh arena and journal (a cold start): the room checked first."""
        meta = config.arena_path + ".meta"
        incarnation = Journal.incarnation_at(meta) + 1
        self._check_room(config)  # an arena the node cannot back: refused before it is made
        log.info("reserving the arena: %.1f GiB of shared memory at %s (about a second "
                 "per GiB)", config.l2_size / (1 << 30), config.arena_path)
        self.arena = Arena.create(config.arena_path, config.l2_size,
                                  mode=config.access_mode, progress=progress)
        self.journal = Journal.create(meta, config.l2_size, config.slab_size,
                                      incarnation, config.access_mode, crash)

    def _compose(self, config: DaemonConfig, kept, on_phase: Callable[[str], None]) -> None:
        """The index and everything built on it, over ``self.arena`` and ``self.journal``:
        allocator, presence table, KV events, index, leases, I/O workers, L3 tier, controller
        (``kept``: the journal's records to be adopted, for the slot tags' start)."""
        self.allocator = SlabAllocator(config.l2_size, config.slab_size,
                                       handed_out=self.journal.handed_out)
        self.presence = self._presence_table(config)
        self.kv_events = make_kv_events(config)  # KV events for routers
        self.index = PageIndex(self.allocator,
                               policy=make_policy(config.eviction, config.eviction_alpha),
                               presence=self.presence, events=self.kv_events,
                               ahead=config.evict_ahead,  # evicting ahead in idle turns
                               busy=self._request_waits, journal=self.journal,
                               first_gen=first_gen(kept))  # (None: at random)
        self.leases = LeaseTable(self.index, config.reservation_ttl_s, config.lease_ttl_s)
        self.workers = IOWorkers(config.io_queue_depth)
        self.tier = L3Tier(self.index, self.workers, None, config.write_policy,
                           config.write_through_threshold, config.prefetch,
                           config.l3_load_chunk, config.l3_audit_s, self.kv_events)
        if config.l3_backend != "none":
            self.tier.attach(open_backend(config.l3_backend, config, self.arena, None))
        on_phase("l3")
        if self.presence is not None:  # before any client reads it (a restart with L3)
            self.presence.beat(time.monotonic(), self.tier.attached)
        self.controller = Controller(
            self.index, self.leases, self.tier, time.monotonic, config.get_wait_s,
            quotas=make_quotas(self.index, config.namespace_quotas),
            ahead_session_bytes=config.set_ahead_bytes,
            ahead_total_bytes=config.l2_size // 8,  # idle set-ahead slots: at most 1/8
            kv_events=self.kv_events,
            books=[],  # answer first, keep the books after (controller.py)
            slicer=Slicer(waiting=self._request_waits))

    def _close_composed(self) -> None:
        """Undo ``_compose`` (what of it was made): threads, backend, the presence file."""
        if hasattr(self, "kv_events"):
            self.kv_events.close()
        if hasattr(self, "workers"):
            self.workers.close()
        if getattr(self, "tier", None) is not None:
            self.tier.close()
        if getattr(self, "presence", None) is not None:
            self.presence.close()
        release_if_made(self.config.arena_path + ".presence")  # interrupted while made
        for name in ("allocator", "presence", "kv_events", "index", "leases", "workers",
                     "tier", "controller"):
            self.__dict__.pop(name, None)

    def _go_cold(self, config: DaemonConfig, crash: CrashPoint | None, progress,
                 on_phase: Callable[[str], None], why: str) -> None:
        """Adoption failed part way (``why``): the half-built index and the kept arena are
        dropped, and the daemon is built again on a fresh arena (``/stats``
        ``adoption.cold_reason`` says why)."""
        log.warning("%s: the kept arena %s is discarded, starting cold", why,
                    config.arena_path)
        self._close_composed()
        self._discard(config)
        self._make_arena(config, crash, progress)
        self.files.set_group(config.arena_path)
        self.files.set_group(config.arena_path + ".meta")
        self.adopted = Adopted(cold_reason=f"{why}: the kept arena is discarded")
        self._compose(config, None, on_phase)

    def _adopt(self, kept) -> None:
        """Rebuild the index from the journal's records (``adoption.py``); the L3 tier is given
        the adopted pages it may lack (write-back: dirty again, so they are written)."""
        now = time.monotonic()
        self.adopted, entries = adopt(
            self.index, kept, lambda es, s: self.leases.fence_until(es, now + s),
            self.config.reservation_ttl_s / 2)
        self.adopted.held_s = read_window(self.adopted.clean, self.adopted.stopped_at,
                                          self.config.lease_ttl_s / 2, time.time())
        self.leases.hold(entries if self.adopted.held_s > 0 else [], now + self.adopted.held_s)
        self.controller.know_geometry(self.adopted.geometry)
        if self.tier.attached and self.config.write_policy == "write_back":
            self.tier.writes.on_commit([e for e in entries if not e.in_l3])

    @staticmethod
    def _check_room(config: DaemonConfig) -> None:
        """ConfigError when the node cannot back the arena and its presence table (``room.py``);
        the files a crashed daemon left at their paths count as free (they are replaced)."""
        def table(arena_bytes: int) -> int:
            journal = journal_bytes(arena_bytes, config.slab_size)  # (beside the arena too)
            if not config.shared_exists:
                return journal
            return journal + table_bytes(config.presence_slots or default_slots(arena_bytes),
                                         arena_bytes, TAG_GRAIN if config.shared_gets else 0)

        old = allocated_bytes(config.arena_path, config.arena_path + ".presence",
                              config.arena_path + ".meta")
        check_room(config.l2_size, read_room(os.path.dirname(config.arena_path) or "."), old,
                   table)

    # ------------------------------------------------------------ loop

    def stop(self) -> None:
        """Ask the loop to finish (thread-safe; from a signal handler: ``stop_on_signal``)."""
        self._stop.set()

    def stop_on_signal(self) -> None:
        """``stop`` for a signal handler: it takes no lock (a handler runs on the loop's thread,
        possibly inside ``Event.set`` of an earlier signal, and a lock taken twice by one
        thread never returns); the loop sees the flag at its next turn, woken by the pipe."""
        self._stop_asked = True
        self.calls.wake()

    def call(self, fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
        """``fn()`` run on the control loop (thread-safe; ``LoopCalls.call``)."""
        return self.calls.call(fn, timeout_s)

    def status_view(self) -> dict:
        """What ``hicached status`` shows, in one answer over the socket (loop thread): the
        admin API's ``/health``, ``/ready`` and ``/stats`` bodies."""
        return {"health": {"status": "draining" if self.draining else "ok"},
                "ready": self.operations.readiness(),
                "stats": stats_json(self.metrics.snapshot())}

    def reload(self, new: DaemonConfig, keys: tuple[str, ...]) -> None:
        """SIGHUP, on the loop (``ops/serve.py``, which reloads the tier's and the controller's
        policies through their own methods): the eviction's (evicting ahead, the hybrid's
        alpha), and the config's ``keys`` taken from ``new``."""
        self.controller.reclaim.set_ahead(new.evict_ahead)
        self.index.policy.set_alpha(new.eviction_alpha)
        self.config = dataclasses.replace(self.config, **{k: getattr(new, k) for k in keys})

    def _keep_books(self) -> None:
        """After each step of the loop: what the answers did not wait for (controller.py)."""
        if self.controller.books:
            self.controller.keep_books()

    @property
    def draining(self) -> bool:
        """True from SIGTERM / ``stop()`` on: new work is refused with ``ShuttingDown``."""
        return self._stop_asked or self._stop.is_set()

    def _presence_table(self, config: DaemonConfig) -> PresenceTable | None:
        """The shared presence table beside the arena, or None (``shared_exists`` off)."""
        if not config.shared_exists:
            return None
        table = PresenceTable(config.arena_path + ".presence",
                              config.presence_slots or default_slots(config.l2_size),
                              secrets.randbits(63), mode=config.access_mode,
                              arena_bytes=self.arena.size_bytes,
                              grain=TAG_GRAIN if config.shared_gets else 0)
        self.files.set_group(table.path)
        return table

    def _tick(self, now: float) -> None:
        """Every ``SWEEP_INTERVAL_S``: expire reservations and leases, drop dead clients, relieve
        write-back pressure, audit L3 copies when due; and feed the systemd watchdog (only a
        running loop does). Every turn: hand the turn's KV events to their publisher."""
        self.kv_events.send()
        if now >= self._next_watchdog:
            interval = self.notifier.watchdog_interval_s
            if interval:
                self.notifier.watchdog()
            self._next_watchdog = now + (interval or float("inf"))
        if now >= self._next_sweep:
            self.leases.sweep(now)
            self.index.republish()
            self.controller.sessions.reap_dead_sessions()
            self.controller.sessions.reap_idle_unchecked(now, self.config.unchecked_idle_s)
            self.auth.prune(self.controller.sessions)
            self.tier.writes.relieve_pressure()
            self.tier.auditor.audit(now)
            self._next_sweep = now + SWEEP_INTERVAL_S

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.workers.wake_r, zmq.POLLIN)
        poller.register(self.calls.wake_fd, zmq.POLLIN)
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S
        self._next_watchdog = 0.0
        busy_until = 0.0  # spin (non-blocking polls) until then: see busy_poll_ms in the config
        busy_s = self.config.busy_poll_ms / 1000
        self.calls.enter()
        tune_for_the_loop()  # (loop_gc.py)
        try:
            while not self._stop.is_set():
                if self._stop_asked:  # a signal: set the event here, outside any handler
                    self._stop.set()
                    break
                now = time.monotonic()
                reclaim = self.controller.reclaim.wanted()
                sliced = self.controller.slicer.active
                if now < busy_until or self.controller.flusher.active or reclaim or sliced:
                    timeout_ms = 0
                else:
                    wake = min(self._next_sweep, self._next_watchdog)
                    parked = self.controller.next_parked_deadline()
                    if parked is not None:
                        wake = min(wake, parked)
                    timeout_ms = min(200, max(0, int((wake - now) * 1000) + 1))
                events = dict(poller.poll(timeout_ms))
                if self.sock in events:
                    self._guarded(self._drain_socket)
                    busy_until = time.monotonic() + busy_s
                if self.workers.wake_r in events:
                    self._guarded(self.controller.on_io_done)
                if self.calls.wake_fd in events:
                    self.calls.run()
                if self.controller.slicer.active:  # a slice of a huge call (slicing.py)
                    self._guarded(self.controller.slicer.step)
                    # the clients waiting for a CPU (a small machine: the loop busy with a huge
                    # call takes a core) may send their requests before the next slice
                    os.sched_yield()
                if self.controller.flusher.active:
                    self._guarded(self.controller.flusher.step)
                if self.controller.flusher.settling:  # flushes waiting for L3 writes
                    self._guarded(self.controller.flusher.settle)
                elif reclaim and self.sock not in events:  # an idle turn: evict ahead
                    self._guarded(self.controller.reclaim.step)
                now = time.monotonic()
                if self.presence is not None:
                    self.presence.beat(now, self.tier.attached)
                if self.controller.parking.parked:
                    self._guarded(self.controller.expire_parked, now)
                self._guarded(self._tick, now)
            self._drain_for_shutdown()
            self._drained = True
        finally:
            self.close()

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> None:
        """One step of the loop; a bug in it is logged, never the end of the daemon."""
        try:
            fn(*args)
        except Exception:
            log.exception("internal error in the control loop (%s); carrying on",
                          getattr(fn, "__name__", fn))
        if self.controller.books:  # (a step that answered nothing, or failed half way)
            self.controller.keep_books()

    def _request_waits(self) -> bool:
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _drain_socket(self) -> None:
        for _ in range(MAX_BATCH):
            try:
                # frames, not bytes: a Hello's carries the kernel's word on who sent it
                # (liveness.py); the payload is decoded in place
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.requests += 1
            if len(frames) != 2:
                log.warning("dropping a message of %d frames (expected identity + payload)",
                            len(frames))
                if frames:
                    self._send(frames[0].bytes, P.Error(
                        0, ProtocolError.code, f"expected 1 payload frame, got {len(frames) - 1}"))
                continue
            identity = frames[0].bytes
            if self.controller.slicer.holds(identity):  # behind its call worked in slices
                self._hold(identity, frames[1])
                continue
            self._handle(identity, frames[1])

    def _hold(self, identity: bytes, frame: zmq.Frame) -> None:
        """Keep a request until the call of its client worked in slices is answered (its
        requests stay in order); past ``slicing.MAX_HELD`` of them it is refused."""
        slicer = self.controller.slicer
        if not slicer.hold(identity, frame):
            self._send(identity, P.Error(
                P.salvage_req_id(frame.bytes), ProtocolError.code,
                f"more than {slicing.MAX_HELD} requests wait behind this client's call of "
                "many keys: wait for answers before sending more"))

    def _send(self, identity: bytes, answer) -> None:
        try:
            payload = P.encode(answer)
        except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as e:  # a bug
            log.exception("cannot encode a %s answer", type(answer).__name__)
            payload = P.encode(P.Error(getattr(answer, "req_id", 0), "internal",
                                       f"answer not encodable: {type(e).__name__}: {e}"))
        try:
            self.sock.send_multipart([identity, payload], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # peer gone or its queue full: its problem, not ours
            log.debug("answer to a client dropped: %s", e)
        if self.controller.books:  # what the answer did not wait for (controller.py)
            self.controller.keep_books()

    def _handle(self, identity: bytes, frame: zmq.Frame) -> None:
        t0, req_id, msg = time.perf_counter(), 0, None
        payload = frame.buffer
        try:
            try:
                msg = P.request_decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError,
                    RecursionError) as e:
                req_id = P.salvage_req_id(payload)
                raise ProtocolError(f"malformed request ({len(payload)} bytes): {e}") from None
            req_id = msg.req_id
            self.auth.admit(identity, msg)
            answer = self._dispatch(identity, msg, frame)
        except HicachedError as e:
            answer = P.Error(req_id, e.code, str(e))
        except Exception as e:  # a bug must cost one request, never the daemon
            log.exception("internal error handling a request")
            answer = P.Error(req_id, "internal", f"{type(e).__name__}: {e}")
        if type(answer) is _Sliced:  # answered (and counted) when its last slice is done
            self.controller.slicer.start(
                answer.steps, lambda result: self._answer_sliced(identity, msg, t0, result),
                identity, type(msg).__name__)
            return
        if answer is not None:
            self._send(identity, answer)
        self.metrics.on_request(msg, answer, t0)  # (after the send: no client waits for it)
        if self.controller.books:  # fire and forget, or parked: books kept all the same
            self.controller.keep_books()

    def _answer_sliced(self, identity: bytes, msg, t0: float, result) -> None:
        """A call worked in slices is done (``result``: its answer, or the exception its
        steps raised): its answer, then the requests its client sent meanwhile, in order."""
        answer = as_answer(msg, result)
        if type(answer) is P.Committed and not msg.reply:
            answer = None
        if answer is not None:
            self._send(identity, answer)
        self.metrics.on_request(msg, answer, t0)
        slicer = self.controller.slicer
        while (frame := slicer.next_held(identity)) is not None:
            self._handle(identity, frame)

    def _steps(self, s: Session, msg: P.Exists | P.Lease | P.Reserve | P.Commit,
               make: Callable[[int | None], Steps]):
        """A call's answer, worked at once (a small call: ``make(None)``'s steps run to their
        end, after the leases it carries are released), or ``_Sliced`` (a huge one: the
        releases and ``make(chunk)``'s steps, for the slicer)."""
        c = self.controller
        chunk = c.slicer.chunk(c.call_size(msg))
        release = getattr(msg, "release", None)
        if chunk is None:
            if release:
                c.release(s, release)
            return drive(make(None))
        steps = make(chunk)
        return _Sliced(c.released_then(s, release, chunk, steps) if release else steps)

    def _release_steps(self, s: Session, msg: P.Release, chunk: int) -> Steps:
        """A Release of many pages, in slices (the pages read with no lease counted after)."""
        yield from self.controller.release_steps(s, msg.lease_ids, chunk)
        if msg.touched or msg.shared_gets:
            self.metrics.on_unleased(msg, self.controller.read_unleased(s, msg))

    def _send_parked(self, identity: bytes, msg: P.Lease | P.Exists | P.WaitStored,
                     answer) -> None:
        """The late answer of a request that waited for L3 (a get for loads, an exists for the
        store's lookup, a WaitStored for writes)."""
        self._send(identity, answer)
        self.metrics.on_parked_answer(msg, answer)

    def _session(self, sid: int) -> Session:
        s = self.controller.sessions.get(sid)
        if s is None:
            raise UnknownSession(f"session {sid} unknown (daemon restarted?); handshake again")
        s.active = True
        return s

    def _dispatch(self, identity: bytes, msg, frame: zmq.Frame):
        c, ops = self.controller, self.operations
        if self._stop.is_set() and not isinstance(msg, _DRAIN_OK):
            raise ShuttingDown("hicached is shutting down; not accepting new requests")
        match msg:
            case P.Exists():
                s = self._session(msg.session)
                reply = lambda answer: self._send_parked(identity, msg, answer)  # noqa: E731
                return self._steps(s, msg, lambda chunk: c.exists_steps(s, msg, reply, chunk))
            case P.Lease():
                s = self._session(msg.session)
                reply = lambda answer: self._send_parked(identity, msg, answer)  # noqa: E731
                return self._steps(s, msg, lambda chunk: c.lease_steps(s, msg, reply, chunk))
            case P.Release():
                s = c.sessions.get(msg.session)
                if s is not None:
                    s.active = True
                    chunk = c.slicer.chunk(c.call_size(msg))
                    if chunk is not None:
                        return _Sliced(self._release_steps(s, msg, chunk))
                    c.release(s, msg.lease_ids)
                    if msg.touched or msg.shared_gets:
                        self.metrics.on_unleased(msg, c.read_unleased(s, msg))
                return None
            case P.WaitStored():
                return c.store_waits.wait_stored(self._session(msg.session), msg,
                                     lambda answer: self._send_parked(identity, msg, answer))
            case P.Reserve():
                if self._stop.is_set():
                    raise ShuttingDown("daemon is shutting down; not accepting writes")
                s = self._session(msg.session)
                return self._steps(s, msg, lambda chunk: c.sets.reserve_steps(s, msg, chunk))
            case P.Commit():
                s = self._session(msg.session)
                answer = self._steps(s, msg, lambda chunk: c.sets.commit_steps(s, msg, chunk))
                return answer if msg.reply or type(answer) is _Sliced else None
            case P.Hello():
                return self.handshakes.hello(identity, msg, frame)
            case P.RegisterPool():
                return P.Registered(msg.req_id, c.register_pool(
                    self._session(msg.session), msg.pool, msg.page_bytes, msg.event_hash,
                    msg.tokens_per_page))
            case P.ExistsTally():  # counted by the metrics hook, unless refused here
                s = self._session(msg.session)
                for pool in (*msg.keys, *msg.hits):  # pools become metric labels: only real ones
                    s.spec(pool)
                return None
            case P.Bye():
                c.sessions.close_session(msg.session)
                return None
            case P.Flush():  # (namespace "": the whole node, as from an older client)
                if msg.tier == "l2":  # answered when the walk of the arena ends
                    c.flush_l2(lambda n: self._send(identity, P.Ok(msg.req_id)),
                               namespace_digest(msg.namespace) if msg.namespace else None)
                    return None
                ops.off_loop(lambda answer: self._send(identity, answer), msg.req_id,
                             lambda: ops.flush(msg.tier, namespace=msg.namespace),
                             lambda n: P.Ok(msg.req_id))
                return None
            case P.Attach():
                ops.attach_for(msg, lambda answer: self._send(identity, answer))
                return None
            case P.Detach():  # dirty write-back pages are written first: off the loop
                ops.off_loop(lambda answer: self._send(identity, answer), msg.req_id,
                             ops.detach_backend,
                             lambda status: P.BackendStatus(msg.req_id, status))
                return None
            case P.GetBackend():
                return P.BackendStatus(msg.req_id, {**self.tier.status(),
                                                    "backend_stats": self.tier.backend_stats()})
            case P.GetStats():
                if msg.view == "status":
                    return P.Stats(msg.req_id, self.status_view())
                if msg.view:
                    raise ProtocolError(f"GetStats.view: no view {msg.view!r} (\"\" or status)")
                return P.Stats(msg.req_id, ops.loop_stats())
            case P.Ping():
                return P.Ok(msg.req_id)
        raise ProtocolError(f"unhandled message {type(msg).__name__}")

    # ------------------------------------------------------------ shutdown

    def _drain_for_shutdown(self, timeout_s: float | None = None) -> None:
        """Finish the work in flight before the arena goes away, within ``drain_timeout_s``.

        The loop keeps running: new requests are answered ``ShuttingDown``; commits, releases
        and byes are applied (a client copying into reserved slots gets its pages published,
        and written through); gets waiting for L3 loads are answered when their loads land;
        dirty write-back pages are written. It ends when no reservation, parked get or L3 job
        is left, or at the deadline (what is left then is logged)."""
        self.notifier.stopping()
        if self.presence is not None:
            self.presence.close()  # clients ask the socket now, and hear ShuttingDown
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        log.info("draining (at most %.1f s)", timeout_s)
        poller = zmq.Poller()
        for fd in (self.sock, self.workers.wake_r, self.calls.wake_fd):
            poller.register(fd, zmq.POLLIN)
        while True:
            self.controller.slicer.finish_now()  # huge calls under way: answered
            self.controller.flusher.finish_now()  # answer flushes while the socket is up
            self.tier.writes.write_back_all()
            c = self.controller
            busy = (len(self.leases.reservations), len(c.parking), self.workers.in_flight)
            now = time.monotonic()
            if not any(busy) or now >= deadline:
                break
            events = dict(poller.poll(min(50, int((deadline - now) * 1000) + 1)))
            if self.sock in events:
                self._drain_socket()
            if self.workers.wake_r in events:
                c.on_io_done()
            if self.calls.wake_fd in events:
                self.calls.run()
            self._tick(time.monotonic())
        self.controller.slicer.finish_now()
        self.controller.expire_parked(float("inf"))
        if any(busy):
            log.warning("drain deadline: %d reservations, %d waiting requests, %d L3 jobs "
                        "unfinished", *busy)
        self.calls.run(ShuttingDown("daemon is shutting down"))

    def close(self) -> None:
        """Release everything the daemon owns. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.calls.refuse()
        self.kv_events.close()  # the events of the last turns, then its sockets
        if self.workers.close():
            self.tier.close()
        else:  # a transfer still runs in the backend: closing it underneath could crash
            log.warning("L3 I/O still running at exit: the backend is left open for the "
                        "process exit to reclaim")
        self.sock.close(linger=0)
        self.ctx.term()
        self.files.remove_socket_file()
        if self.presence is not None:
            self.presence.close()
        keep = self.config.on_stop == "keep"
        if keep:
            self._keep_journal()
        self.journal.close(keep=keep)
        self.arena.close(keep=keep)
        self.calls.close()
        self.files.close(keep=keep)
        if keep:
            log.info("arena kept for the next daemon: %s and %s.meta, %.2f GiB (%d pages); "
                     "`hicached arena free --state-dir %s` frees it", self.config.arena_path,
                     self.config.arena_path, (self.arena.size_bytes + journal_bytes(
                         self.arena.size_bytes, self.config.slab_size)) / (1 << 30),
                     self.kept_pages, self.config.state_dir)

    def _keep_journal(self) -> None:
        """A stop that keeps the arena: every committed page's exact recency in the journal,
        marked a clean stop when the drain ran to its end (else the next daemon sees a crash:
        the slots handed out and not committed are fenced)."""
        r = self.index.records
        top = r.page_top
        cols = r.np
        ps = np.flatnonzero((cols["p_flags"][:top] & COMMITTED)
                            & (cols["p_stride"][:top] >= GRAIN))
        self.kept_pages = len(ps)
        if self._drained:
            self.journal.stop(cols["p_used"][ps], cols["p_off"][ps])
