"""One client's connection to its daemon: the socket, the session and what a session maps.

Control messages go through one DEALER socket (guarded by a lock, so any thread may call);
page bytes never do (the calls copy them between host pools and arena slots themselves, outside
the lock). Every round trip has a deadline (``timeout_s``): a daemon that is gone or stuck
raises ``DaemonUnavailable``, never hangs. A daemon that restarted is re-joined transparently
(a new handshake, the pools registered again, what was learnt of the old arena forgotten).

What a request and its answer are read against changes at each join, in one step::

    view = (epoch, arena, shared)   epoch: handshakes so far (locations learnt before one are
                                    void); arena: the mapped arena file; shared: the daemon's
                                    presence table (``table_exists.py``), or None
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any

import msgspec
import zmq

from hicached import protocol as P
from hicached.arena import Arena
from hicached.client.overlap import PageRecall, SetAhead
from hicached.client.piggyback import PendingReleases
from hicached.client.pools import PoolTable
from hicached.client.table_exists import SharedExists
from hicached.errors import (
    DaemonUnavailable,
    InvalidTransfer,
    ProtocolError,
    RequestTooLarge,
    Unauthorized,
    UnknownSession,
    error_from_code,
)
from hicached.kernels.pageio import PageIO
from hicached.liveness import own_pid_ns, own_start_ticks
from hicached.settings import UNIT_ENDPOINT
from hicached.sockpath import refusal

log = logging.getLogger(__name__)

PROBE_EVERY_S = 0.1  # a call waiting longer checks this often that the daemon still listens
# Requests that carry the client's pending lease releases (``piggyback.py``).
_CARRIERS = (P.Exists, P.Lease, P.Reserve)


def _ident(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path`` (a daemon restarted with the same pid, as pid 1 in
    a container, made a new arena file), or None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def next_spin(spin_s: float, spin: float, waited_s: float) -> float:
    """The spin of a client's next wait for an answer, after one that came ``waited_s`` after
    its request, with ``spin`` the spin of that wait: ``spin_s`` again when it came within
    ``spin_s``, else half of ``spin`` (0 once under 1/64 of ``spin_s``)."""
    if waited_s <= spin_s:
        return spin_s
    return spin / 2 if spin > spin_s / 64 else 0.0


class InFlight:
    """Sets and gets running in this client's threads: ``Client.close`` lets them end (their
    commits go out, their leased copies finish) before its ``Bye`` frees their slots."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._count = 0

    def __enter__(self) -> None:
        with self._cond:
            self._count += 1

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._count -= 1
            if not self._count:
                self._cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until none runs (True) or ``timeout_s`` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._count, timeout_s)


