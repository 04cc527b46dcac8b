"""Client tokens: who may talk to the daemon's control socket.

Without ``client_token`` (``OpenAccess``) the socket's file mode is the access control: the ipc
socket and the arena are 0600 (0660 with ``socket_group``), so only the daemon's user (group)
can connect and map pages. With a token (``TokenAuth``) every connection must first complete a
``Hello`` carrying it; the daemon then remembers the connection's ZeroMQ routing id:

    Hello(token)           right token -> session bound to this connection; wrong -> Unauthorized
    request of a session   only from the connection that opened the session, else UnknownSession
                           (a client that reconnected just handshakes again, transparently)
    request w/o a session  (Ping, GetStats, Flush, Attach, ...) only from an authorized
                           connection, else Unauthorized

Routing ids the daemon's ROUTER generates start with a zero byte, which a peer is not allowed to
choose for itself, so a bound connection cannot be impersonated. The token is never logged.
"""

from __future__ import annotations

import hmac

from hicached import protocol as P
from hicached.errors import Unauthorized, UnknownSession


class OpenAccess:
    """No client token configured: every request is admitted."""

    def check_hello(self, identity: bytes, hello: P.Hello) -> None:
        pass

    def bind(self, identity: bytes, session: int) -> None:
        pass

    def admit(self, identity: bytes, msg) -> None:
        pass

    def prune(self, live_sessions) -> None:
        pass


class TokenAuth(OpenAccess):
    """See the module docstring. Only the control loop calls it."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("TokenAuth needs a non-empty token")
        self._token = token.encode()
        self._session_of: dict[int, bytes] = {}  # session id -> routing id that opened it
        self._authorized: dict[bytes, int] = {}  # routing id -> sessions it opened
        self.refused = 0

    def check_hello(self, identity: bytes, hello: P.Hello) -> None:
        if not hmac.compare_digest(hello.token.encode(), self._token):
            self.refused += 1
            what = "a wrong" if hello.token else "no"
            raise Unauthorized(f"handshake with {what} client token; this daemon requires its "
                               "client_token (Client(..., token=...))")

    def bind(self, identity: bytes, session: int) -> None:
        self._session_of[session] = identity
        self._authorized[identity] = self._authorized.get(identity, 0) + 1

    def admit(self, identity: bytes, msg) -> None:
        if isinstance(msg, P.Hello):
            return
        session = getattr(msg, "session", None)
        if session is not None:
            if self._session_of.get(session) != identity:
                raise UnknownSession(f"session {session} was not opened on this connection; "
                                     "handshake again")
        elif identity not in self._authorized:
            self.refused += 1
            raise Unauthorized(f"{type(msg).__name__} on a connection without an authorized "
                               "handshake (client token required)")

    def prune(self, live_sessions) -> None:
        """Forget sessions that ended (and connections left without any)."""
        for sid in [s for s in self._session_of if s not in live_sessions]:
            identity = self._session_of.pop(sid)
            n = self._authorized.get(identity, 0) - 1
            if n > 0:
                self._authorized[identity] = n
            else:
                self._authorized.pop(identity, None)


def make_auth(token: str) -> OpenAccess:
    return TokenAuth(token) if token else OpenAccess()
