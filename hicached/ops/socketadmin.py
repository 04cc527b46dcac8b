"""The admin commands over the daemon's own control socket: ``hicached status | flush | attach |
detach`` on the daemon's machine with no admin API configured (``adminctl`` picks the way).

Whoever may connect to the socket is trusted like an operator already (docs/operating.md,
Access): the socket carries flushes and attaches for engines too. A daemon with a
``client_token`` wants it in a handshake first, as from any client (``status`` then leaves that
session out of what it shows: ``without_own_session``); without one the admin requests need no
session.
The answers are shaped as the admin HTTP API's, so one formatter prints both.
"""

from __future__ import annotations

import os
import time
from typing import Any, Self

import msgspec

from hicached import protocol as P
from hicached.errors import ConfigError
from hicached.ops.adminctl import AdminError
from hicached.sockpath import refusal

TIERS = {"l2": "L2", "l3": "L3", "all": "L2 and L3"}
PROBE_S = 1.0  # longest wait for the ZeroMQ handshake before a call (``SocketAdmin._probe``)
ADMIN_NS = "hicached-admin"  # the namespace of the session this CLI opens (with a client token)


class SocketAdmin:
    """Blocking admin calls to the daemon listening on ``endpoint`` (one request at a time)."""

    def __init__(self, endpoint: str, token: str = "", timeout_s: float = 30.0):
        import zmq  # here: the HTTP path of the CLI runs on the standard library alone

        self.where = endpoint
        self.timeout_s = timeout_s
        self._token = token  # never printed
        if endpoint.startswith("ipc://"):
            why = refusal(endpoint[len("ipc://"):])
            if why is not None:
                raise AdminError(f"no hicached daemon listens on {endpoint} ({why}): start one "
                                 "with `hicached serve`, or say where it is with --endpoint "
                                 "ipc://PATH or --url http://HOST:PORT")
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        monitor = self._sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | _handshake_failed(zmq))
        try:
            try:
                self._sock.connect(endpoint)
            except zmq.ZMQError as e:
                raise ConfigError(f"endpoint: cannot connect to {endpoint!r}: {e}") from None
            self._probe(monitor, min(PROBE_S, timeout_s))
        except BaseException:
            self._sock.disable_monitor()
            monitor.close(linger=0)
            self._sock.close(linger=0)
            self._ctx.term()
            raise
        self._sock.disable_monitor()
        monitor.close(linger=0)
        self._req = 0
        self._session = 0
        self._flush_namespace = False  # the daemon reads Flush.namespace (its Welcome says)

    def _probe(self, monitor, deadline_s: float) -> None:
        """Wait (at most ``deadline_s``) for the ZeroMQ handshake with whatever listens at the
        endpoint; AdminError naming which of the three it is when there is none: nothing
        listens (refused), nothing answers the connection (no such host, a firewall), or a
        peer accepts it but never completes the handshake (a stopped daemon, not a ZeroMQ
        server). The handshake is answered by the daemon's ZeroMQ I/O thread, not its control
        loop, so a busy daemon passes it at once and only its answer to the call is late."""
        from zmq.utils.monitor import recv_monitor_message

        zmq = self._zmq
        connected = False
        deadline = time.monotonic() + deadline_s
        while (left := deadline - time.monotonic()) > 0 and monitor.poll(
                max(1, int(left * 1000))):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            if event == zmq.EVENT_CONNECTED:
                connected = True
            elif event == zmq.EVENT_CONNECT_RETRIED and not connected:
                raise AdminError(f"nothing listens on {self.where} (connection refused): no "
                                 "hicached daemon there; start one with `hicached serve`, or "
                                 "say where it is with --endpoint or --url")
            elif event & _handshake_failed(zmq):
                raise AdminError(f"something at {self.where} accepts connections but fails "
                                 "the ZeroMQ handshake: not a hicached daemon")
        if connected:
            raise AdminError(f"something accepts connections on {self.where} but does not "
                             f"complete a ZeroMQ handshake within {deadline_s:g} s: a stopped "
                             "daemon, or not a hicached daemon")
        raise AdminError(f"nothing answers on {self.where} within {deadline_s:g} s (no such "
                         "host, or a firewall drops the connection): no hicached daemon "
                         "reached there")

    def close(self) -> None:
        if self._session:
            try:
                self._sock.send(P.encode(P.Bye(self._next(), self._session)), self._zmq.NOBLOCK)
            except self._zmq.ZMQError:
                pass
        self._sock.close(linger=100)
        self._ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _next(self) -> int:
        self._req += 1
        return self._req

    def call(self, make, what: str, timeout_s: float | None = None) -> Any:
        """Send ``make(req_id)`` and return its answer; ``AdminError`` for an ``Error`` answer or
        none within the deadline."""
        if self._token and not self._session:
            self._handshake()
        req = self._next()
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        self._sock.send(P.encode(make(req)))
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
                raise AdminError(f"no answer from the hicached daemon on {self.where} within "
                                 f"{timeout_s:g} s: it may still be working on {what} (see its "
                                 "log; raise --timeout)")
            try:
                answer = P.answer_decoder.decode(self._sock.recv())
            except msgspec.DecodeError as e:
                raise AdminError(f"the daemon on {self.where} answered {what} with something "
                                 f"this hicached cannot read ({e}): is it another version?"
                                 ) from None
            if answer.req_id == req:
                break  # (an earlier request's late answer is dropped)
        if isinstance(answer, P.Error):
            hint = (" (set HICACHED_CLIENT_TOKEN to the daemon's client_token)"
                    if answer.code == "unauthorized" else "")
            raise AdminError(f"{answer.message}{hint}", body={"code": answer.code})
        return answer

    def _handshake(self) -> None:
        from hicached.liveness import own_pid_ns, own_start_ticks

        welcome = None
        token, self._token = self._token, ""  # (call() must not handshake again)
        try:
            welcome = self.call(lambda r: P.Hello(r, P.PROTOCOL_VERSION, ADMIN_NS,
                                                  os.getpid(), "hicached-cli", token,
                                                  own_start_ticks(), own_pid_ns()), "Hello")
        finally:
            self._token = token
        self._session = welcome.session
        self._flush_namespace = welcome.flush_namespace

    # ------------------------------------------------------------ the commands

    def status(self) -> tuple[dict, dict, dict | None]:
        view = self.call(lambda r: P.GetStats(r, "status"), "status").stats
        if not {"health", "ready", "stats"} <= set(view):  # a daemon from before the view
            raise AdminError(f"the daemon on {self.where} predates `hicached status` over its "
                             "socket: restart it with this hicached, or use --url with its "
                             "admin_port")
        stats = view["stats"]
        return view["health"], view["ready"], without_own_session(stats) if self._session else stats

    def backend(self) -> dict:
        return self.call(lambda r: P.GetBackend(r), "the L3 status").status

    def flush(self, tier: str, timeout_s: float, namespace: str = "") -> dict:
        if namespace:  # an older daemon would read past the namespace: ask first
            if not self._session:
                self._handshake()
            if not self._flush_namespace:
                raise AdminError(f"the daemon on {self.where} is older than --namespace (it "
                                 "would flush the whole node): nothing was flushed")
        if tier in ("l3", "all") and not self.backend()["attached"]:
            if tier == "l3":
                raise AdminError("no L3 backend attached: nothing to clear")
            tier = "l2"
        of = f" of namespace {namespace!r}" if namespace else ""
        self.call(lambda r: P.Flush(r, tier, namespace), f"a flush of {TIERS[tier]}{of}",
                  timeout_s)
        return {"success": True, "tier": tier, **({"namespace": namespace} if namespace else {}),
                "message": f"Cache flushed: {TIERS[tier]}{of}."}

    def attach(self, backend: str, options: dict, write_policy: str | None,
               prefetch_policy: str | None, timeout_s: float) -> dict:
        if prefetch_policy:  # bad usage on this path (exit status 2), not a daemon's error
            raise ConfigError("--prefetch-policy is an engine-side setting the admin HTTP API "
                             "records for SGLang's tools; over the socket there is nothing to "
                             "record it in (use --url, or leave it out)")
        status = self.call(lambda r: P.Attach(r, backend, options, write_policy or ""),
                           f"attaching {backend}", timeout_s).status
        return {"success": True, "message": "HiCache storage backend attached.", **status}

    def detach(self, timeout_s: float) -> dict:
        status = dict(self.call(lambda r: P.Detach(r), "a detach", timeout_s).status)
        message = ("HiCache storage backend detached." if status.pop("detached", False)
                   else "No HiCache storage backend was attached.")
        if status.get("dirty_dropped"):
            message += (f" {status['dirty_dropped']} write-back pages it could not take in time "
                        "stay in L2 only.")
        return {"success": True, "message": message, **status}

    def l3_pages_left(self) -> str:
        return ""  # one request at a time on this socket: the progress line shows the time only


def _handshake_failed(zmq) -> int:
    """The monitor events of a failed ZeroMQ handshake."""
    return (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def without_own_session(stats: dict) -> dict:
    """``stats`` (the admin API's ``/stats`` body) without the session this CLI opened to ask
    for it: a daemon with a ``client_token`` wants a handshake first, and the CLI is no client.
    Its namespace (``ADMIN_NS``) goes too where nothing else is in it."""
    out = {**stats, "sessions": max(0, stats["sessions"] - 1), "namespaces": []}
    for n in stats.get("namespaces", []):
        if n["namespace"] == ADMIN_NS:
            n = {**n, "sessions": max(0, n["sessions"] - 1)}
            if not (n["sessions"] or n["used_bytes"] or n.get("quota_bytes") is not None):
                continue
        out["namespaces"].append(n)
    return out
