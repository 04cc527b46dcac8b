"""The client's exists calls: from the daemon's shared presence table when it can answer alone
(``table_exists.py``), else one round trip on the connection (``connection.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicached import protocol as P
from hicached.client.connection import Connection
from hicached.types import PoolName, PoolTransferResult, key_list, policy_value, pool_value

KV = PoolName.KV.value  # the anchor pool of every exists


class ExistsCalls:
    """``batch_exists`` (v1) and ``batch_exists_v2`` of ``Client``.

    Owns nothing but ``shared_exists`` (whether to answer from the presence table). Reads the
    connection's table and commit counters; may send the table's hit tally (``send_only``,
    only when the connection's lock is free). Never blocks on another thread's request."""

    def __init__(self, conn: Connection, shared_exists: bool):
        self._conn = conn
        self.shared_exists = shared_exists  # answer exists from the presence table

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """Number of leading keys whose KV page is stored (L2 or L3)."""
        keys = key_list(keys)
        shared = self._exists_shared(keys, ())
        if shared is not None:
            return shared[0]
        return self._conn.call(lambda s, r: P.Exists(r, s, keys)).kv_hit_pages

    def batch_exists_v2(self, keys: Sequence[str], pool_transfers: Sequence[Any] | None = None,
                        extra_info: Any = None) -> PoolTransferResult:
        """Largest prefix every pool can restore (ARCHITECTURE.md hit semantics)."""
        keys = key_list(keys)
        queries = []
        for t in pool_transfers or ():
            name = pool_value(t.name)
            window = len(key_list(t.keys or (), f"pool {name!r}: keys"))
            if name == KV:
                continue
            queries.append(P.PoolQuery(name, policy_value(t.hit_policy), max(1, window)))
        shared = self._exists_shared(keys, queries)
        if shared is not None:
            return PoolTransferResult(*shared)
        a = self._conn.call(lambda s, r: P.Exists(r, s, keys, queries))
        return PoolTransferResult(a.kv_hit_pages, dict(a.pool_hits), list(a.restorable))

    def _exists_shared(self, keys: list[str], queries: Sequence[P.PoolQuery]):
        """The answer from the presence table, or None. A client reads its own writes: not
        before the daemon read every commit this client sent without awaiting it (its session
        word in the table says so; else a request on the socket is read after them)."""
        conn = self._conn
        shared = conn.shared
        sent, known = conn.commits
        if (shared is None or conn.closed or not self.shared_exists
                or (sent != known and not shared.view.read_up_to(sent))):
            return None
        answer = shared.answer(keys, KV, queries)
        # the counts go out about once a second, never waiting for another thread's request
        if shared.tally_due() and conn.lock.acquire(blocking=False):
            try:
                tally = shared.tally(conn.session)
                if tally is not None:
                    conn.send_only(tally)
            finally:
                conn.lock.release()
        return answer
