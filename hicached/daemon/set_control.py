"""The controller's set path: step 2, ``reserve`` (slots for every pool of a Reserve, or
"present" / "in flight" / "no space"), and step 4, ``commit`` (all pools' pages of the call
published at once, then handed to L3). A mixin of ``controller.Controller`` (its index, leases,
tier, quotas, counters and clock).

A Reserve's new keys (neither in L2 nor pending, no set-ahead slot named) are reserved a run at
a time (``PageIndex.reserve_many``: one numpy pass for the pages that get a slot without
eviction); the keys between runs (present, in flight, bound to a set-ahead slot) are answered
one by one where they come, so the state is exactly that of answering every key in turn.
"""

from __future__ import annotations

from hicached import protocol as P
from hicached.daemon.index import Entry
from hicached.daemon.leases import Reservation
from hicached.daemon.sessions import PoolSpec, Session
from hicached.errors import InvalidTransfer, ProtocolError


def _now(fn, *args) -> None:
    """``fn(*args)`` now (``Controller.later``'s twin for what may not wait)."""
    fn(*args)


class SetControl:
    """``reserve``, ``commit``."""

    def reserve(self, s: Session, msg: P.Reserve) -> P.Reserved:
        specs = [s.spec(t.pool) for t in msg.transfers]
        for t in msg.transfers:
            if t.keys and max(map(len, t.keys)) > P.MAX_KEY_LEN:
                raise InvalidTransfer(f"pool {t.pool!r}: a key is longer than "
                                      f"{P.MAX_KEY_LEN} characters; nothing was stored")
        chain = self._chain(msg)
        named = [off for row in msg.ahead for off in row if off >= 0]
        if len(named) != len(set(named)):  # two pages copied into one slot: neither is intact
            raise ProtocolError("Reserve.ahead names a set-ahead slot twice")
        now = self.clock()
        r = self.leases.new_reservation(s.id, now)
        ahead = self.leases.ahead_of(s.id, now) if msg.want_ahead or msg.ahead else None
        offsets, tags, bound, present = [], [], [], []
        for name in msg.trailing:  # states (a name not of the call says nothing)
            if any(t.pool == name for t in msg.transfers):
                self.index.mark_trailing((s.ns, name))
        # the call's parent stays while its pages are reserved (it is about to be extended:
        # the policy must not make room with it, which would orphan the call at birth)
        guard = self.index.key_pages(s.ns, msg.parent) if chain is not None and msg.parent else []
        self.index.pin_many(guard)
        try:
            for p, (t, spec) in enumerate(zip(msg.transfers, specs)):
                claims = msg.ahead[p] if ahead is not None and p < len(msg.ahead) else ()
                row, tag_row, bound_row = self._reserve_transfer(s, r, p, t, spec, claims, ahead,
                                                                 present)
                offsets.append(row)
                tags.append(tag_row)
                bound.append(bound_row)
        finally:
            self.index.unpin_many(guard)
        # the links, L3's share and write-back's relief are kept after the answer when nothing
        # else of the call comes after them (set-ahead slots, granted below, may evict)
        after = self.later if ahead is None else _now
        if chain is not None:  # after the loop: its pending keys are held now
            after(self.index.link, s.ns, chain.keys, msg.parent or None, msg.depth)
        if present:
            after(self.tier.on_present, present)
        if self.tier.dirty:  # write_back: make dirty pages evictable before the arena fills
            after(self._relieve, any(P.SLOT_NO_SPACE in row for row in offsets))
        granted = self._grant_ahead(s, ahead, msg, specs) if ahead is not None else []
        if not any(map(any, bound)):
            bound = []
        if not r.slots:
            self.leases.take_reservation(r.id, s.id)
            return P.Reserved(msg.req_id, 0, offsets, tags, granted, bound)
        return P.Reserved(msg.req_id, r.id, offsets, tags, granted, bound)

    def _relieve(self, force: bool) -> None:
        self.tier.relieve_pressure(force=force)

    def _reserve_transfer(self, s: Session, r: Reservation, p: int, t: P.PoolKeys,
                          spec: PoolSpec, claims, ahead, present: list[Entry]
                          ) -> tuple[list[int], list[int], list[bool]]:
        """Transfer ``p`` of a Reserve: per key its slot offset (or ``SLOT_*``), tag, and
        whether it took a set-ahead slot. Runs of new keys go to ``_reserve_run`` together,
        each key between them to ``_reserve_key`` where it comes (see the module docstring)."""
        table, keys, index = (s.ns, t.pool), t.keys, self.index
        n = len(keys)
        row, tag_row, bound_row = [0] * n, [0] * n, [False] * n
        got, fps, recs = index.lookup(table, keys)
        known = fps is not None  # the lookup holds until a record comes or goes
        run: list[int] = []  # positions of new keys, reserved when the run ends
        in_run: set[str] = set()  # (a key twice: in flight once the run before it is reserved)
        for i, (key, e) in enumerate(zip(keys, got)):
            if (e is None and key not in in_run and (i >= len(claims) or claims[i] < 0)
                    and index.get_pending(table, key) is None):
                run.append(i)
                in_run.add(key)
                continue
            if run:
                self._reserve_run(s, r, p, table, spec, keys, run, row, tag_row,
                                  (fps, recs) if known else None)
                run, in_run, known = [], set(), False
            known &= not self._reserve_key(s, r, p, i, table, key, e, spec, claims, ahead,
                                           present, row, tag_row, bound_row)
        if run:
            self._reserve_run(s, r, p, table, spec, keys, run, row, tag_row,
                              (fps, recs) if known else None)
        return row, tag_row, bound_row

    def _reserve_run(self, s: Session, r: Reservation, p: int, table, spec: PoolSpec,
                     keys: list[str], run: list[int], row: list[int], tag_row: list[int],
                     looked_up: tuple | None) -> None:
        """Reserve the new keys at positions ``run`` of ``keys``: those the namespace's quota
        admits without evicting its own pages at once, the rest one by one. ``looked_up``:
        the transfer's (fps, recs) from ``PageIndex.lookup`` while they still hold."""
        admitted = self.quotas.admit_many(s.ns, spec.stride, len(run))
        fps = recs = None
        if looked_up is not None and admitted:
            at = run[:admitted]
            fps, recs = looked_up[0][at], looked_up[1][at]
        got = self.index.reserve_many(table, [keys[i] for i in run[:admitted]],
                                      spec.page_bytes, spec.stride, s.id, fps, recs)
        for i in run[admitted:]:
            got.append(self.index.reserve(table, keys[i], spec.page_bytes, spec.stride)
                       if self.quotas.admit(s.ns, spec.stride) else None)
            if got[-1] is not None:
                got[-1].owner = s.id
        slots = r.slots
        for i, e in zip(run, got):
            if e is None:
                self.counters["no_space"] += 1
                row[i] = P.SLOT_NO_SPACE
            else:
                slots.append((p, i, e))
                row[i] = e._offset  # (a pending page keeps its slot: it is pinned)
                tag_row[i] = e.gen

    def _reserve_key(self, s: Session, r: Reservation, p: int, i: int, table, key: str,
                     e: Entry | None, spec: PoolSpec, claims, ahead, present: list[Entry],
                     row: list[int], tag_row: list[int], bound_row: list[bool]) -> bool:
        """Key ``i`` of transfer ``p`` on its own (``e``: its committed page when the call
        began): present, in flight, bound to the set-ahead slot it names, or reserved;
        whether records may have come or gone (a bind, a reservation, an eviction)."""
        if e is not None and e.committed:  # (not evicted for an earlier key of the call)
            self.index.touch(e)
            row[i] = P.SLOT_PRESENT
            if not e.in_l3:
                present.append(e)
            return False
        if self.index.get_pending(table, key) is not None:
            row[i] = P.SLOT_INFLIGHT
            return False
        e = None
        if i < len(claims) and claims[i] >= 0:  # its page is already in that slot
            e = self.leases.take_ahead(ahead, table[1], claims[i])
            if e is not None:
                e = self.index.bind(e, table, key, spec.page_bytes)
                bound_row[i] = e is not None
        if e is None and self.quotas.admit(s.ns, spec.stride):
            e = self.index.reserve(table, key, spec.page_bytes, spec.stride)
        if e is None:
            self.counters["no_space"] += 1
            row[i] = P.SLOT_NO_SPACE
        else:
            e.owner = s.id
            r.slots.append((p, i, e))
            row[i] = e.offset
            tag_row[i] = e.gen
        return True

    @staticmethod
    def _chain(msg: P.Reserve) -> P.PoolKeys | None:
        """The transfer whose keys the call links into a chain (``Reserve.anchor_pool``), None
        when it has no keys, after checking the chain fields (nothing is reserved before)."""
        if len(msg.parent) > P.MAX_KEY_LEN:
            raise InvalidTransfer(f"the parent key is longer than {P.MAX_KEY_LEN} characters; "
                                  "nothing was stored")
        if msg.parent and msg.depth == 0:
            raise ProtocolError("Reserve.depth is 0 (a root) but it names a parent")
        if not msg.anchor_pool:
            anchor = msg.transfers[0] if msg.transfers else None
        else:
            anchor = next((t for t in msg.transfers if t.pool == msg.anchor_pool), None)
            if anchor is None:
                raise InvalidTransfer(f"anchor pool {msg.anchor_pool!r} is not one of the "
                                      f"call's pools {[t.pool for t in msg.transfers]}; "
                                      "nothing was stored")
        return anchor if anchor is not None and anchor.keys else None

    def _grant_ahead(self, s: Session, ahead, msg: P.Reserve, specs: list[PoolSpec]
                     ) -> list[list[int]]:
        """Keep ``want_ahead[p]`` set-ahead slots of each pool of the request (within the
        per-session and arena-wide bounds); per transfer, the offsets the session now holds."""
        out = []
        for p, (t, spec) in enumerate(zip(msg.transfers, specs)):
            held = len(ahead.pools.get(t.pool, ()))
            want = msg.want_ahead[p] if p < len(msg.want_ahead) else held  # not said: keep
            want = max(0, min(want, self.ahead_session_bytes // spec.stride))
            if held > want:
                self.leases.free_ahead(ahead, t.pool, keep=want)
            slots = ahead.pools.get(t.pool, {})
            while (len(slots) < want
                   and ahead.nbytes + spec.stride <= self.ahead_session_bytes
                   and self.leases.ahead_bytes + spec.stride <= self.ahead_total_bytes
                   and self.quotas.fits(s.ns, spec.stride)):  # idle slots evict no own page
                e = self.index.reserve_unbound(s.ns, spec.stride)
                if e is None:
                    break
                self.leases.add_ahead(ahead, t.pool, e)
                slots = ahead.pools[t.pool]
            out.append(list(slots))
        if not ahead.nbytes:
            self.leases.ahead.pop(s.id, None)
        return out

    def commit(self, s: Session, msg: P.Commit) -> P.Committed:
        stored = [[False] * len(row) for row in msg.ok]
        r = self.leases.take_reservation(msg.reservation_id, s.id)
        if r is None:  # expired (or foreign): nothing published, but read all the same, so the
            self._ack(s, msg)  # client need not go through the socket to read its own writes
            return P.Committed(msg.req_id, stored)
        done: list[Entry] = []
        for p, i, e in r.slots:
            if not msg.abort and p < len(msg.ok) and i < len(msg.ok[p]) and msg.ok[p][i]:
                stored[p][i] = True
                done.append(e)
            else:
                self.index.abort(e)
        self.index.commit_many(done)  # all of the call's pages at once (step 4)
        if self.pending_waiters:
            for _, _, e in r.slots:
                self._wake_pending(e)
        self.tier.on_commit(done)
        self._ack(s, msg)
        return P.Committed(msg.req_id, stored)

    def _ack(self, s: Session, msg: P.Commit) -> None:
        """Tell the client (its word in the presence table) that its commits up to this one are
        read, and published where they were on time."""
        if msg.seq and self.index.shared is not None:
            self.index.shared.ack(s.presence_word, msg.seq)
