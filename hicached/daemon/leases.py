"""Reservations (set in progress) and leases (get in progress), each with a deadline.

A client that dies between ``Reserve`` and ``Commit``, or while it holds a lease, must not pin
arena memory forever: every reservation and lease expires ``ttl_s`` after it was granted and the
control loop's ``sweep`` aborts / releases it. A client seen dead earlier (its pid is gone) loses
them at once (``drop_session``).

    Reservation  id -> (session, deadline, [(pool position, key position, Entry)])   pending entries
    Lease        id -> (session, deadline, [Entry])                                   pinned entries
    AheadSlots   session -> (deadline, pool -> {offset: Entry})                     unbound entries

Set-ahead slots: a client's next ``batch_set`` copies its pages into slots it was granted in the
answer to its previous one, while its ``Reserve`` travels; the ``Reserve`` names them and the
daemon binds them to the keys (``PageIndex.bind``). Unused ones expire with the same TTL (each
answer that lists them renews it) and die with their session.

Fences: the slots of an expired reservation (or expired set-ahead slots) may still be written
by their client, alive but stalled in the middle of its copy (it checks the TTL between pools,
not within a copy). So expiry frees the keys at once (another client may write them) but keeps
the slots out of the allocator one more ``reservation_ttl_s``: a late writer then only writes
bytes nobody reads. The client's late ``Commit`` or abort of that reservation (its copy is over)
and the death of its process (``drop_session``) end the fence early. A session that ends while
its process lives (``Bye``, a new handshake replacing it) has its reservations and set-ahead
slots fenced the same way: another thread of that client may still be copying.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hicached.daemon.index import Entry, PageIndex
from hicached.liveness import ProcessRef, alive


@dataclass
class Reservation:
    id: int
    session: int
    deadline: float
    slots: list[tuple[int, int, Entry]] = field(default_factory=list)
    anchor: int = 0  # the transfer whose keys are the call's chain (set by ``reserve_steps``)


@dataclass
class AheadSlots:
    session: int
    deadline: float
    pools: dict[str, dict[int, Entry]] = field(default_factory=dict)
    nbytes: int = 0


@dataclass
class Fence:
    """Slots no one may be given before ``until``: their former owner may still write them.
    ``process``: that owner, once its session is closed (the fence ends when it exits)."""

    session: int
    until: float
    entries: list[Entry]
    process: ProcessRef | None = None


@dataclass
class LeaseGrant:
    id: int
    session: int
    deadline: float
    entries: list[Entry] = field(default_factory=list)


class LeaseTable:
    """Owns reservation and lease records; pins/unpins through the ``PageIndex``."""

    def __init__(self, index: PageIndex, reservation_ttl_s: float, lease_ttl_s: float):
        self.index = index
        self.reservation_ttl_s = reservation_ttl_s
        self.lease_ttl_s = lease_ttl_s
        self.reservations: dict[int, Reservation] = {}
        self.leases: dict[int, LeaseGrant] = {}
        self.ahead: dict[int, AheadSlots] = {}  # session -> its set-ahead slots
        self.ahead_bytes = 0  # of all sessions
        self.fences: dict[int, Fence] = {}  # reservation id (or a fresh id) -> fenced slots
        self.fenced_bytes = 0
        self._ids = itertools.count(1)
        self.expired_reservations = 0
        self.expired_leases = 0

    # ------------------------------------------------------------ reservations

    def new_reservation(self, session: int, now: float) -> Reservation:
        r = Reservation(next(self._ids), session, now + self.reservation_ttl_s)
        self.reservations[r.id] = r
        return r

    def take_reservation(self, rid: int, session: int) -> Reservation | None:
        """Remove and return a live reservation of ``session`` (None if expired or foreign).
        An expired one's fence ends: its client is done copying."""
        r = self.reservations.get(rid)
        if r is None or r.session != session:
            f = self.fences.get(rid)
            if f is not None and f.session == session:
                self._unfence(rid)
            return None
        del self.reservations[rid]
        return r

    def _end_reservation(self, r: Reservation, now: float | None) -> None:
        """Drop ``r`` uncommitted: its slots freed (``now`` None: nobody can write them any
        more) or fenced from ``now`` on."""
        del self.reservations[r.id]
        pending = [e for _, _, e in r.slots if not e.committed]
        if now is not None:
            self._fence(r.id, r.session, pending, now)
            return
        for e in pending:
            self.index.abort(e)

    # ------------------------------------------------------------ set-ahead slots

    def ahead_of(self, session: int, now: float) -> AheadSlots:
        """The set-ahead slots of ``session`` (created empty), their deadline renewed."""
        a = self.ahead.get(session)
        if a is None:
            a = self.ahead[session] = AheadSlots(session, 0.0)
        a.deadline = now + self.reservation_ttl_s
        return a

    def add_ahead(self, a: AheadSlots, pool: str, entry: Entry) -> None:
        a.pools.setdefault(pool, {})[entry.offset] = entry
        self._count_ahead(a, entry.stride)

    def _count_ahead(self, a: AheadSlots, nbytes: int) -> None:
        a.nbytes += nbytes
        self.ahead_bytes += nbytes

    def take_ahead(self, a: AheadSlots, pool: str, offset: int) -> Entry | None:
        """Remove and return the slot at ``offset`` (None if it is not one of ``a``'s)."""
        slots = a.pools.get(pool)
        entry = slots.pop(offset, None) if slots else None
        if entry is not None:
            self._count_ahead(a, -entry.stride)
        return entry

    def free_ahead(self, a: AheadSlots, pool: str | None = None, keep: int = 0) -> int:
        """Free ``a``'s slots of ``pool`` (all pools: None) but the first ``keep``; returns how
        many were freed."""
        n = 0
        for name in [pool] if pool is not None else list(a.pools):
            slots = a.pools.get(name, {})
            for offset in list(slots)[keep:]:
                entry = slots.pop(offset)
                self._count_ahead(a, -entry.stride)
                self.index.abort(entry)
                n += 1
            if not slots:
                a.pools.pop(name, None)
        return n

    def _drop_ahead(self, session: int) -> None:
        a = self.ahead.pop(session, None)
        if a is not None:
            self.free_ahead(a)

    # ------------------------------------------------------------ fences

    def _fence(self, fid: int, session: int, entries: list[Entry], now: float) -> None:
        """Free the keys of ``entries`` (pending or unbound, pinned) now, their slots at the
        fence's end."""
        for e in entries:
            p = self.index.pending.get(e.table)
            if p is not None and p.get(e.key) == e:
                del p[e.key]
            self.fenced_bytes += e.stride
        if entries:
            self.fences[fid] = Fence(session, now + self.reservation_ttl_s, entries)

    def fence_until(self, entries: list[Entry], until: float) -> None:
        """Keep unbound, pinned slots from writers until ``until`` (then freed): a previous
        daemon's clients may still write them (``adoption.py``)."""
        for e in entries:
            self.fenced_bytes += e.stride
        if entries:
            self.fences[next(self._ids)] = Fence(0, until, entries)

    def _fence_ahead(self, session: int, now: float) -> None:
        a = self.ahead.pop(session, None)
        if a is not None:
            self._count_ahead(a, -a.nbytes)
            self._fence(next(self._ids), session,
                        [e for slots in a.pools.values() for e in slots.values()], now)

    def _unfence(self, fid: int) -> None:
        for e in self.fences.pop(fid).entries:
            self.fenced_bytes -= e.stride
            self.index.abort(e)

    # ------------------------------------------------------------ leases

    def new_lease(self, session: int, entries: list[Entry], now: float,
                  pinned: bool = False) -> LeaseGrant:
        """Pin ``entries`` under a new lease that expires after ``lease_ttl_s`` (``pinned``:
        the caller pinned them for it, ``PageIndex.read_many``)."""
        g = LeaseGrant(next(self._ids), session, now + self.lease_ttl_s, entries)
        if not pinned:
            self.index.pin_many(entries)
        self.leases[g.id] = g
        return g

    def hold(self, entries: list[Entry], until: float) -> None:
        """Pin committed ``entries`` until ``until`` under a lease of no session (0: none
        releases it; ``sweep`` ends it): a previous daemon's clients may still read them under
        leases it granted (``adoption.py``, step 5)."""
        if entries:
            self.index.pin_many(entries)
            g = LeaseGrant(next(self._ids), 0, until, entries)
            self.leases[g.id] = g

    def take_lease(self, lease_id: int, session: int) -> LeaseGrant | None:
        """Remove and return a lease of ``session`` without unpinning its pages (the caller
        does: a release in slices); None if unknown (expired, foreign or released twice)."""
        g = self.leases.get(lease_id)
        if g is None or g.session != session:
            return None
        del self.leases[lease_id]
        return g

    def release(self, lease_id: int, session: int) -> bool:
        """End a lease of ``session``; False if unknown (expired, foreign or released twice)."""
        g = self.leases.get(lease_id)
        if g is None or g.session != session:
            return False
        del self.leases[lease_id]
        self._unpin_all(g)
        return True

    def _unpin_all(self, g: LeaseGrant) -> None:
        self.index.unpin_many(g.entries)

    # ------------------------------------------------------------ expiry

    def sweep(self, now: float) -> tuple[int, int]:
        """Abort expired reservations and release expired leases; returns (reservations, leases)."""
        for fid in [fid for fid, f in self.fences.items()
                    if f.until <= now or (f.process is not None and not alive(f.process))]:
            self._unfence(fid)
        dead_r = [r for r in self.reservations.values() if r.deadline <= now]
        for r in dead_r:
            self._end_reservation(r, now)
        dead_l = [g for g in self.leases.values() if g.deadline <= now]
        for g in dead_l:
            del self.leases[g.id]
            self._unpin_all(g)
        for a in [a for a in self.ahead.values() if a.deadline <= now]:
            self._fence_ahead(a.session, now)
        self.expired_reservations += len(dead_r)
        self.expired_leases += len(dead_l)
        return len(dead_r), len(dead_l)

    def drop_session(self, session: int, now: float | None = None,
                     keep_leases: bool = False, process: ProcessRef | None = None) -> None:
        """Free everything session ``session`` holds. Its process is gone (``now`` None): its
        fenced slots too, at once. It only left (``Bye``, or replaced by a new handshake, while
        its process lives: another of its threads may still be copying): its reservations and
        set-ahead slots are fenced as if they had expired at ``now``, and with ``keep_leases``
        its leases run to their TTL (a thread may still be reading). ``process``: its process,
        whose exit ends those fences early."""
        if now is None:
            for fid in [fid for fid, f in self.fences.items() if f.session == session]:
                self._unfence(fid)
        for r in [r for r in self.reservations.values() if r.session == session]:
            self._end_reservation(r, now)
        for g in [g for g in self.leases.values() if g.session == session and not keep_leases]:
            del self.leases[g.id]
            self._unpin_all(g)
        if now is None:
            self._drop_ahead(session)
            return
        self._fence_ahead(session, now)
        if process is not None:
            for f in self.fences.values():
                if f.session == session:
                    f.process = process
