"""The set path: step 2, ``reserve`` (slots for every pool of a Reserve, or "present" / "in
flight" / "no space"), and step 4, ``commit`` (all pools' pages of the call published at once,
then handed to L3).

``SetControl`` owns the namespaces' L2 quotas (``quotas.py``) and the bounds of set-ahead slots;
it mutates the index (reserve, bind, commit, abort, link), the reservations and set-ahead slots
(``leases``) and the tier's write queues (``on_commit``, ``on_present``, write-back relief), and
counts ``no_space``. After a page is committed or aborted it calls ``wake(entry)`` (the
controller answers the gets that waited for it, ``parking``); what an answer does not wait for
goes to ``later`` (the controller's books). Control loop only; ``reload`` changes its bounds.

A Reserve's new keys (neither in L2 nor pending, no set-ahead slot named) are reserved a run at
a time (``PageIndex.reserve_many``: one numpy pass for the pages that get a slot without
eviction); the keys between runs (present, in flight, bound to a set-ahead slot) are answered
one by one where they come, so the state is that of answering every key in turn. Under
``prefix`` / ``hybrid`` a transfer whose class is short of slots for its new keys evicts their
victims first, before its first chunk (``_evict_first``: the same victims, named several a
policy call in a namespace with no trailing pool, one set at a time with trailing pools, and the
same slots whether the call is worked at once or in slices); its runs then take free slots.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hicached import protocol as P
from hicached.daemon.index import Entry
from hicached.daemon.leases import Reservation
from hicached.daemon.quotas import NoQuotas, make_quotas
from hicached.daemon.sessions import PoolSpec, Session
from hicached.daemon.slicing import Steps, drive, fit_chunk
from hicached.errors import InvalidTransfer, ProtocolError, UnknownSession


def _now(fn, *args) -> None:
    """``fn(*args)`` now (``Controller.later``'s twin for what may not wait)."""
    fn(*args)


class SetControl:
    """``reserve``, ``commit`` (and their steps: ``slicing.py``); see the module docstring."""

    def __init__(self, index, leases, tier, sessions, parking, counters: dict,
                 clock: Callable[[], float], later: Callable[..., None],
                 wake: Callable[[Entry], None], quotas=None, ahead_session_bytes: int = 0,
                 ahead_total_bytes: int = 0) -> None:
        self.index = index
        self.leases = leases
        self.tier = tier
        self.sessions = sessions
        self.parking = parking
        self.counters = counters
        self.clock = clock
        self.later = later
        self.wake = wake
        self.quotas = quotas if quotas is not None else NoQuotas()  # per-namespace (quotas.py)
        # set-ahead slots (leases.AheadSlots): bytes one session / all sessions may hold
        self.ahead_session_bytes = ahead_session_bytes
        self.ahead_total_bytes = ahead_total_bytes

    def reload(self, namespace_quotas: dict, ahead_session_bytes: int) -> None:
        """SIGHUP: new quotas (applied at once) and set-ahead bound (at each next set)."""
        self.ahead_session_bytes = ahead_session_bytes
        if type(self.quotas) is NoQuotas:
            self.quotas = make_quotas(self.index, namespace_quotas)
        else:
            self.quotas.set_quotas(namespace_quotas)

    def reserve(self, s: Session, msg: P.Reserve) -> P.Reserved:
        return drive(self.reserve_steps(s, msg))

    def reserve_steps(self, s: Session, msg: P.Reserve, chunk: int | None = None) -> Steps:
        """``reserve`` in chunks of ``chunk`` keys of a transfer, yielding between two (None:
        all at once, never yielding; ``slicing.py``). Between two chunks the call holds what it
        holds at once: its reservation (renewed at each resume: no sweep expires a call under
        way), its set-ahead slots and its parent's pin. Its keys are reserved chunk after chunk
        as they would be key after key; a session ended meanwhile (its reservation dropped
        with it) ends the call with ``UnknownSession``."""
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
        if chain is not None:
            r.anchor = next(p for p, t in enumerate(msg.transfers) if t is chain)
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
                n = len(t.keys)
                row, tag_row, bound_row = [0] * n, [0] * n, [False] * n
                yield from self._evict_first(s, r, ahead, t, spec, claims, chunk)
                lo, step = 0, max(1, chunk // 4) if chunk else n  # (eviction may be dear)
                while lo < n:
                    if chunk and (p or lo):  # (a chunk before this one)
                        yield
                        self._resume_reserve(s, r, ahead)
                    hi = min(n, lo + step)
                    t0 = time.perf_counter()
                    self._reserve_transfer(s, r, p, t, spec, claims, ahead, present,
                                           (row, tag_row, bound_row), lo, hi)
                    if chunk:  # fewer keys a chunk while each costs more (evicting)
                        step = fit_chunk(chunk, hi - lo, time.perf_counter() - t0)
                    lo = hi
                offsets.append(row)
                tags.append(tag_row)
                bound.append(bound_row)
        finally:
            self.index.unpin_many(guard)
        # the links, L3's share and write-back's relief are kept after the answer when nothing
        # else of the call comes after them (set-ahead slots, granted below, may evict)
        after = self.later if ahead is None else _now
        if chain is not None and chunk and len(chain.keys) > chunk:  # a chunk at a time
            for lo in range(0, len(chain.keys), chunk):
                yield
                self._resume_reserve(s, r, ahead)
                self.index.link(s.ns, chain.keys[lo:lo + chunk],
                                chain.keys[lo - 1] if lo else msg.parent or None,
                                msg.depth + lo if msg.depth >= 0 else msg.depth)
        elif chain is not None:  # after the loop: its pending keys are held now
            after(self.index.link, s.ns, chain.keys, msg.parent or None, msg.depth)
        if present:
            after(self.tier.writes.on_present, present)
        if self.tier.writes.dirty:  # write_back: make dirty pages evictable before the arena fills
            after(self._relieve, any(P.SLOT_NO_SPACE in row for row in offsets))
        granted = self._grant_ahead(s, ahead, msg, specs) if ahead is not None else []
        if not any(map(any, bound)):
            bound = []
        if not r.slots:
            self.leases.take_reservation(r.id, s.id)
            return P.Reserved(msg.req_id, 0, offsets, tags, granted, bound)
        return P.Reserved(msg.req_id, r.id, offsets, tags, granted, bound)

    def _relieve(self, force: bool) -> None:
        self.tier.writes.relieve_pressure(force=force)

    def _resume_reserve(self, s: Session, r: Reservation, ahead) -> None:
        """A Reserve worked in slices goes on (``reserve_steps``): its session and reservation
        still there, their deadlines renewed."""
        if s.id not in self.sessions or self.leases.reservations.get(r.id) is not r:
            raise UnknownSession(f"session {s.id} ended while its Reserve was worked; "
                                 f"{len(r.slots)} of its pages had slots, none was stored")
        now = self.clock()
        r.deadline = now + self.leases.reservation_ttl_s
        if ahead is not None:
            ahead.deadline = r.deadline

    def _evict_first(self, s: Session, r: Reservation, ahead, t: P.PoolKeys, spec: PoolSpec,
                     claims, chunk: int | None) -> Steps:
        """Under a policy whose victims free runs of slots (``prefix`` / ``hybrid``;
        ``reserving.py``), a transfer whose class is short of slots for its new keys (neither
        in L2 nor pending, no set-ahead slot named; as many as its namespace's quota admits at
        once) evicts their victims first, set after set (``Reclaimer.evict_first``), so that
        its runs of keys then take free slots: the same victims as key by key, named and
        evicted at a fraction of the cost, and the same whether the call is worked at once or
        in slices (before its first chunk; in slices, ``chunk`` keys looked up, then a quarter
        chunk's slots freed, a step). What it could not free, the keys evict one by one."""
        index, n, stride = self.index, len(t.keys), spec.stride
        alloc = index.alloc
        if alloc.free_slots(stride) >= n or not index.reclaimer.evicts_first(s.ns):
            return
        table = (s.ns, t.pool)
        step = chunk or n
        new: list[str] = []
        for lo in range(0, n, step):
            if lo:
                yield
                self._resume_reserve(s, r, ahead)
            keys = t.keys[lo:lo + step]
            got, _, _ = index.lookup(table, keys)
            if claims:
                new += [key for i, (key, e) in enumerate(zip(keys, got), lo)
                        if e is None and (i >= len(claims) or claims[i] < 0)]
            else:
                new += [key for key, e in zip(keys, got) if e is None]
        pending = index.pending.get(table)
        if pending:
            new = [key for key in new if key not in pending]
        want = self.quotas.admit_many(s.ns, stride, len(set(new)))
        step = max(1, chunk // 4) if chunk else want  # (evicting may be dear)
        while alloc.free_slots(stride) < want:
            if chunk:
                yield
                self._resume_reserve(s, r, ahead)
            if not index.reclaimer.evict_first(stride, min(want, alloc.free_slots(stride) + step),
                                               s.ns):
                break

    def _reserve_transfer(self, s: Session, r: Reservation, p: int, t: P.PoolKeys,
                          spec: PoolSpec, claims, ahead, present: list[Entry],
                          rows: tuple[list[int], list[int], list[bool]], lo: int, hi: int
                          ) -> None:
        """Keys ``lo..hi-1`` of transfer ``p`` of a Reserve: per key, into ``rows``, its slot
        offset (or ``SLOT_*``), tag, and whether it took a set-ahead slot. Runs of new keys go
        to ``_reserve_run`` together, each key between them to ``_reserve_key`` where it comes
        (see the module docstring)."""
        table, index = (s.ns, t.pool), self.index
        keys = t.keys if (lo, hi) == (0, len(t.keys)) else t.keys[lo:hi]
        row, tag_row, bound_row = rows
        got, fps, recs = index.lookup(table, keys)
        known = fps is not None  # the lookup holds until a record comes or goes
        run: list[int] = []  # positions of new keys, reserved when the run ends
        in_run: set[str] = set()  # (a key twice: in flight once the run before it is reserved)
        for i, (key, e) in enumerate(zip(keys, got), lo):
            if (e is None and key not in in_run and (i >= len(claims) or claims[i] < 0)
                    and index.get_pending(table, key) is None):
                run.append(i)
                in_run.add(key)
                continue
            if run:
                self._reserve_run(s, r, p, table, spec, t.keys, run, row, tag_row,
                                  (fps, recs, lo) if known else None)
                run, in_run, known = [], set(), False
            known &= not self._reserve_key(s, r, p, i, table, key, e, spec, claims, ahead,
                                           present, row, tag_row, bound_row)
        if run:
            self._reserve_run(s, r, p, table, spec, t.keys, run, row, tag_row,
                              (fps, recs, lo) if known else None)

    def _reserve_run(self, s: Session, r: Reservation, p: int, table, spec: PoolSpec,
                     keys: list[str], run: list[int], row: list[int], tag_row: list[int],
                     looked_up: tuple | None) -> None:
        """Reserve the new keys at positions ``run`` of ``keys``: those the namespace's quota
        admits without evicting its own pages at once, the rest one by one. ``looked_up``:
        (fps, recs) from ``PageIndex.lookup`` of the keys from position ``lo`` on, while they
        still hold, and that ``lo``."""
        admitted = self.quotas.admit_many(s.ns, spec.stride, len(run))
        fps = recs = None
        if looked_up is not None and admitted:
            lo = looked_up[2]
            at = [i - lo for i in run[:admitted]] if lo else run[:admitted]
            fps, recs = looked_up[0][at], looked_up[1][at]
        got = self.index.reserve_many(table, [keys[i] for i in run[:admitted]],
                                      spec.page_bytes, spec.stride, s.id, fps, recs,
                                      evict_first=False)  # (``_evict_first`` did)
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
                row[i] = e.slot_offset  # (a pending page keeps its slot: it is pinned)
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
        return drive(self.commit_steps(s, msg))

    def commit_steps(self, s: Session, msg: P.Commit, chunk: int | None = None) -> Steps:
        """``commit`` (step 4). A reservation of more than ``chunk`` pages (None: never) is
        published a chunk of keys at a time, yielding between two (``slicing.py``), in an order
        that keeps what a reader sees whole:

          every pool's page of a key in one chunk   a reader never sees a key's KV page
                                                    without its companions of the call
          the keys from the deep end of the call's  a hit (a prefix of a chain) reaches into
          chain (its anchor transfer) to its first  the call's pages only once every deeper
                                                    page of it is published: at the last chunk

        Its pages are recent in that order (the deep end first), and its KV events are told at
        the end, in the call's order (those of pages still in L2). The call goes on if its
        session ends meanwhile (its pages are written); the commit is then acknowledged to
        nobody."""
        stored = [[False] * len(row) for row in msg.ok]
        r = self.leases.take_reservation(msg.reservation_id, s.id)
        if r is None:  # expired (or foreign): nothing published, but read all the same, so the
            self._ack(s, msg)  # client need not go through the socket to read its own writes
            return P.Committed(msg.req_id, stored)
        if not chunk or len(r.slots) <= chunk:
            groups = [r.slots]
        else:
            groups = yield from self._deep_first(r, chunk)
            told = r.slots if self.index.events.tids else None  # (its KV events, at the end)
            r.slots = []  # each chunk's pages let go once published: no pause at the end
        for n, group in enumerate(groups):
            if n:
                yield
                groups[n - 1] = None
            done: list[Entry] = []
            for p, i, e in group:
                if not msg.abort and p < len(msg.ok) and i < len(msg.ok[p]) and msg.ok[p][i]:
                    stored[p][i] = True
                    done.append(e)
                else:
                    self.index.abort(e)
            # all of the call's pages at once (step 4): in slices, all of a chunk's keys
            self.index.commit_many(done, events=len(groups) == 1)
            if self.parking.pending_waiters:
                for _, _, e in group:
                    self.wake(e)
            self.tier.writes.on_commit(done)
        if len(groups) > 1:
            if told:
                self.index.events.stored([e for p, i, e in told
                                          if stored[p][i] and e.committed], self.index.chain)
            if s.id not in self.sessions:
                return P.Committed(msg.req_id, stored)  # (its presence word may be another's)
        self._ack(s, msg)
        return P.Committed(msg.req_id, stored)

    @staticmethod
    def _deep_first(r: Reservation, chunk: int) -> Steps:
        """``r``'s slots in chunks of at most ``chunk`` keys (``commit_steps``), yielding while
        it sorts them: each key's slots of every transfer together, the keys ranked by where
        they come in the anchor transfer (then in the others), the chunk of the last keys
        first."""
        slots = r.slots
        if slots[0][0] == slots[-1][0]:  # one transfer's (a key once: a second is in flight)
            return [slots[lo:lo + chunk] for lo in range(0, len(slots), chunk)][::-1]
        rank: dict[str, int] = {}
        for n, (p, _, e) in enumerate(slots):
            if p == r.anchor:
                rank.setdefault(e.key, len(rank))
            if n % (chunk * 4) == chunk * 4 - 1:
                yield
        for n, (_, _, e) in enumerate(slots):
            rank.setdefault(e.key, len(rank))
            if n % (chunk * 4) == chunk * 4 - 1:
                yield
        groups: list[list[tuple[int, int, Entry]]] = [[] for _ in range(-(-len(rank) // chunk))]
        for n, slot in enumerate(slots):
            groups[rank[slot[2].key] // chunk].append(slot)
            if n % (chunk * 4) == chunk * 4 - 1:
                yield
        return groups[::-1]

    def _ack(self, s: Session, msg: P.Commit) -> None:
        """Tell the client (its word in the presence table) that its commits up to this one are
        read, and published where they were on time."""
        if msg.seq and self.index.shared is not None:
            self.index.shared.ack(s.presence_word, msg.seq)