class Connection:
    """The socket to one daemon and the session on it. Thread-safe.

    Owns: the ZeroMQ context and DEALER socket, ``lock`` (held for every send and round trip),
    the session (``session``, ``epoch``, the TTLs and capabilities of the daemon's ``Welcome``),
    the mapped ``arena`` and presence table ``shared`` (``view``: the three of one join), the
    commit counters (``commits``: [sent, known read by the daemon]), the lease ids waiting to be
    released (``releases``, piggybacked on requests) and the calls under way (``inflight``).

    Mutates its collaborators only at a join (the handshake, at construction and after a daemon
    restart): ``recall.clear()``, ``ahead.void()``, and every pool of ``pools`` registered
    again; at ``close`` it calls ``pools.release_all()``. Calls nothing else of the client.

    The handshake happens in the constructor: raises ``DaemonUnavailable`` when nobody answers
    (``default_endpoint``: the endpoint was not named, which the error says), ``Unauthorized``,
    ``ProtocolError``."""

    def __init__(self, endpoint: str, namespace: str, *, timeout_s: float, client_name: str,
                 spin_s: float, token: str, release_delay_s: float, map_table: bool,
                 default_endpoint: bool, pools: PoolTable, recall: PageRecall,
                 ahead: SetAhead):
        self.endpoint = endpoint
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.spin_s = spin_s  # busy-wait this long for an answer before sleeping in poll
        self._spin_next = spin_s  # the next wait's spin (adaptive: ``roundtrip``)
        self.client_name = client_name
        self._token = token  # the daemon's client_token, if it has one (never logged)
        self._default_endpoint = default_endpoint  # (named in the error when nobody listens)
        self._map_table = map_table  # map the daemon's presence table
        self._pools = pools
        self._recall = recall
        self._ahead = ahead
        self._ctx = zmq.Context()
        self.lock = threading.RLock()
        self._req_ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self.closed = False  # close() began: new sets and gets raise
        self.inflight = InFlight()  # sets and gets under way (close waits for them)
        self._ended = False  # close() said Bye: no request goes out any more
        self.epoch = 0  # handshakes so far: locations learnt before one are void
        # leases done with, carried by the next request or sent alone after ``release_delay_s``
        self.releases = PendingReleases(self.send_release, release_delay_s)
        self.session = 0
        self.arena: Arena | None = None
        self.shared: SharedExists | None = None
        self.view: tuple[int, Arena | None, SharedExists | None] = (0, None, None)
        self.commits = [0, 0]  # commits sent unanswered, [sent, known read by the daemon]
        self.commits_lost = 0  # commits up to this one may have died with a dropped socket
        self.reservation_ttl_s = self.lease_ttl_s = 0.0
        self.flushes_namespaces = False
        try:
            with self.lock:
                self.handshake()
        except BaseException:
            if self._sock is not None:
                self._sock.close(linger=0)
            self._ctx.term()
            raise

    # ------------------------------------------------------------ joining

    def _new_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        if self.endpoint.startswith("ipc://"):
            why = refusal(self.endpoint[6:])
            if why is not None:  # (a dead daemon's socket file: fail now, not at the deadline)
                self._sock = None
                raise DaemonUnavailable(f"no daemon socket at {self.endpoint} ({why})" + (
                    ": the default endpoint of `hicached serve` for this user; is it running? "
                    f"(a daemon of another user, or the systemd unit's at {UNIT_ENDPOINT}, "
                    "needs its endpoint named: Client(endpoint, namespace))"
                    if self._default_endpoint else ""))
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)

    def handshake(self) -> None:
        """Join the daemon (again): a fresh socket, ``Hello``, the arena and presence table of
        its ``Welcome`` mapped, every pool registered again. Call with ``lock`` held."""
        self._new_socket()
        hello = P.Hello(next(self._req_ids), P.PROTOCOL_VERSION, self.namespace, os.getpid(),
                        self.client_name, self._token, own_start_ticks(), own_pid_ns(),
                        self.session)
        w = self.roundtrip(hello)
        if not isinstance(w, P.Welcome):
            raise ProtocolError(f"expected Welcome, got {type(w).__name__}")
        self.session = w.session
        self.epoch += 1
        self._recall.clear()
        self._ahead.void()
        self.releases.drop()
        self.reservation_ttl_s = w.reservation_ttl_s
        self.lease_ttl_s = w.lease_ttl_s
        self.flushes_namespaces = w.flush_namespace  # (``ClientAdmin.flush``)
        if self.arena is None or self.arena.path != w.arena_path or \
                self.arena.size_bytes != w.arena_bytes or self.arena.ident != _ident(w.arena_path):
            self.arena = Arena.attach(w.arena_path, w.arena_bytes)  # old mapping dies with refs
        self.shared = SharedExists.open(w) if self._map_table else None
        # what answers of this session are read against, replaced in one step: a thread whose
        # request another thread's handshake overtook copies from the arena its answer names
        self.view = (self.epoch, self.arena, self.shared)
        for name, io, events in self._pools.items():
            self._registered(name, self.roundtrip(P.RegisterPool(
                next(self._req_ids), self.session, name, io.page_bytes, *events)))

    def register_pool(self, name: str, io: PageIO, events: tuple[str, int]) -> None:
        """Register pool ``name`` (its page size, its KV-event settings) with the daemon."""
        self._registered(name, self.call(
            lambda s, r: P.RegisterPool(r, s, name, io.page_bytes, *events)))

    def _registered(self, name: str, answer: P.Registered) -> None:
        if self.shared is not None:
            self.shared.learn_bit(name, answer.bit)

    # ------------------------------------------------------------ requests

    def roundtrip(self, msg, timeout_s: float | None = None, while_waiting=None) -> Any:
        """Send one request and wait (deadline) for its answer; daemon errors are raised.
        ``while_waiting()`` runs once the request is sent (it must not raise)."""
        if self._sock is None:
            self._new_socket()
            if self.commits[1] != self.commits[0]:
                self.commits_lost = self.commits[0]
            self.commits[1] = self.commits[0]  # a fresh socket: the old one's queue is gone
        commits = self.commits[0]
        try:
            payload = P.encode(msg)
        except (TypeError, ValueError, OverflowError) as e:  # (msgspec.EncodeError: ValueError)
            raise InvalidTransfer(f"{type(msg).__name__} cannot be sent: {e} (keys must be "
                                  "str, indices int)") from None
        if len(payload) > P.MAX_REQUEST_BYTES:  # the daemon would drop the connection
            raise RequestTooLarge(
                f"{type(msg).__name__} of {len(payload)} bytes exceeds the daemon's limit of "
                f"{P.MAX_REQUEST_BYTES} bytes: split the call into smaller batches")
        self._sock.send(payload)
        if while_waiting is not None:
            while_waiting()
        start = time.monotonic()
        timeout_s = timeout_s or self.timeout_s
        deadline = start + timeout_s
        # answers usually come within the spin: skip the wake-up cost. One that came later
        # halves the next spin (a busy daemon: on a small machine, spinning clients only take
        # the CPU it needs), one that came within ``spin_s`` brings it back whole
        spin_until = start + self._spin_next
        while True:
            now = time.monotonic()
            left = deadline - now
            if now < spin_until:
                if not self._sock.poll(0, zmq.POLLIN):
                    # let a thread waiting for this CPU run: on a small machine that may be
                    # the daemon itself, which would otherwise answer only after the spin
                    # (measured: exists p99 2.1-2.5 ms -> 0.7 ms on 2 vCPUs, same p50)
                    os.sched_yield()
                    continue
            elif left <= 0 or not self._sock.poll(int(min(left, PROBE_EVERY_S) * 1000) + 1,
                                                  zmq.POLLIN):
                why = None
                if time.monotonic() < deadline:
                    if not self.endpoint.startswith("ipc://"):
                        continue
                    why = refusal(self.endpoint[6:])  # still there? (a killed daemon leaves
                    if why is None:  # its socket file; it would never answer)
                        continue
                self._sock.close(linger=0)  # drop queued requests; a fresh socket next time
                self._sock = None
                raise DaemonUnavailable(
                    f"no answer from hicached at {self.endpoint} within {timeout_s}s "
                    f"({type(msg).__name__})" if why is None else
                    f"hicached at {self.endpoint} is gone ({why}; {type(msg).__name__})")
            raw = self._sock.recv()
            self._spin_next = next_spin(self.spin_s, self._spin_next, time.monotonic() - start)
            try:
                answer = P.answer_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError,
                    RecursionError) as e:  # not a hicached daemon, or a broken one
                raise ProtocolError(f"malformed answer to {type(msg).__name__} from "
                                    f"{self.endpoint} ({len(raw)} bytes): {e}") from None
            if answer.req_id != msg.req_id:
                continue  # the late answer of a request we gave up on
            self.commits[1] = max(self.commits[1], commits)  # one socket: read in order
            if isinstance(answer, P.Error):
                raise error_from_code(answer.code, answer.message)
            return answer

    def call(self, build, timeout_s: float | None = None, while_waiting=None,
             view: bool = False) -> Any:
        """``build(session, req_id) -> request``; re-joins a restarted daemon once.
        ``while_waiting``: see ``roundtrip`` (first attempt only). ``view``: return
        (answer, (epoch, arena, shared table) of the session that answered)."""
        with self.lock:
            if self._ended:  # (calls of sets and gets close() waits for may still go out)
                raise DaemonUnavailable("client is closed")
            try:
                answer = self.roundtrip(self._carry(build(self.session, next(self._req_ids))),
                                        timeout_s, while_waiting)
            except (UnknownSession, Unauthorized):  # Unauthorized: a fresh socket, not yet joined
                log.warning("hicached session lost (daemon restarted?): joining again")
                self.handshake()
                answer = self.roundtrip(self._carry(build(self.session, next(self._req_ids))),
                                        timeout_s)
            return (answer, self.view) if view else answer

    def _carry(self, msg):
        """``msg`` with the pending lease releases piggybacked; before any other request they
        go out alone (same socket, so the daemon ends them first: a Flush after a get finds
        the pages unpinned, as it would without piggybacking)."""
        ids = self.releases.take()
        if ids:
            if isinstance(msg, _CARRIERS):
                msg.release = ids
            else:
                self.send_release(ids)
        return msg

    def send_release(self, lease_ids: list[int], touched: list[int] = (), gets: int = 0
                     ) -> None:
        """A fire-and-forget ``Release`` (``releases`` sends through it)."""
        self.send_only(P.Release(0, self.session, lease_ids, list(touched), gets))

    def send_only(self, msg) -> None:
        """Send ``msg`` expecting no answer; dropped when the socket cannot take it (what it
        would end expires on its own)."""
        with self.lock:
            if self._sock is not None:
                try:
                    self._sock.send(P.encode(msg), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the lease expires on its own

    def send_commit(self, epoch: int, reservation_id: int, ok: list[list[bool]]) -> bool:
        """Commit reservation ``reservation_id`` of the join ``epoch`` without waiting (the
        daemon acknowledges it by its sequence number in the presence table); False, and
        nothing sent, when another thread joined a restarted daemon since or ``close`` gave up
        waiting for the call: the commit cannot reach the reservation's session."""
        with self.lock:
            if self.epoch != epoch or self._sock is None:
                return False
            self.commits[0] += 1
            self.send_only(P.Commit(0, self.session, reservation_id, ok, reply=False,
                                    seq=self.commits[0]))
            return True

    def sync_commits(self, timeout_s: float | None = None) -> None:
        """Block until the daemon has read every commit this client sent (see
        ``WaitCalls.wait_committed``); one ``Ping`` unless the presence table says so."""
        with self.lock:
            sent, known = self.commits
            if sent and sent <= self.commits_lost:
                raise DaemonUnavailable(f"commit {sent} may be lost: its socket to "
                                        f"{self.endpoint} was dropped")
            if sent == known:
                return
            shared = self.shared
            if shared is not None and shared.view.read_up_to(sent):
                self.commits[1] = max(self.commits[1], sent)
                return
            if self._sock is None:  # the socket that carried them is gone
                self.commits_lost = sent
                raise DaemonUnavailable(f"commit {sent} may be lost: its socket to "
                                        f"{self.endpoint} was dropped")
            self.call(lambda s, r: P.Ping(r), timeout_s)
            if self.commits[1] < sent:
                raise DaemonUnavailable(f"commit {sent} was not acknowledged by {self.endpoint}")

    # ------------------------------------------------------------ lifecycle

    def check_open(self) -> None:
        """``DaemonUnavailable`` once ``close`` began (a set or get checks, counted in
        ``inflight``: ``close`` waits for it, or it sees the client closed)."""
        if self.closed:
            raise DaemonUnavailable("client is closed")

    def close(self) -> None:
        """End the session (its leases and reservations are freed). Idempotent.

        Sets and gets other threads have under way end first (their commits go out, their
        copies finish), for at most half a TTL (what such a call may take before it gives up
        on its own); new ones raise ``DaemonUnavailable``."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        bound = max(self.reservation_ttl_s, self.lease_ttl_s) / 2 + 1.0
        if not self.inflight.drain(bound):
            log.warning("close(): sets or gets of other threads still running after %.0fs: "
                        "their pages are misses", bound)
        with self.lock:
            self._ended = True
            touched, gets = self.releases.close()  # Bye ends every lease of the session
            if self._sock is not None:
                try:
                    tally = self.shared and self.shared.tally(self.session)
                    if tally:
                        self._sock.send(P.encode(tally), zmq.NOBLOCK)
                    if touched or gets:
                        self._sock.send(P.encode(P.Release(0, self.session, [], touched, gets)),
                                        zmq.NOBLOCK)
                    self._sock.send(P.encode(P.Bye(0, self.session)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                self._sock.close(linger=100)  # give Bye a moment to leave
                self._sock = None
            self._ctx.term()
            self._pools.release_all()  # CUDA registrations of the arena go first
            if self.arena is not None:
                self.arena.close()
