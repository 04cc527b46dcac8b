"""The daemon: one object owning the socket, the arena, the index, the controller and the L3 tier.

The control loop is single-threaded. It polls the ROUTER socket and the I/O workers' wake pipe,
answers each request, and between batches sweeps expired reservations / leases and clients whose
process is gone. A request that cannot be decoded or is invalid gets a typed ``Error`` answer;
nothing a client sends can stop the loop.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import zmq

from hicached import protocol as P
from hicached.arena import Arena, arena_progress, release_if_made
from hicached.backends.base import L3Backend, create_backend
from hicached.daemon.auth import make_auth
from hicached.daemon.collector import tune_for_the_loop
from hicached.daemon.controller import Controller
from hicached.daemon.files import DaemonFiles
from hicached.daemon.handshake import Handshakes
from hicached.daemon.eviction.registry import make_policy
from hicached.daemon.index import PageIndex
from hicached.daemon.kv_events import make_kv_events
from hicached.daemon.l3.tier import L3Tier, close_quietly
from hicached.daemon.l3.workers import IOWorkers
from hicached.daemon.leases import LeaseTable
from hicached.daemon.operations import DaemonOperations, backend_options
from hicached.daemon.quotas import make_quotas
from hicached.daemon.room import allocated_bytes, check_room, read_room
from hicached.daemon.sessions import Session, namespace_digest
from hicached.daemon.slabs import SlabAllocator
from hicached.daemon import slicing
from hicached.daemon.slicing import Steps, as_answer, drive
from hicached.errors import (
    BackendError,
    BackendUnavailable,
    HicachedError,
    ProtocolError,
    ShuttingDown,
    UnknownSession,
)
from hicached.liveness import own_pid_ns
from hicached.ops.config import DaemonConfig
from hicached.ops.metrics import make_metrics
from hicached.ops.sdnotify import NullNotifier
from hicached.presence import TAG_GRAIN, PresenceTable, default_slots, table_bytes

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 0.5
MAX_BATCH = 256  # requests handled before the loop looks at I/O completions and timers
# answered while draining (they finish work in flight); everything else gets ShuttingDown
_DRAIN_OK = (P.Commit, P.Release, P.Bye, P.ExistsTally)


class _Sliced(NamedTuple):
    """What ``_dispatch`` returns for a call worked in slices (``slicing.py``): its steps."""

    steps: Steps


class Daemon(DaemonOperations, Handshakes, DaemonFiles):
    """``Daemon(config).serve_forever()`` runs until ``stop()`` (or SIGTERM/SIGINT via ``run``)."""

    def __init__(self, config: DaemonConfig,
                 on_phase: Callable[[str], None] | None = None):
        """Make the daemon: state lock, arena, index, L3 backend, socket. ``on_phase(name)`` is
        called as the start reaches "lock", "arena" (after each step of the reservation), "l3"
        and "socket" (``ops/phases.py``); whatever it raises abandons the start, which undoes
        what it made (lock, arena file, backend, socket) and lets the exception go on."""
        self.config = config
        self._stop = threading.Event()
        self._stop_asked = False  # set by a signal handler (stop_on_signal)
        on_phase = on_phase or (lambda name: None)
        log_progress = arena_progress()

        def progress(done: int, total: int) -> None:
            log_progress(done, total)
            on_phase("arena")

        self._lock_fd = self._take_state_lock(config.state_dir)
        try:
            on_phase("lock")
            self._check_endpoint(config.endpoint)  # taken: say so before the arena and L3
            self._recorded_arena(self._lock_fd, config.arena_path)
            self._check_room(config)  # an arena the node cannot back: refused before it is made
            log.info("reserving the arena: %.1f GiB of shared memory at %s (about a second "
                     "per GiB)", config.l2_size / (1 << 30), config.arena_path)
            self.arena = Arena.create(config.arena_path, config.l2_size, mode=config.access_mode,
                                      progress=progress)
            self._record_arena(self._lock_fd, config.arena_path)
            self._set_group(config.arena_path)
        except BaseException:
            if hasattr(self, "arena"):
                self.arena.close()
                self._record_arena(self._lock_fd)
            os.close(self._lock_fd)
            raise
        try:
            self.allocator = SlabAllocator(config.l2_size, config.slab_size)
            self.presence = self._presence_table(config)
            self.index = PageIndex(self.allocator,
                                   policy=make_policy(config.eviction, config.eviction_alpha),
                                   presence=self.presence)
            self.leases = LeaseTable(self.index, config.reservation_ttl_s, config.lease_ttl_s)
            self.workers = IOWorkers(config.io_queue_depth)
            self.tier = L3Tier(self.index, self.workers, None, config.write_policy,
                               config.write_through_threshold, config.prefetch,
                               config.l3_load_chunk, config.l3_audit_s)
            if config.l3_backend != "none":
                self.tier.attach(self._open_backend(config.l3_backend, None))
            on_phase("l3")
            if self.presence is not None:  # before any client reads it (a restart with L3)
                self.presence.beat(time.monotonic(), self.tier.attached)
            self.controller = Controller(self.index, self.leases, self.tier, time.monotonic,
                                         config.get_wait_s)
            self.controller.books = []  # answer first, keep the books after (controller.py)
            self.controller.quotas = make_quotas(self.index, config.namespace_quotas)
            self.controller.ahead_session_bytes = config.set_ahead_bytes
            self.controller.ahead_total_bytes = config.l2_size // 8  # idle slots: at most 1/8
            self.controller.reclaim.attach(config.evict_ahead, self._request_waits)
            self.controller.slicer.attach(self._request_waits)
            self.controller.kv_events = make_kv_events(config, self.index, self.tier)
            self.ctx = zmq.Context()
            self.sock = self._bind(config.endpoint)
            on_phase("socket")
        except BaseException:
            if hasattr(self, "controller"):
                self.controller.kv_events.close()
            if hasattr(self, "workers"):
                self.workers.close()
            if getattr(self, "tier", None) is not None:
                self.tier.close()
            if hasattr(self, "sock"):  # (ctx.term waits for every socket to be closed)
                self.sock.close(linger=0)
                self._remove_socket_file()
            if hasattr(self, "ctx"):
                self.ctx.term()
            if getattr(self, "presence", None) is not None:
                self.presence.close()
            release_if_made(config.arena_path + ".presence")  # interrupted while made
            self.arena.close()
            self._record_arena(self._lock_fd)
            os.close(self._lock_fd)
            raise
        self.requests = 0
        self._pid_ns = own_pid_ns()  # clients in it may be checked by the pid they state
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (fn, Future) for the loop
        self._call_r, self._call_w = os.pipe()
        os.set_blocking(self._call_r, False)
        self._attaching = False
        self._closed = False
        self._loop_thread: int | None = None
        self.auth = make_auth(config.client_token)
        self.metrics = make_metrics(self, enabled=bool(config.admin_port))
        self.notifier = NullNotifier()  # systemd: set by service.serve before serve_forever

    # ------------------------------------------------------------ setup

    def _open_backend(self, name: str, options: dict | None) -> L3Backend:
        """Create and open a backend (blocking: never on the control loop once it runs)."""
        opts = backend_options(name, self.config, options)
        try:
            backend = create_backend(name, **opts)
        except HicachedError:
            raise
        except (ValueError, TypeError) as e:
            raise BackendError(f"L3 backend {name!r}: {e}") from None
        except OSError as e:  # its directory / device cannot be made or opened
            raise BackendUnavailable(f"L3 backend {name!r}: {e}") from None
        try:
            backend.open(self.arena)
        except Exception as e:
            close_quietly(backend)
            if isinstance(e, HicachedError):
                raise
            raise BackendUnavailable(f"L3 backend {name!r} failed to open: "
                                     f"{type(e).__name__}: {e}") from None
        backend.opened_with = opts  # a re-attach with other options is refused (operations.py)
        return backend

    @staticmethod
    @staticmethod
    def _check_room(config: DaemonConfig) -> None:
        """ConfigError when the node cannot back the arena and its presence table (``room.py``);
        the files a crashed daemon left at their paths count as free (they are replaced)."""
        def table(arena_bytes: int) -> int:
            if not config.shared_exists:
                return 0
            return table_bytes(config.presence_slots or default_slots(arena_bytes), arena_bytes,
                               TAG_GRAIN if config.shared_gets else 0)

        old = allocated_bytes(config.arena_path, config.arena_path + ".presence")
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
        try:
            os.write(self._call_w, b"x")
        except OSError:
            pass

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
        self._set_group(table.path)
        return table

    def _tick(self, now: float) -> None:
        """Every ``SWEEP_INTERVAL_S``: expire reservations and leases, drop dead clients, relieve
        write-back pressure, audit L3 copies when due; and feed the systemd watchdog (only a
        running loop does). Every turn: hand the turn's KV events to their publisher."""
        self.controller.kv_events.send()
        if now >= self._next_watchdog:
            interval = self.notifier.watchdog_interval_s
            if interval:
                self.notifier.watchdog()
            self._next_watchdog = now + (interval or float("inf"))
        if now >= self._next_sweep:
            self.leases.sweep(now)
            self.index.republish()
            self.controller.reap_dead_sessions()
            self.controller.reap_idle_unchecked(now, self.config.unchecked_idle_s)
            self.auth.prune(self.controller.sessions)
            self.tier.relieve_pressure()
            self.tier.audit(now)
            self._next_sweep = now + SWEEP_INTERVAL_S

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.workers.wake_r, zmq.POLLIN)
        poller.register(self._call_r, zmq.POLLIN)
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S
        self._next_watchdog = 0.0
        busy_until = 0.0  # spin (non-blocking polls) until then: see busy_poll_ms in the config
        busy_s = self.config.busy_poll_ms / 1000
        self._loop_thread = threading.get_ident()
        tune_for_the_loop()  # (collector.py)
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
                if self._call_r in events:
                    self._run_calls()
                if self.controller.slicer.active:  # a slice of a huge call (slicing.py)
                    self._guarded(self.controller.slicer.step)
                    # the clients waiting for a CPU (a small machine: the loop busy with a huge
                    # call takes a core) may send their requests before the next slice
                    os.sched_yield()
                if self.controller.flusher.active:
                    self._guarded(self.controller.flusher.step)
                elif reclaim and self.sock not in events:  # an idle turn: evict ahead
                    self._guarded(self.controller.reclaim.step)
                now = time.monotonic()
                if self.presence is not None:
                    self.presence.beat(now, self.tier.attached)
                if self.controller.parked:
                    self._guarded(self.controller.expire_parked, now)
                self._guarded(self._tick, now)
            self._drain_for_shutdown()
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
        c = self.controller
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
                return c.wait_stored(self._session(msg.session), msg,
                                     lambda answer: self._send_parked(identity, msg, answer))
            case P.Reserve():
                if self._stop.is_set():
                    raise ShuttingDown("daemon is shutting down; not accepting writes")
                s = self._session(msg.session)
                return self._steps(s, msg, lambda chunk: c.reserve_steps(s, msg, chunk))
            case P.Commit():
                s = self._session(msg.session)
                answer = self._steps(s, msg, lambda chunk: c.commit_steps(s, msg, chunk))
                return answer if msg.reply or type(answer) is _Sliced else None
            case P.Hello():
                return self._hello(identity, msg, frame)
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
                c.close_session(msg.session)
                return None
            case P.Flush():  # (namespace "": the whole node, as from an older client)
                if msg.tier == "l2":  # answered when the walk of the arena ends
                    c.flush_l2(lambda n: self._send(identity, P.Ok(msg.req_id)),
                               namespace_digest(msg.namespace) if msg.namespace else None)
                    return None
                self._off_loop(identity, msg.req_id,
                               lambda: self.flush(msg.tier, namespace=msg.namespace),
                               lambda n: P.Ok(msg.req_id))
                return None
            case P.Attach():
                self._attach_for(identity, msg)
                return None
            case P.Detach():  # dirty write-back pages are written first: off the loop
                self._off_loop(identity, msg.req_id, self.detach_backend,
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
                return P.Stats(msg.req_id, self.loop_stats())
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
        for fd in (self.sock, self.workers.wake_r, self._call_r):
            poller.register(fd, zmq.POLLIN)
        while True:
            self.controller.slicer.finish_now()  # huge calls under way: answered
            self.controller.flusher.finish_now()  # answer flushes while the socket is up
            self.tier.write_back_all()
            c = self.controller
            busy = (len(self.leases.reservations), len(c.parked), self.workers.in_flight)
            now = time.monotonic()
            if not any(busy) or now >= deadline:
                break
            events = dict(poller.poll(min(50, int((deadline - now) * 1000) + 1)))
            if self.sock in events:
                self._drain_socket()
            if self.workers.wake_r in events:
                c.on_io_done()
            if self._call_r in events:
                self._run_calls()
            self._tick(time.monotonic())
        self.controller.slicer.finish_now()
        self.controller.expire_parked(float("inf"))
        if any(busy):
            log.warning("drain deadline: %d reservations, %d waiting requests, %d L3 jobs "
                        "unfinished", *busy)
        self._run_calls(ShuttingDown("daemon is shutting down"))

    def _remove_socket_file(self) -> None:
        """Remove the ipc socket's file (its socket closed: zmq leaves it)."""
        ep = self.config.endpoint
        if ep.startswith("ipc://"):
            try:
                os.unlink(ep[len("ipc://"):])
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Release everything the daemon owns. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.controller.kv_events.close()  # the events of the last turns, then its sockets
        if self.workers.close():
            self.tier.close()
        else:  # a transfer still runs in the backend: closing it underneath could crash
            log.warning("L3 I/O still running at exit: the backend is left open for the "
                        "process exit to reclaim")
        self.sock.close(linger=0)
        self.ctx.term()
        self._remove_socket_file()
        if self.presence is not None:
            self.presence.close()
        self.arena.close()
        self._record_arena(self._lock_fd)
        os.close(self._call_r)
        os.close(self._call_w)
        os.close(self._lock_fd)
