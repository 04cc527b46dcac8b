"""The client's daemon-wide calls: stats, flush, ping and runtime L3 attach / detach.

Each is one round trip on the connection (``connection.py``), with a deadline.
"""

from __future__ import annotations

from hicached import protocol as P
from hicached.client.connection import Connection
from hicached.client.overlap import PageRecall
from hicached.errors import InvalidArgument, VersionMismatch


class ClientAdmin:
    """Calls about the daemon as a whole rather than this client's pages (of ``Client``).

    Owns nothing; mutates nothing of the client but ``recall``, cleared by an L2 flush (the
    pages left their slots). Each call blocks for one round trip."""

    def __init__(self, conn: Connection, recall: PageRecall):
        self._conn = conn
        self._recall = recall

    def stats(self) -> dict:
        return self._conn.call(lambda s, r: P.GetStats(r)).stats

    def flush(self, tier: str = "l2", timeout_s: float = 600.0, *,
              namespace: str | None = None) -> None:
        """Drop unpinned L2 pages (``l2``), every L3 page (``l3``) or both (``all``); waits for
        the end (a large L2 or store takes a while: hence the long default deadline).

        ``namespace``: only that namespace's pages (``client.namespace``: this client's own),
        in L2 and in L3 where the backend can find them by namespace (file, Mooncake; another
        one raises ``BackendError`` and nothing is dropped); None: every page of the node,
        whoever stored it. A daemon older than namespace flushes would flush the whole node:
        ``VersionMismatch`` instead, and nothing is sent."""
        if namespace is not None:
            if not isinstance(namespace, str) or not namespace:
                raise InvalidArgument(f"namespace must be None (the whole node) or a non-empty "
                                      f"str, got {namespace!r}")
            if not self._conn.flushes_namespaces:
                raise VersionMismatch(f"hicached at {self._conn.endpoint} is older than namespace "
                                      f"flushes: it would flush the whole node (nothing was "
                                      f"flushed; upgrade it, or flush with namespace=None)")
        self._conn.call(lambda s, r: P.Flush(r, tier, namespace or ""), timeout_s)
        if tier in ("l2", "all"):
            self._recall.clear()  # the pages left their slots: no guess is worth copying

    def ping(self) -> None:
        self._conn.call(lambda s, r: P.Ping(r))

    def attach_backend(self, backend: str, options: dict | None = None, *,
                       write_policy: str | None = None, prefetch: bool | None = None,
                       timeout_s: float = 120.0) -> dict:
        """Attach an L3 backend to the daemon at runtime; returns the tier status. Attaching
        the attached backend only updates the policies; another one raises BackendConflict."""
        return self._conn.call(lambda s, r: P.Attach(r, backend, dict(options or {}),
                                                write_policy or "", prefetch), timeout_s).status

    def detach_backend(self) -> dict:
        """Detach the daemon's L3 backend (idempotent); returns the tier status."""
        return self._conn.call(lambda s, r: P.Detach(r)).status

    def backend_status(self) -> dict:
        return self._conn.call(lambda s, r: P.GetBackend(r)).status
