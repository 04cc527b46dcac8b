"""The daemon's side of a client's handshake (``Hello`` -> ``Welcome``): version and token, which
process the client is (``liveness.py``), the session it replaces, its word in the presence table.

``Handshakes`` owns nothing but the daemon's pid namespace (read once); per ``Hello`` it checks
the token (``auth``), opens the session and closes the one it replaces (``sessions``: the
``SessionControl``), binds the socket identity to it (``auth``) and takes the session's word in
the presence table. It reads the config, the arena's path and size and the index's seed.
Control loop only."""

from __future__ import annotations

import logging
import os

import zmq

from hicached import protocol as P
from hicached.errors import VersionMismatch
from hicached.liveness import identify, own_pid_ns, peer_pid

log = logging.getLogger("hicached.daemon.server")


class Handshakes:
    """``hello``: answer a ``Hello`` (see the module docstring)."""

    def __init__(self, config, sessions, auth, arena, presence, index) -> None:
        self.config = config
        self.sessions = sessions  # SessionControl: open_session, close_session, sessions
        self.auth = auth
        self.arena = arena
        self.presence = presence  # PresenceTable or None
        self.index = index
        self.pid_ns = own_pid_ns()  # clients in it may be checked by the pid they state

    def _peer(self, frame: zmq.Frame) -> int:
        """The pid of the process that sent ``frame``, in this daemon's pid namespace, from the
        socket's credentials (ipc only; 0: not known)."""
        if not self.config.endpoint.startswith("ipc://"):
            return 0
        try:
            return peer_pid(frame.get("Peer-Address"))
        except zmq.ZMQError:
            return 0

    def hello(self, identity: bytes, msg: P.Hello, frame: zmq.Frame) -> P.Welcome:
        """The ``Welcome`` of a new session (``VersionMismatch``, ``Unauthorized``,
        ``ProtocolError`` raised for a hello refused)."""
        c = self.sessions
        if msg.version != P.PROTOCOL_VERSION:
            raise VersionMismatch(
                f"client speaks protocol {msg.version}, daemon {P.PROTOCOL_VERSION}")
        self.auth.check_hello(identity, msg)
        process = identify(self._peer(frame), msg.pid, msg.start_ticks, msg.pid_ns,
                           self.pid_ns)
        old = c.get(msg.replaces) if msg.replaces else None
        if old is not None and old.namespace != msg.namespace:
            old = None  # only the client's own session (same namespace) is replaced
        if old is not None:
            c.close_session(old.id, "replaced")
        s = c.open_session(msg, process)
        self.auth.bind(identity, s.id)
        log.info("session %d: pid %d %r namespace %r", s.id, s.pid, s.name, s.namespace)
        if old is not None:
            log.info("session %d replaces session %d", s.id, old.id)
        if process.how == "none":
            log.warning("session %d (pid %d as the client sees it): its process can not be "
                        "checked from here (another pid namespace, over tcp); should the "
                        "client die, its session ends after unchecked_idle_s (%.0fs) without "
                        "a request; its reservations and leases still expire", s.id, s.pid,
                        self.config.unchecked_idle_s)
        elif process.pid != msg.pid:
            log.info("session %d: pid %d in this daemon's pid namespace", s.id, process.pid)
        t = self.presence
        if t is not None:
            s.presence_word = t.take_session()
        return P.Welcome(msg.req_id, s.id, self.arena.path, self.arena.size_bytes, os.getpid(),
                         self.config.reservation_ttl_s, self.config.lease_ttl_s, *(
                             (t.path, t.slots, t.epoch, self.index.seed(s.ns), s.presence_word)
                             if t is not None else ()), flush_namespace=True)
