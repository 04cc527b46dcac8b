"""The daemon's sessions: opened at a handshake, ended by a Bye, a new handshake, the death of
the client's process (``liveness.py``) or, for a process the daemon cannot check, idleness.

``SessionControl`` owns the sessions (id -> ``Session``; it reads as a mapping: ``get``, ``in``,
``len``, ``values``) and the names of the namespaces they named. Ending a session drops its
reservations and leases (``leases``) and frees its word in the presence table (the index's
``shared`` table). It reads the index's bytes per namespace. Control loop only."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

from hicached import protocol as P
from hicached.daemon.sessions import Session, namespace_digest
from hicached.errors import ProtocolError
from hicached.liveness import ProcessRef, alive

log = logging.getLogger("hicached.daemon.controller")

MAX_NAMED = 4096  # namespace names kept for /stats beyond those holding pages or clients


class SessionControl:
    """``open_session``, ``close_session``, ``reap_dead_sessions``, ``reap_idle_unchecked`` (see
    the module docstring)."""

    def __init__(self, index, leases, clock: Callable[[], float]) -> None:
        self.index = index
        self.leases = leases
        self.clock = clock
        self.sessions: dict[int, Session] = {}
        self.ns_names: dict[str, str] = {}  # namespace digest -> name (``_remember_namespace``)
        # ``get(sid)``: the session, or None (the dict's own method: every request asks)
        self.get: Callable[[int], Session | None] = self.sessions.get

    def __contains__(self, sid: int) -> bool:
        return sid in self.sessions

    def __len__(self) -> int:
        return len(self.sessions)

    def values(self):
        return self.sessions.values()

    def __setitem__(self, sid: int, s: Session) -> None:
        """Keep a session made elsewhere (tests and tools that drive a controller directly)."""
        self.sessions[sid] = s

    def open_session(self, hello: P.Hello, process: ProcessRef | None = None) -> Session:
        """A new session for ``hello``; ``process``: how to tell the client died
        (``liveness.identify``; None: never reaped)."""
        if not hello.namespace:
            raise ProtocolError("namespace must be a non-empty string")
        sid = secrets.randbits(62)  # never one an earlier daemon gave: a stale client must not
        while sid in self.sessions or not sid:  # act in another client's session after a restart
            sid = secrets.randbits(62)
        s = Session(sid, hello.namespace, namespace_digest(hello.namespace),
                    hello.pid, hello.client_name, process=process)
        self.sessions[s.id] = s
        self._remember_namespace(s.ns, s.namespace)
        return s

    def _remember_namespace(self, digest: str, name: str) -> None:
        """The index knows namespaces by digest; ``/stats`` names them. Bounded: past
        ``MAX_NAMED`` names, those holding no L2 bytes and no session are forgotten."""
        names = self.ns_names
        names[digest] = name
        if len(names) > MAX_NAMED:
            live = {s.ns for s in self.sessions.values()}
            for d in [d for d in names if d not in live and not self.index.ns_bytes.get(d)]:
                del names[d]

    def close_session(self, sid: int, how: str = "bye") -> None:
        """End session ``sid``: its process is ``dead``, it said ``bye``, or a new handshake of
        the same client ``replaced`` it (its other threads may still be copying: slots they
        may write are fenced, leases they may read run to their TTL; ``leases.py``)."""
        s = self.sessions.pop(sid, None)
        if s is not None:
            self.leases.drop_session(sid, None if how == "dead" else self.clock(),
                                     keep_leases=how == "replaced", process=s.process)
            if self.index.shared is not None:
                self.index.shared.free_session(s.presence_word)

    def reap_dead_sessions(self) -> int:
        """Drop sessions whose client process is gone (``liveness.alive``: the pid the kernel
        gave for the socket, and the process's start time); returns how many."""
        dead = [s for s in self.sessions.values()
                if s.process is not None and not alive(s.process)]
        for s in dead:
            log.info("client pid %d (%s) is gone: releasing its reservations and leases",
                     s.process.pid, s.name or "unnamed")
            self.close_session(s.id, "dead")
        return len(dead)

    def reap_idle_unchecked(self, now: float, idle_s: float) -> int:
        """End the sessions of clients the daemon cannot check (``Session.checked``) that sent
        no request for ``idle_s``: one that died would otherwise be kept until the daemon
        restarts. One that lives joins again at its next request (``UnknownSession``)."""
        idle = []
        for s in self.sessions.values():
            if s.checked:
                continue
            if s.active:
                s.active, s.idle_since = False, now
            elif now - s.idle_since >= idle_s:
                idle.append(s)
        for s in idle:
            log.info("session %d (%s, pid %d as it states) sent nothing for %.0fs and its "
                     "process cannot be checked: ended", s.id, s.name or "unnamed", s.pid,
                     now - s.idle_since)
            self.close_session(s.id, "bye")
        return len(idle)
