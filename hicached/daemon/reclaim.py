"""Evicting ahead: the control loop's idle turns free room before the sets need it.

A reservation that finds its size class full evicts on the request path (``PageIndex._make_room``),
and under the hybrid controller a victim is a whole leaf segment: a state takes the KV pages only
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
together: ``KeyTree._pages``) go in one go, never some now and the rest in a later turn: a
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
are going (``leaving``: the orphan count leaves them out).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hicached.daemon.entry import COMMITTED

STEP_PAGES = 64  # pages one ``step`` evicts (at most that, and the rest of the key it is at)
# ticks before its grace ends that a tail goes (``policy.stale``): in an idle turn that comes
# before the tail would count as an orphan, not after
EARLY = 512
CHECK_EVERY = 2  # pages between two looks at whether a request waits (at a key's end)
TAILS_WAIT_S = 0.01  # a commit takes the tails due itself once the loop had no idle turn as long


class Reclaimer:
    """Keeps ``ahead`` (a share of the arena, 0: off) free in each pressed size class of
    ``index`` (``PageIndex``); ``wanted`` / ``step`` from the control loop."""

    def __init__(self, index, ahead: float):
        self.ix = index
        self.ahead = ahead
        self.evicted = 0  # pages evicted ahead (stats)
        self._queue: list[tuple[int, int, int]] = []  # (page, gen, used), the next one last
        self._queue_evicted = 0  # pages of the current victim set evicted so far
        self._blocked: tuple[int, int, int] | None = None  # the index's state when nothing could go
        self.busy: Callable[[], bool] = lambda: False
        self.tails = False  # take the tails of ``policy.stale`` early (``attach``)
        self.waiting_since = 0.0  # since when ``wanted`` has said yes and no ``step`` ran

    def attach(self, ahead: float, busy: Callable[[], bool]) -> None:
        """A daemon's: its loop steps while idle (``busy()``: a request waits) and takes the
        tails ``EARLY`` before they are due (a commit would take them then, on a set's path)."""
        self.ahead, self.busy, self.tails = ahead, busy, True
        self.ix.commit_tails = self._commit_tails
        self.ix.defer, self.ix.take_deferred = self._defer, self.take

    def set_ahead(self, ahead: float) -> None:
        """A reload's (SIGHUP): the share of the arena kept free from the next idle turn on."""
        self.ahead = ahead

    def _defer(self, pages: list[int]) -> None:
        """The rest of a leaf segment a reservation split (``PageIndex._evict_victims``): it
        goes after the victim set begun, in its order, with the same checks."""
        ix = self.ix
        self._queue[:0] = [(p, ix.p_gen[p], ix.p_used[p]) for p in reversed(pages)]

    def take(self, stride: int, need: int) -> int:
        """Evict queued pages of class ``stride`` (the next ones in the queue, while they are of
        it) until the class has ``need`` free slots: a reservation takes the dead tails left
        for the idle turns before the policy names live pages. Returns the pages evicted (on
        the reservation's path: not counted in ``evicted``, the pages evicted ahead)."""
        ix, queue, done = self.ix, self._queue, 0
        while queue and stride in (ix.p_stride[p] for p, _, _ in self._key_run()):
            if ix.alloc.free_slots(stride) >= need:
                break
            got = self._next()
            if got is None:
                break
            done += got
        return done

    def _key_run(self) -> list[tuple[int, int, int]]:
        """The queue's next entries that belong to one key (its pages in the set, with the
        entries of pages gone meanwhile among them), the next one first."""
        ix, queue = self.ix, self._queue
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
        ix, queue = self.ix, self._queue
        run = self._key_run()
        del queue[len(queue) - len(run):]
        live = [(p, used) for p, gen, used in run
                if ix.p_gen[p] == gen and ix.p_flags[p] & COMMITTED]
        if not live:
            return 0  # gone another way (which took its dependants first): the rest may go
        policy = ix.policy
        if any(ix.p_pins[p] or ix.p_used[p] != used or not policy.may_go_ahead(p)
               for p, used in live) or (policy.whole_keys and self._more_pages(live)):
            queue.extend(reversed(run))  # read, or depended on, since: the set ends
            policy.abandoned([q for q, g, _ in queue if ix.p_gen[q] == g])
            queue.clear()
            return None
        got = ix.evict_pages([p for p, _ in live])
        self._queue_evicted += got
        return got

    def _more_pages(self, live: list[tuple[int, int]]) -> bool:
        """Whether the key of ``live`` (its pages in the set, not states alone) holds a
        committed page that is no state and not in the set (stored since the policy named
        it): taking the set's pages would leave that page of the key without the others."""
        ix = self.ix
        if all(ix.t_state[ix.p_tid[p]] for p, _ in live):
            return False  # states alone (a mid-chain state): the key's other pages stay
        mine = {p for p, _ in live}
        p = ix.k_head[ix.p_krec[live[0][0]]]
        while p >= 0:
            if p not in mine and ix.p_flags[p] & COMMITTED and not ix.t_state[ix.p_tid[p]]:
                return True
            p = ix.p_knext[p]
        return False

    def _commit_tails(self) -> bool:
        """Whether a commit takes the tails due itself: the loop has had work for the idle
        turns and no idle turn for ``TAILS_WAIT_S``."""
        return bool(self.waiting_since) and time.monotonic() - self.waiting_since > TAILS_WAIT_S

    def settle(self) -> None:
        """Evict the tails due now (before the orphans are counted: a stats call may come
        between a commit and the loop's next idle turn)."""
        self.ix.evict_pages(self.ix.policy.stale())

    def _target(self, stride: int) -> int:
        return max(stride, int(self.ahead * self.ix.alloc.capacity_bytes))

    def _short(self) -> int:
        """A pressed class below its target (0: none)."""
        alloc = self.ix.alloc
        for stride in self.ix.pressed:
            if alloc.free_bytes(stride) < self._target(stride):
                return stride
        return 0

    def _state(self) -> tuple[int, int, int]:
        ix = self.ix
        return ix.tick, ix.committed_count, ix.evictions

    def wanted(self) -> bool:
        """Whether ``step`` has work: a victim set begun, tails due within ``EARLY`` ticks
        (``policy.stale``; once ``attach``-ed), or a pressed class short of room; not while
        nothing changed since the policy last named nothing that could go."""
        ix = self.ix
        if self._blocked is not None and self._blocked != self._state():
            self._blocked = None
        if self._queue or self._blocked is None and (
                (self.tails and ix.policy.stale_due(EARLY))
                or (self.ahead and ix.pressed and self._short())):
            if not self.waiting_since:
                self.waiting_since = time.monotonic()
            return True
        self.waiting_since = 0.0
        return False

    def _victims(self) -> list[int] | None:
        """The next victim set: tails due first, then room for a short class (None: no work;
        [] nothing that may go)."""
        ix = self.ix
        asked = False
        if self.tails and ix.policy.stale_due(EARLY):
            asked = True
            pages = ix.policy.stale(EARLY)
            if pages:
                return pages
        stride = self._short() if self.ahead and ix.pressed else 0
        if stride:
            return ix.policy.make_room(stride)
        return [] if asked else None

    def step(self, busy: Callable[[], bool] | None = None, pages: int = STEP_PAGES) -> int:
        """Evict up to ``pages`` pages ahead, stopping early once ``busy()`` (default
        ``self.busy``: a request waits); returns the pages evicted."""
        ix, done, queue = self.ix, 0, self._queue
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
        ix = self.ix
        return [p for p, gen, _ in self._queue if ix.p_gen[p] == gen]
