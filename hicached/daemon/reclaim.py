"""Making room in a size class: on a reservation's path, and ahead, in the control loop's idle
turns, before the sets need it.

A reservation that finds its size class full evicts on the request path (``make_room``), and
under the hybrid controller a victim is a whole leaf segment: a state takes the KV pages only
it made useful, 40-150 pages at tens of microseconds each, on the one set that asked for a slot.
Once a class has had to evict (it is *pressed*), ``Reclaimer`` keeps ``ahead`` of the arena free
in it (its free slots and the free slabs; at least one slot) by evicting, in the loop's idle turns,
the victims the policy names for it, a few pages at a time: the loop asks ``step`` only while no
request waits, and ``step`` returns as soon as one arrives. The tails of ``HybridPolicy.stale``
(state-less leaves whose grace ends, or the keys above a segment that went) go the same way,
``EARLY`` ticks before they are due; a commit takes those due itself (on a set's path, as
without a reclaimer) only when the loop has had no idle turn for ``TAILS_WAIT_S``, and a stats
call first takes them (``settle``) so that the orphans it counts are the ones the policy keeps.

A victim set is evicted in the policy's order (dependants first: a segment from its leaf up), a
key at a time, and may be stopped between any two keys. A key's pages in the set (they come
together: ``KeyTree.pages``) go in one go, never some now and the rest in a later turn: a
reader between two turns would see the key's KV page without the INDEXER page its call stored
with it (the atomic multi-pool commit, whose mirror this is). Before a key's pages go each is
checked again: the same page (its generation), committed, unpinned, not used since the policy
named it, and, by the policy's ``may_go_ahead``, nothing resident depending on it now (a chain
continued from the segment's middle since); and, where the policy evicts keys whole
(``whole_keys``), the key holds no other page but its states (one committed since). The first
key that fails ends the set with all its pages kept (what is left of a segment is a state-less
tail, back in ``HybridPolicy.stale``'s queue); a page gone another way meanwhile is skipped. So
an interrupted set never leaves a page without its ancestors nor a key without some of its
pages, a page read since the policy chose it stays with its key, and the pages of a set begun
are going (``leaving``: the orphan count leaves them out). A reservation that needs several
keys of the queue (``take``), or of a set it splits (``evict_victims``), counts them first,
each checked as it would be once the keys before it went, and evicts them in one call: the
state a key at a time leaves.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hicached.daemon.entry import COMMITTED
from hicached.daemon.evict import Evictor
from hicached.daemon.eviction.interface import EvictionPolicy
from hicached.daemon.records import Records

STEP_PAGES = 64  # pages one ``step`` evicts (at most that, and the rest of the key it is at)
# ticks before its grace ends that a tail goes (``policy.stale``): in an idle turn that comes
# before the tail would count as an orphan, not after
EARLY = 512
CHECK_EVERY = 2  # pages between two looks at whether a request waits (at a key's end)
TAILS_WAIT_S = 0.01  # a commit takes the tails due itself once the loop had no idle turn as long
SPLIT_MIN = 8  # pages of a leaf segment below which it goes whole (``evict_victims``)
# a split set goes in one call, the keys it needs counted first, leaving the state of key by
# key (a test sets it off to compare)
ONE_CALL = True


class Reclaimer:
    """Makes room in the size classes: on a reservation's path (``make_room``, the victims the
    policy names, a split leaf segment's rest deferred) and ahead, in the control loop's idle
    turns (``wanted`` / ``step``: ``ahead``, a share of the arena, 0: off, kept free in each
    pressed class; the tails of ``policy.stale`` taken early). The index builds it (its
    ``reclaimer``), with its records, its evictor and its policy.

    Owns the deferred queue (a victim set begun, the rest of split segments), the pressed
    classes (``pressed``) and its counters. Mutates nothing else itself: pages go through
    ``evictor.evict_pages``. Reads the records and the allocator (``records.alloc``); calls the
    policy's ``make_room``, ``stale``, ``stale_due``, ``may_go_ahead``, ``abandoned``.

    ``busy`` (a daemon's: whether a request waits) set, the loop steps while idle and the
    tails go ``EARLY`` before they are due, a commit taking them itself only when the loop
    had no idle turn for ``TAILS_WAIT_S`` (``commit_tails``), and a reservation defers the
    rest of a split segment (``evict_victims``); None (a bare index, the tools), a commit
    takes the tails due and a victim set goes whole."""

    def __init__(self, records: Records, evictor: Evictor, policy: EvictionPolicy,
                 ahead: float = 0.0, busy: Callable[[], bool] | None = None):
        self.records = records
        self.evictor = evictor
        self.policy = policy
        self.ahead = ahead
        self.pressed: set[int] = set()  # size classes a reservation had to evict for
        self.evicted = 0  # pages evicted ahead (stats)
        self._queue: list[tuple[int, int, int]] = []  # (page, gen, used), the next one last
        self._queue_evicted = 0  # pages of the current victim set evicted so far
        self._blocked: tuple[int, int, int] | None = None  # the index's state when nothing could go
        self.tails = busy is not None  # take the tails of ``policy.stale`` early, defer
        self.busy: Callable[[], bool] = busy or (lambda: False)
        self.waiting_since = 0.0  # since when ``wanted`` has said yes and no ``step`` ran

    # ------------------------------------------------------------ on a reservation's path

    def make_room(self, stride: int) -> int | None:
        """A slot of class ``stride`` (its offset) once the deferred pages, then the victims
        the policy names, went; None when nothing may go. (``evict_for`` of one slot, then the
        slot; its own loop: LRU's path for every page a set evicts, where ``evict_for``'s call
        a victim measured +2 % opcodes on an evicting set.)"""
        self.pressed.add(stride)
        alloc, policy = self.records.alloc, self.policy
        while True:
            if self.tails and self.take(stride, 1):
                offset = alloc.alloc(stride)
                if offset is not None:
                    return offset
                continue
            victims = policy.make_room(stride)  # dependants included, in order
            if not victims:
                return None
            if not self.evict_victims(victims, stride, 1):
                return None  # a policy naming only pages that cannot go: no room
            offset = alloc.alloc(stride)
            if offset is not None:
                return offset

    def evicts_first(self, ns: str) -> bool:
        """Whether a call of namespace ``ns`` whose class is short evicts its keys' victims
        before reserving them (``evict_for``): under a policy whose victims free runs of slots
        (``frees_runs``). (Under LRU each key evicts its own victim as it comes: a slot handed
        out moves its slab's last use, which LRU's ``make_room`` weighs.)"""
        return self.policy.frees_runs

    def names_many(self, ns: str) -> bool:
        """Whether ``evict_for`` may name several victim sets a policy call for a call of
        namespace ``ns`` (``many``): not with trailing pools, where the sets go one at a time,
        each split where the class has room for the call's keys (what its keys, reserved one
        by one, would evict in turn: a state's reservation evicts the state and its key's KV
        page, the rest of the segment is deferred)."""
        return not self.records.trailing(ns)

    def evict_for(self, stride: int, need: int, many: bool = True) -> int:
        """Evict for a reservation of ``need`` slots of class ``stride``: the dead tails a
        split segment left (``take``), then the victims the policy names, until the class has
        ``need`` free slots or nothing more may go; the pages evicted (0: nothing may go).

        ``many`` and a policy whose victims free runs of slots (``frees_runs``): set after
        set, several a policy call (``make_room_many``), before any key is reserved
        (``reserving.py``: the same victims as key by key, since a reservation changes nothing
        a policy reads); else one set (what one key's reservation evicts: LRU, where a slot
        handed out moves its slab's last use, which its ``make_room`` weighs; ``evict_first``'s
        sets in a namespace with trailing pools; a caller that evicted first for a whole call,
        ``set_control.py``)."""
        self.pressed.add(stride)
        policy, free_slots = self.policy, self.records.alloc.free_slots
        runs = many and policy.frees_runs
        done = 0
        while True:
            got = self.take(stride, need) if self.tails else 0
            if not got:
                victims = (policy.make_room_many(stride, need - free_slots(stride)) if runs
                           else policy.make_room(stride))
                got = self.evict_victims(victims, stride, need) if victims else 0
                if not got:
                    return done
            done += got
            if not runs or free_slots(stride) >= need:
                return done

    def evict_first(self, stride: int, need: int, ns: str) -> int:
        """A call's eviction before its keys of namespace ``ns`` are reserved
        (``evicts_first``): victim sets until class ``stride`` has ``need`` free slots or
        nothing more may go, several a policy call where ``names_many``, else one at a time
        (``evict_for`` of one set; ``evict_victims`` splits it where the class has room for
        ``need``); the pages evicted."""
        if self.names_many(ns):
            return self.evict_for(stride, need)
        done, free_slots = 0, self.records.alloc.free_slots
        while free_slots(stride) < need:
            got = self.evict_for(stride, need, False)
            if not got:
                break
            done += got
        return done

    def evict_victims(self, victims: list[int], stride: int, need: int) -> int:
        """Evict ``victims`` (``policy.make_room``'s, in order); returns how many went. A leaf
        segment (``policy.split_ok``) of more than ``SPLIT_MIN`` pages goes key by key from its
        leaf up only until class ``stride`` has ``need`` free slots: the rest, state-less keys
        no hit can use, is deferred (the idle turns, or the next reservation that needs room),
        off the path of the set that asked. So a set that needs one slot for a state does not
        also evict the hundred KV pages only that state made useful. (No ``busy``: whole.)"""
        evict_pages = self.evictor.evict_pages
        if not self.tails or len(victims) <= SPLIT_MIN or not self.policy.split_ok:
            return evict_pages(victims)
        r = self.records
        krec, p_stride, free_slots = r.p_krec, r.p_stride, r.alloc.free_slots
        end = len(victims)
        # Key by key, the reservation that asked takes keys until the class has a slot; the
        # next ones take the rest of the set only through ``take``: the keys with a page of the
        # class, and only if nothing queued comes before them (the rest goes after it). So once
        # the first slot is free, a key with no page of the class, or anything queued, ends it.
        free0, rest = free_slots(stride), not self._queue
        if ONE_CALL and len(set(victims)) == end:
            # the keys that go are counted first, as key by key would stop (each page of the
            # class frees one of its slots; a page of another class, only when it empties its
            # slab: a free slab for any class), and go in one call (``Evictor``: one pass)
            flags, pins, p_off = r.p_flags, r.p_pins, r.p_off
            slab_of, per_slab = r.alloc.slab_of, r.alloc.slab_bytes // stride
            short, i, freed = need - free0, 0, {}
            first = short - 1  # (short once the first slot is free)
            while i < end and (not i or short > 0):
                k, j = krec[victims[i]], i
                while j < end and krec[victims[j]] == k:
                    j += 1
                if short <= first and (not rest or stride not in [
                        p_stride[p] for p in victims[i:j]]):
                    break
                for p in victims[i:j]:
                    if not flags[p] & COMMITTED or pins[p]:
                        continue  # (gone another way: ``evict_pages`` skips it)
                    if p_stride[p] == stride:
                        short -= 1
                        continue
                    slab = slab_of(p_off[p])
                    got = freed[slab] = freed.get(slab, 0) + 1
                    if got + len(slab.free) == slab.num_slots:
                        short -= per_slab
                i = j
            if i < end:
                n = evict_pages(victims[:i])
                self.defer(victims[i:])
                return n
            return evict_pages(victims)
        n, i = 0, 0
        while i < end:
            k, j = krec[victims[i]], i
            while i < end and krec[victims[i]] == k:  # (a key's pages are together: states
                i += 1  # first, ``KeyTree.pages``)
            if free_slots(stride) > free0 and (not rest or stride not in [
                    p_stride[p] for p in victims[j:i]]):
                i = j
                break
            n += evict_pages(victims[j:i])
            if free_slots(stride) >= need:
                break
        if i < end:
            self.defer(victims[i:])
        return n

    # ------------------------------------------------------------ ahead

    def set_ahead(self, ahead: float) -> None:
        """A reload's (SIGHUP): the share of the arena kept free from the next idle turn on."""
        self.ahead = ahead

    def defer(self, pages: list[int]) -> None:
        """The rest of a leaf segment a reservation split (``evict_victims``): it goes after
        the victim set begun, in its order, with the same checks."""
        ix = self.records
        self._queue[:0] = [(p, ix.p_gen[p], ix.p_used[p]) for p in reversed(pages)]

    def take(self, stride: int, need: int) -> int:
        """Evict queued pages of class ``stride`` (the next ones in the queue, while they are of
        it) until the class has ``need`` free slots: a reservation takes the dead tails left
        for the idle turns before the policy names live pages. Returns the pages evicted (on
        the reservation's path: not counted in ``evicted``, the pages evicted ahead).

        The keys that go are counted first, as ``_next`` a key at a time would take them (each
        checked as it would be once the keys before it went), and go in one call
        (``ONE_CALL``); at the first key that check or count cannot tell (one that may not go,
        or a page named twice), the keys before it go and the rest key by key."""
        ix, queue = self.records, self._queue
        if not ONE_CALL:
            return self._take_each(stride, need)
        alloc = ix.alloc
        short = need - alloc.free_slots(stride)
        if not queue or short <= 0:
            return 0
        gen_of, flags, krec, p_stride, pins, used_of = (ix.p_gen, ix.p_flags, ix.p_krec,
                                                        ix.p_stride, ix.p_pins, ix.p_used)
        policy = self.policy
        whole, tree_ok = policy.whole_keys, policy.may_go_ahead
        slab_of, per_slab = alloc.slab_of, alloc.slab_bytes // stride
        batch: list[int] = []
        named: set[int] = set()  # the pages in ``batch``
        going: set[int] = set()  # key records all of whose pages are in ``batch``
        freed: dict = {}  # slab of another class -> its slots the batch frees
        at = len(queue)
        while at and short > 0:
            j, k = at, -1
            while j:  # the next key's run (``_key_run``)
                p, gen, _ = queue[j - 1]
                if gen_of[p] == gen and flags[p] & COMMITTED:
                    if k < 0:
                        k = krec[p]
                    elif krec[p] != k:
                        break
                j -= 1
            run = queue[j:at]
            if stride not in [p_stride[p] for p, _, _ in run]:
                break
            live = [(p, used) for p, gen, used in reversed(run)
                    if gen_of[p] == gen and flags[p] & COMMITTED]
            if live:
                if any(p in named or pins[p] or used_of[p] != used
                       or not tree_ok(p, going) for p, used in live) or (
                        whole and self._more_pages(live)):
                    break  # (key by key from here: ``_next`` tells)
                mine = [p for p, _ in live]
                batch += mine
                named.update(mine)
                if self._all_of_key(k, named):
                    going.add(k)
                for p in mine:
                    if p_stride[p] == stride:
                        short -= 1
                        continue
                    slab = slab_of(ix.p_off[p])
                    got = freed[slab] = freed.get(slab, 0) + 1
                    if got + len(slab.free) == slab.num_slots:
                        short -= per_slab
            at = j
        del queue[at:]
        done = 0
        if batch:
            done = self.evictor.evict_pages(batch)
            self._queue_evicted += done
        if short > 0 and queue:
            done += self._take_each(stride, need)
        return done

    def _take_each(self, stride: int, need: int) -> int:
        """``take`` a key at a time (``_next``): the reference, and where ``take`` cannot
        count the keys that go."""
        ix, queue, done = self.records, self._queue, 0
        while queue and stride in (ix.p_stride[p] for p, _, _ in self._key_run()):
            if ix.alloc.free_slots(stride) >= need:
                break
            got = self._next()
            if got is None:
                break
            done += got
        return done

    def _all_of_key(self, k: int, named: set[int]) -> bool:
        """Whether every page of key ``k`` (pending ones too) is in ``named``: the key record
        goes with them."""
        ix = self.records
        p = ix.k_head[k]
        while p >= 0:
            if p not in named:
                return False
            p = ix.p_knext[p]
        return True

    def _key_run(self) -> list[tuple[int, int, int]]:
        """The queue's next entries that belong to one key (its pages in the set, with the
        entries of pages gone meanwhile among them), the next one first."""
        ix, queue = self.records, self._queue
        k, n = -1, 0
        for p, gen, _ in reversed(queue):
            if ix.p_gen[p] == gen and ix.p_flags[p] & COMMITTED:
                if k < 0:
                    k = ix.p_krec[p]
                elif ix.p_krec[p] != k:
                    break
            n += 1
        return queue[len(queue) - n:][::-1]

    def _next(self) -> int | None:
        """Evict the pages of the queue's next key if each may still go (how many went; 0:
        all gone another way); None when one may not (read, or depended on, since, or the
        key holds a page the set does not): the set ends there, the key's pages all kept."""
        ix, queue = self.records, self._queue
        run = self._key_run()
        del queue[len(queue) - len(run):]
        live = [(p, used) for p, gen, used in run
                if ix.p_gen[p] == gen and ix.p_flags[p] & COMMITTED]
        if not live:
            return 0  # gone another way (which took its dependants first): the rest may go
        policy = self.policy
        if any(ix.p_pins[p] or ix.p_used[p] != used or not policy.may_go_ahead(p)
               for p, used in live) or (policy.whole_keys and self._more_pages(live)):
            queue.extend(reversed(run))  # read, or depended on, since: the set ends
            policy.abandoned([q for q, g, _ in queue if ix.p_gen[q] == g])
            queue.clear()
            return None
        got = self.evictor.evict_pages([p for p, _ in live])
        self._queue_evicted += got
        return got

    def _more_pages(self, live: list[tuple[int, int]]) -> bool:
        """Whether the key of ``live`` (its pages in the set, not states alone) holds a
        committed page that is no state and not in the set (stored since the policy named
        it): taking the set's pages would leave that page of the key without the others."""
        ix = self.records
        if all(ix.t_state[ix.p_tid[p]] for p, _ in live):
            return False  # states alone (a mid-chain state): the key's other pages stay
        mine = {p for p, _ in live}
        p = ix.k_head[ix.p_krec[live[0][0]]]
        while p >= 0:
            if p not in mine and ix.p_flags[p] & COMMITTED and not ix.t_state[ix.p_tid[p]]:
                return True
            p = ix.p_knext[p]
        return False

    def commit_tails(self) -> bool:
        """Whether a commit takes the tails due itself: always without ``busy``, else once the
        loop has had work for the idle turns and no idle turn for ``TAILS_WAIT_S``."""
        if not self.tails:
            return True
        return bool(self.waiting_since) and time.monotonic() - self.waiting_since > TAILS_WAIT_S

    def settle(self) -> None:
        """Evict the tails due now (before the orphans are counted: a stats call may come
        between a commit and the loop's next idle turn)."""
        self.evictor.evict_pages(self.policy.stale())

    def _target(self, stride: int) -> int:
        return max(stride, int(self.ahead * self.records.alloc.capacity_bytes))

    def _short(self) -> int:
        """A pressed class below its target (0: none)."""
        alloc = self.records.alloc
        for stride in self.pressed:
            if alloc.free_bytes(stride) < self._target(stride):
                return stride
        return 0

    def _state(self) -> tuple[int, int, int]:
        ix = self.records
        return ix.tick, ix.committed_count, ix.evictions

    def wanted(self) -> bool:
        """Whether ``step`` has work: a victim set begun, tails due within ``EARLY`` ticks
        (``policy.stale``; with ``busy``), or a pressed class short of room; not while
        nothing changed since the policy last named nothing that could go."""
        ix = self.records
        if self._blocked is not None and self._blocked != self._state():
            self._blocked = None
        if self._queue or self._blocked is None and (
                (self.tails and self.policy.stale_due(EARLY))
                or (self.ahead and self.pressed and self._short())):
            if not self.waiting_since:
                self.waiting_since = time.monotonic()
            return True
        self.waiting_since = 0.0
        return False

    def _victims(self) -> list[int] | None:
        """The next victim set: tails due first, then room for a short class (None: no work;
        [] nothing that may go)."""
        ix = self.records
        asked = False
        if self.tails and self.policy.stale_due(EARLY):
            asked = True
            pages = self.policy.stale(EARLY)
            if pages:
                return pages
        stride = self._short() if self.ahead and self.pressed else 0
        if stride:
            return self.policy.make_room(stride)
        return [] if asked else None

    def step(self, busy: Callable[[], bool] | None = None, pages: int = STEP_PAGES) -> int:
        """Evict up to ``pages`` pages ahead, stopping early once ``busy()`` (default
        ``self.busy``: a request waits); returns the pages evicted."""
        ix, done, queue = self.records, 0, self._queue
        busy = busy or self.busy
        self.waiting_since = 0.0
        while done < pages:
            if not queue:
                victims = self._victims() if self._blocked is None else None
                if victims is None:
                    break
                if not victims:
                    self._blocked = self._state()
                    break
                queue.extend((p, ix.p_gen[p], ix.p_used[p]) for p in reversed(victims))
                self._queue_evicted = 0
            got = self._next()
            if got:
                before, done = done, done + got
                if done // CHECK_EVERY != before // CHECK_EVERY and busy():
                    break
            if not queue and not self._queue_evicted:
                self._blocked = self._state()  # a set of which nothing could go
                break
        self.evicted += done
        return done

    def leaving(self) -> list[int]:
        """The page records of the victim set begun that are still there: going (the orphan
        count leaves them out)."""
        ix = self.records
        return [p for p, gen, _ in self._queue if ix.p_gen[p] == gen]
