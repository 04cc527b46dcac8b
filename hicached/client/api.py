"""The engine-side client: SGLang's v2 storage calls over the daemon's socket and shared arena.

    client = Client(namespace="qwen3-next|bf16|tp0/1")  # the default endpoint of `hicached serve`
    client.register_mem_host_pool_v2(kv_host_pool, PoolName.KV)
    client.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=idx, keys=keys)])

Control messages go through one DEALER socket (guarded by a lock, so any thread may call);
page bytes never do: the client copies them between its host pools and arena slots itself,
outside the lock, so several threads copy at once (except the copies that overlap a request in
flight, ``overlap.py``: speculative gets and set-ahead slots). Every round trip has a deadline
(``timeout_s``): a daemon that is gone or stuck raises ``DaemonUnavailable``, never hangs. A
daemon that restarted is re-joined transparently (new handshake, pools registered again).

Exists needs no message at all when the daemon's shared presence table can answer alone
(``client_exists.py``, ``shared_exists.py``): L2 presence is read from shared memory. Nor does a
get of pages this client saw before (``client_get.py``, ``shared_get.py``): they are copied
straight from their slots, checked by the slot tags the daemon publishes in that table.

Slots are only touched while the client is sure it still owns them: a reservation or lease
expires ``ttl`` after the daemon granted it, so copies that would end later than half the TTL
after the request was sent are abandoned (set: aborted; get: reported as misses).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import msgspec
import zmq

from hicached import protocol as P
from hicached.arena import Arena
from hicached.client.admin import ClientAdmin
from hicached.client.args import check_client_args
from hicached.client.calls import InFlight
from hicached.client.exists import KV, ExistsCalls
from hicached.client.get import GetCalls
from hicached.client.hostpool import make_page_io
from hicached.kernels.pageio import PageIO
from hicached.client.overlap import PageRecall, SetAhead
from hicached.client.piggyback import PendingReleases
from hicached.client.sets import SetCalls
from hicached.client.table_exists import SharedExists
from hicached.client.waits import WaitCalls
from hicached.errors import (
    DaemonUnavailable,
    InvalidTransfer,
    ProtocolError,
    RequestTooLarge,
    Unauthorized,
    UnknownPool,
    UnknownSession,
    error_from_code,
)
from hicached.liveness import own_pid_ns, own_start_ticks
from hicached.settings import UNIT_ENDPOINT, default_endpoint
from hicached.sockpath import refusal
from hicached.types import pool_value

if TYPE_CHECKING:
    from hicached.client.prefetch import PrefetchOperation, StopPolicy

log = logging.getLogger(__name__)

PROBE_EVERY_S = 0.1  # a call waiting longer checks this often that the daemon still listens
# Pages at least this large are copied while a request travels (get: ``PageRecall``; set:
# ``SetAhead``): below it, the bookkeeping per key costs more than the copy it would overlap.
OVERLAP_MIN_PAGE_BYTES = 64 * 1024
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


class Client(ExistsCalls, GetCalls, SetCalls, WaitCalls, ClientAdmin):
    """A connection to one hicached daemon, in one namespace. Thread-safe; a context manager.

    ``endpoint``: where the daemon listens (``ipc:///path`` or ``tcp://host:port``). Left out
    (None), it is the endpoint ``hicached serve`` listens on by default for this process's user,
    ``settings.default_endpoint`` of the process environment (read here, once):
    ``ipc://$XDG_RUNTIME_DIR/hicached/hicached.sock``, else ``ipc:///tmp/hicached-$UID/...``.
    A client of a daemon run by another user, or by the systemd unit, must name its endpoint.
    ``namespace`` is required: ``Client(namespace=...)`` or ``Client(endpoint, namespace)``."""

    def __init__(self, endpoint: str | None = None, namespace: str | None = None, *,
                 timeout_s: float = 5.0, client_name: str = "", spin_s: float = 0.002,
                 token: str = "", remember_pages: int = 65536, set_ahead_bytes: int = 64 << 20,
                 release_delay_s: float = 0.05, shared_exists: bool = True,
                 shared_gets: bool = True):
        self._default_endpoint = endpoint is None  # (named in the error when nobody listens)
        if endpoint is None:  # an entry point of engine code: the environment is read here
            endpoint = default_endpoint(os.environ)
        check_client_args(endpoint, namespace, timeout_s, client_name, spin_s, token,
                          remember_pages, set_ahead_bytes, release_delay_s, shared_exists,
                          shared_gets)
        token = token or ""
        self.endpoint = endpoint
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.spin_s = spin_s  # busy-wait this long for an answer before sleeping in poll
        self._spin_next = spin_s  # the next wait's spin (adaptive: ``_roundtrip``)
        self.client_name = client_name
        self._token = token  # the daemon's client_token, if it has one (never logged)
        self._ctx = zmq.Context()
        self._lock = threading.RLock()
        self._req_ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._pools: dict[str, PageIO] = {}
        self._events: dict[str, tuple[str, int]] = {}  # pool -> (event_hash, tokens_per_page)
        self._closed = False
        self._inflight = InFlight()  # sets and gets under way (close waits for them)
        self._ended = False  # close() said Bye: no request goes out any more
        # (pool, key) -> (offset, tag) of pages this client wrote or read (see _load); at most
        # ``remember_pages`` entries (0: never copy speculatively). Only for large pages.
        self._recall = PageRecall(remember_pages, OVERLAP_MIN_PAGE_BYTES)
        self._epoch = 0  # handshakes so far: locations learnt before one are void
        # set-ahead slots (overlap.py): per pool at most ``set_ahead_bytes`` (0: off)
        self._ahead = SetAhead(set_ahead_bytes, OVERLAP_MIN_PAGE_BYTES)
        # leases done with, carried by the next request or sent alone after ``release_delay_s``
        self._releases = PendingReleases(self._send_release, release_delay_s)
        self.session = 0
        self.arena: Arena | None = None
        self._use_shared = shared_exists or shared_gets  # map the daemon's presence table
        self._shared_exists = shared_exists  # answer exists from it
        self._shared_gets = shared_gets  # read known pages checked by its slot tags
        self._shared: SharedExists | None = None
        self._view: tuple[int, Arena | None, SharedExists | None] = (0, None, None)
        self._commits = [0, 0]  # commits sent unanswered, [sent, known read by the daemon]
        self._commits_lost = 0  # commits up to this one may have died with a dropped socket
        try:
            with self._lock:
                self._handshake()
        except BaseException:
            if self._sock is not None:
                self._sock.close(linger=0)
            self._ctx.term()
            raise

    # ------------------------------------------------------------ connection

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

    def _handshake(self) -> None:
        self._new_socket()
        hello = P.Hello(next(self._req_ids), P.PROTOCOL_VERSION, self.namespace, os.getpid(),
                        self.client_name, self._token, own_start_ticks(), own_pid_ns(),
                        self.session)
        w = self._roundtrip(hello)
        if not isinstance(w, P.Welcome):
            raise ProtocolError(f"expected Welcome, got {type(w).__name__}")
        self.session = w.session
        self._epoch += 1
        self._recall.clear()
        self._ahead.void()
        self._releases.drop()
        self.reservation_ttl_s = w.reservation_ttl_s
        self.lease_ttl_s = w.lease_ttl_s
        self.flushes_namespaces = w.flush_namespace  # (``ClientAdmin.flush``)
        if self.arena is None or self.arena.path != w.arena_path or \
                self.arena.size_bytes != w.arena_bytes or self.arena.ident != _ident(w.arena_path):
            self.arena = Arena.attach(w.arena_path, w.arena_bytes)  # old mapping dies with refs
        self._shared = SharedExists.open(w) if self._use_shared else None
        # what answers of this session are read against, replaced in one step: a thread whose
        # request another thread's handshake overtook copies from the arena its answer names
        self._view = (self._epoch, self.arena, self._shared)
        for name, io in self._pools.items():
            self._registered(name, self._roundtrip(P.RegisterPool(
                next(self._req_ids), self.session, name, io.page_bytes, *self._events[name])))

    def _registered(self, name: str, answer: P.Registered) -> None:
        if self._shared is not None:
            self._shared.bits[name] = answer.bit

    def _roundtrip(self, msg, timeout_s: float | None = None, while_waiting=None) -> Any:
        """Send one request and wait (deadline) for its answer; daemon errors are raised.
        ``while_waiting()`` runs once the request is sent (it must not raise)."""
        if self._sock is None:
            self._new_socket()
            if self._commits[1] != self._commits[0]:
                self._commits_lost = self._commits[0]
            self._commits[1] = self._commits[0]  # a fresh socket: the old one's queue is gone
        commits = self._commits[0]
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
            self._commits[1] = max(self._commits[1], commits)  # one socket: read in order
            if isinstance(answer, P.Error):
                raise error_from_code(answer.code, answer.message)
            return answer

    def _call(self, build, timeout_s: float | None = None, while_waiting=None,
              view: bool = False) -> Any:
        """``build(session, req_id) -> request``; re-joins a restarted daemon once.
        ``while_waiting``: see ``_roundtrip`` (first attempt only). ``view``: return
        (answer, (epoch, arena, shared table) of the session that answered)."""
        with self._lock:
            if self._ended:  # (calls of sets and gets close() waits for may still go out)
                raise DaemonUnavailable("client is closed")
            try:
                answer = self._roundtrip(self._carry(build(self.session, next(self._req_ids))),
                                         timeout_s, while_waiting)
            except (UnknownSession, Unauthorized):  # Unauthorized: a fresh socket, not yet joined
                log.warning("hicached session lost (daemon restarted?): joining again")
                self._handshake()
                answer = self._roundtrip(self._carry(build(self.session, next(self._req_ids))),
                                         timeout_s)
            return (answer, self._view) if view else answer

    def _carry(self, msg):
        """``msg`` with the pending lease releases piggybacked; before any other request they
        go out alone (same socket, so the daemon ends them first: a Flush after a get finds
        the pages unpinned, as it would without piggybacking)."""
        ids = self._releases.take()
        if ids:
            if isinstance(msg, _CARRIERS):
                msg.release = ids
            else:
                self._send_release(ids)
        return msg

    def _send_release(self, lease_ids: list[int], touched: list[int] = (), gets: int = 0
                      ) -> None:
        self._send_only(P.Release(0, self.session, lease_ids, list(touched), gets))

    def _send_only(self, msg) -> None:
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.send(P.encode(msg), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the lease expires on its own

    # ------------------------------------------------------------ pools

    def register_mem_host_pool_v2(self, host_pool: Any, pool_name: Any, event_hash: str = "",
                                  tokens_per_page: int = 0) -> None:
        """Register the host pool of ``pool_name`` (any SGLang-shaped pool or a ``HostPool``).
        ``event_hash``: its keys are the engine's block hashes, for KV events (docs/kv-events.md:
        "sglang_int64", "vllm_bytes", "vllm_int64"; "": no events), of ``tokens_per_page``."""
        name = pool_value(pool_name)
        io = make_page_io(host_pool)
        events = (event_hash, tokens_per_page)
        self._registered(name, self._call(
            lambda s, r: P.RegisterPool(r, s, name, io.page_bytes, *events)))
        self._pools[name], self._events[name] = io, events

    def register_mem_pool_host(self, host_pool: Any) -> None:
        """v1: register the KV host pool."""
        self.register_mem_host_pool_v2(host_pool, KV)

    def _io(self, name: str) -> PageIO:
        try:
            return self._pools[name]
        except KeyError:
            raise UnknownPool(f"pool {name!r} is not registered (registered: "
                              f"{sorted(self._pools)})") from None

    # ------------------------------------------------------------ set

    # ------------------------------------------------------------ prefetch

    def prefetch(self, keys: Sequence[str], host_indices: Any, sidecars: Sequence[Any] = (), *,
                 policy: str | StopPolicy = "best_effort", chunk_pages: int = 128,
                 on_progress: Any = None) -> PrefetchOperation:
        """Start exists + chunked get of ``keys`` into the registered KV pool at
        ``host_indices`` (and the ``sidecars`` transfers' pools) on a background thread.

        ``policy``: when the caller may stop waiting (``hicached.client.prefetch``: "best_effort",
        "wait_complete", "timeout", or a ``StopPolicy``). Returns the running operation."""
        from hicached.client.prefetch import PrefetchOperation, make_policy

        op = PrefetchOperation(self, keys, host_indices, sidecars, make_policy(policy),
                               chunk_pages=chunk_pages, on_progress=on_progress)
        op.start()
        return op

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """End the session (its leases and reservations are freed). Idempotent.

        Sets and gets other threads have under way end first (their commits go out, their
        copies finish), for at most half a TTL (what such a call may take before it gives up
        on its own); new ones raise ``DaemonUnavailable``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        bound = max(self.reservation_ttl_s, self.lease_ttl_s) / 2 + 1.0
        if not self._inflight.drain(bound):
            log.warning("close(): sets or gets of other threads still running after %.0fs: "
                        "their pages are misses", bound)
        with self._lock:
            self._ended = True
            touched, gets = self._releases.close()  # Bye ends every lease of the session
            if self._sock is not None:
                try:
                    tally = self._shared and self._shared.tally(self.session)
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
            for io in self._pools.values():  # CUDA registrations of the arena go first
                release = getattr(io, "release_arena", None)
                if release is not None:
                    release()
            if self.arena is not None:
                self.arena.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
