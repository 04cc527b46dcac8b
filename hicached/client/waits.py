"""The client's waits for visibility: until the daemon has read this client's commits
(``wait_committed``: its other clients see the pages), and until named pages are in L3
(``wait_stored``: clients of every daemon sharing the store see them).

Why two: a commit goes without an answer (``batch_set_v2`` saves the round trip), ordered only
on this client's own socket. Another client of the same daemon sees the pages once the daemon
has read the commit; a client of another daemon (the PD decode on another node) only once they
are in the shared L3, which no write policy promises at any given time.

The commit counters they read are the connection's (``Connection.sync_commits``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicached import protocol as P
from hicached.client.connection import Connection
from hicached.errors import InvalidTransfer, ProtocolError
from hicached.types import key_list, pool_value


class WaitCalls:
    """``wait_committed`` and ``wait_stored`` of ``Client``.

    Owns nothing; mutates nothing but the connection's known-commit counter. Both block, up to
    their deadline, for one round trip (``wait_committed``: none when the presence table
    already acknowledges the commits)."""

    def __init__(self, conn: Connection):
        self._conn = conn

    def wait_committed(self, timeout_s: float | None = None) -> None:
        """Block until the daemon has read every commit this client sent (``batch_set_v2``
        sends its ``Commit`` without waiting): their pages are then published, visible to every
        client of the daemon (or aborted where the copy failed, as its answer said). No round
        trip when the presence table already acknowledges them, else one ``Ping``: the daemon
        reads a socket in order. Raises ``DaemonUnavailable`` when the daemon does not answer
        within ``timeout_s`` (default: the client's), or when the last commit may be lost
        (its socket was dropped before the daemon was known to have read it)."""
        self._conn.sync_commits(timeout_s)

    def wait_stored(self, transfers: Sequence[Any], timeout_s: float | None = None) -> None:
        """Block until the named pages are stored in the daemon's L3, so that every daemon
        sharing that store (another node's) can load them: ``transfers`` as for
        ``batch_get_v2`` (each a ``PoolTransfer``; only its pool ``name`` and ``keys``
        matter: KV, Mamba, indexer, any registered pool of the namespace).

        Whatever the daemon's write policy: committed pages L3 lacks are written now (under
        ``write_back`` and the selective policy too), writes in flight are waited for, pages
        L2 no longer holds are looked up in the store. This client's own earlier commits are
        read first (one socket), so ``batch_set_v2`` then ``wait_stored`` needs no
        ``wait_committed`` between them. Returns at once when no key is named.

        Raises ``NoL3`` when the daemon has no L3 backend (at once), ``NotStored`` when a page
        cannot be stored (its write failed; it is in neither L2 nor L3), ``StoreTimeout`` (a
        ``NotStored``) when they are not stored within ``timeout_s`` (default: the client's;
        the daemon answers at that deadline), ``DaemonUnavailable`` when the daemon does not
        answer, ``ProtocolError`` when it is older than this call."""
        wanted = []
        for t in transfers:
            name = pool_value(t.name)
            keys = key_list(getattr(t, "keys", None) or (), f"pool {name!r}: keys")
            if not all(type(k) is str for k in keys):
                raise InvalidTransfer(f"pool {name!r}: keys must be str")
            if keys:
                wanted.append(P.PoolKeys(name, keys))
        if not wanted:
            return
        conn = self._conn
        wait_s = conn.timeout_s if timeout_s is None else timeout_s
        if not 0 < wait_s <= 3600:
            raise InvalidTransfer(f"wait_stored: timeout_s must be in (0, 3600], got {wait_s}")
        try:  # the daemon answers at its deadline: give the answer the client's own to arrive
            conn.call(lambda s, r: P.WaitStored(r, s, wanted, wait_s), wait_s + conn.timeout_s)
        except ProtocolError as e:
            if "wait_stored" not in str(e):
                raise
            raise ProtocolError(f"hicached at {conn.endpoint} does not know WaitStored (a "
                                f"daemon older than this client?): {e}") from None
