"""A client's exists answered from the daemon's shared presence table (``presence.py``).

``Client.batch_exists_v2`` asks ``SharedExists.answer`` first and goes through the socket only
when it returns None. The answer is the daemon's own (``Controller._exists_answer``), computed
from the same per-key pool bitmasks with the same functions (``hits.py``), when:

    the table is usable              (``PresenceView.usable``: fresh heartbeat, not full, ...;
                                     x86 only: ``presence.ORDERED_STORES``)
    every pool asked is registered   (the daemon answers an unregistered one with its typed error)
    no L3 is attached, or L2 alone restores every key asked (else only the daemon can ask L3,
                                     and start pulling pages in; after such a call the next
                                     1, 2, 4 ... 64 go to the daemon straight away, so a
                                     workload L2 alone never answers pays ~nothing). A
                                     trailing pool (Mamba) may have holes: L3 could then add
                                     endpoints below the last to ``restorable`` only, never
                                     raise a hit, so the table answers with L2's endpoints
    this client's own commits were all read by the daemon (``Client`` checks: read your writes)

Calls answered here are counted and reported to the daemon at most every ``TALLY_EVERY_S`` (and at
close) in one ``ExistsTally``, so its exists metrics still count every call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from hicached import protocol as P
from hicached.errors import ArenaError
from hicached.hits import intersect_endpoints_array, leading_run_array
from hicached.presence import F_L3, ORDERED_STORES, PresenceView

log = logging.getLogger(__name__)

TALLY_EVERY_S = 1.0
MAX_SKIP = 64  # with L3 attached, calls left to the daemon at most after L2 alone could not answer
LOOKUP_TRIES = 3  # reads of the table before a slot changing under them sends the call to the
# daemon (it changes while the daemon commits, or evicts ahead in its idle turns: a moment)


class SharedExists:
    """Exists answers from a ``PresenceView``; ``bits``: pool name -> its bit (``Registered``),
    learnt through ``learn_bit``."""

    def __init__(self, view: PresenceView):
        self.view = view
        self.bits: dict[str, int] = {}
        self._calls = 0
        self._keys: dict[str, int] = {}
        self._hits: dict[str, int] = {}
        self._tallied = time.monotonic()
        self._count_lock = threading.Lock()  # calls from several threads count them all
        self._skip, self._backoff = 0, 1  # calls to leave to the daemon, and the next such run

    def learn_bit(self, pool: str, bit: int) -> None:
        """Pool ``pool`` is marked by ``bit`` in the table (the daemon's ``Registered``)."""
        self.bits[pool] = bit

    @classmethod
    def open(cls, welcome: P.Welcome) -> SharedExists | None:
        """The table the daemon announced, or None (none announced, or it cannot be mapped
        here: a client in another container, a tcp:// endpoint)."""
        if not welcome.presence_path or not ORDERED_STORES:
            return None
        try:
            return cls(PresenceView(welcome.presence_path, welcome.presence_slots,
                                    welcome.presence_epoch, welcome.presence_seed,
                                    welcome.presence_session))
        except (ArenaError, OSError, ValueError) as e:
            log.info("presence table not usable (%s): exists goes through the socket", e)
            return None

    def answer(self, keys: Sequence[str], anchor: str, queries: Sequence[P.PoolQuery]
               ) -> tuple[int, dict[str, int], list[int]] | None:
        """(kv_hit_pages, per-pool hits, restorable endpoints) as the daemon would answer, or
        None: ask the daemon."""
        flags = self.view.usable()
        if flags is None:
            return None
        if flags & F_L3 and self._skip:
            self._skip -= 1  # lately L2 alone could not answer: do not hash for nothing
            return None
        bits = self.bits
        anchor_bit = bits.get(anchor, 0)
        pool_bits = [bits.get(q.pool, 0) for q in queries]
        if not anchor_bit or not all(pool_bits):
            return None
        for _ in range(LOOKUP_TRIES):
            masks = self.view.lookup(keys)
            if masks is not None:
                break
        else:
            return None
        kv_pages = leading_run_array((masks & anchor_bit) != 0)
        head = masks[:kv_pages]
        try:
            final, hits, restorable = intersect_endpoints_array(
                kv_pages, [(q.pool, q.policy, q.window, (head & bit) != 0)
                           for q, bit in zip(queries, pool_bits, strict=True)])
        except ValueError:
            return None  # an unknown hit policy: the daemon's typed error
        if flags & F_L3:
            if final < len(keys):
                # L3 may hold what L2 lacks: the daemon asks it (and prefetches). Skip the table
                # for the next 1, 2, 4 ... MAX_SKIP calls while that keeps happening.
                self._skip = self._backoff
                self._backoff = min(2 * self._backoff, MAX_SKIP)
                return None
            # L2 alone restores every key: L3 cannot raise any hit, and nothing needs pulling
            # in. Only endpoints a trailing pool has holes at in L2 but not in L3 can be missing
            # from ``restorable`` (a subset of the daemon's: same largest, kv_hit_pages).
            self._backoff = 1
        if kv_pages:
            hits[anchor] = kv_pages
        self._count(anchor, len(keys), hits)
        return final, hits, restorable

    def _count(self, anchor: str, n: int, hits: dict[str, int]) -> None:
        with self._count_lock:
            self._calls += 1
            self._keys[anchor] = self._keys.get(anchor, 0) + n
            for pool, pages in hits.items():
                self._hits[pool] = self._hits.get(pool, 0) + pages

    def tally_due(self) -> bool:
        return bool(self._calls) and time.monotonic() - self._tallied >= TALLY_EVERY_S

    def tally(self, session: int) -> P.ExistsTally | None:
        """The counts since the last tally (None: nothing counted), to send now."""
        with self._count_lock:
            if not self._calls:
                return None
            msg = P.ExistsTally(0, session, self._calls, self._keys, self._hits)
            self._calls, self._keys, self._hits = 0, {}, {}
            self._tallied = time.monotonic()
        return msg

