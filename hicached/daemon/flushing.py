"""Flushing L2 in slices of the control loop.

Dropping one page is a few µs of index work, so an L2 of millions of pages would hold the
control loop, and every engine's requests with it, for seconds (longer than a client's
deadline). ``L2Flush`` walks the arena slab by slab instead, at most ``slice_s`` of work per turn
of the loop (``Daemon.serve_forever`` calls ``step`` while ``active``), and requests go on being
answered between the slices.

What a flush drops: every page that was committed and unpinned when the walk reached its slot.
So each page committed before the flush was asked for is gone when it is answered, unless a
lease pins it. A page an L3 write pins (write-through, or a dirty page under write_back, which
the flush has written first) is dropped once written (``L3Writes.drop_when_written``), and the
walk's waiters are answered only then (``settle``, each turn of the loop): a flush that was
answered left no page of its scope in L2 but leased ones, whatever the L3 writer's pace. A page
committed while the walk runs may stay. A flush asked
for while a walk is under way joins it if the walk has not left its first slab yet; otherwise
it gets a walk of its own once the running one ends (the running walk already passed slots
that may hold pages committed before the new request).

A flush may name a namespace (its digest, ``Flush.namespace``): the walk then drops only that
namespace's pages (with the pages that depend on them, which are its own: chains never cross
namespaces), and its waiter is answered with that namespace's count. Walks are shared as above:
a walk drops the pages of every namespace its waiters named (every page when one named none).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from hicached.daemon.l3.tier import L3Tier

log = logging.getLogger(__name__)

SLICE_S = 0.005  # index work per turn of the loop: a request waits at most about this long
CHECK_EVERY = 256  # slots between two looks at the clock


class L2Flush:
    """See the module docstring. Only the control loop calls it."""

    def __init__(self, tier: L3Tier, slice_s: float = SLICE_S,
                 clock: Callable[[], float] = time.perf_counter):
        self.tier = tier
        self.index = tier.index
        self.slice_s = slice_s
        self.clock = clock
        # (namespace digest, or None: every page; done): answered when this walk ends, or
        # (queued) after a walk of their own
        self.waiters: list[tuple[str | None, Callable[[int], None]]] = []
        self.queued: list[tuple[str | None, Callable[[int], None]]] = []
        self.scope: set[str] | None = None  # the namespaces this walk drops (None: every page)
        self.slab = -1  # next slab of the walk (-1: none under way)
        self.slot = 0  # next slot in it
        self.dropped = 0
        self.dropped_of: dict[str, int] = {}  # pages dropped by this walk, per namespace digest
        self.slices = 0  # slices of the walk so far
        self.started = 0.0
        # walks done whose waiters wait for pages an L3 write pinned: (those pages, answers)
        self.settling: list[tuple[set, list[tuple[Callable[[int], None], int]]]] = []

    @property
    def active(self) -> bool:
        return self.slab >= 0

    def request(self, done: Callable[[int], None], ns: str | None = None) -> None:
        """Flush L2 (``ns``: only the pages of that namespace digest); ``done(pages dropped)``
        runs on the control loop when it is done."""
        if self.active and (self.slab, self.slot) != (0, 0):
            self.queued.append((ns, done))
            return
        self.waiters.append((ns, done))
        self._begin()  # (again, for a walk not yet started: its scope may have grown)

    def _begin(self) -> None:
        names = [ns for ns, _ in self.waiters]
        self.scope = None if None in names else set(names)
        w = self.tier.writes
        if w.dirty and self.tier.attached:  # write_back: every dirty page is written, dropped
            mine = [e for e in w.dirty if self.scope is None or e.table[0] in self.scope]
            w.drop_when_written.update(mine)
            w.write_back_all(mine)
        self.slab, self.slot, self.dropped, self.slices = 0, 0, 0, 0
        self.dropped_of = {}
        self.started = self.clock()

    def step(self) -> None:
        """One slice of the walk (at most ``slice_s``, a slab's ``CHECK_EVERY`` slots at least);
        answers the waiters when the walk reaches the end of the arena."""
        if not self.active:
            return
        self.slices += 1
        try:
            self._walk(self.clock() + self.slice_s)
        except Exception:  # a bug ends this walk (its waiters answered), never loops forever
            log.exception("L2 flush failed after %d pages; answering its waiters", self.dropped)
            self._finish()

    def _walk(self, deadline: float) -> None:
        slabs = self.index.alloc.slabs
        at, drop_one = self.index.at, self.index.drop_one
        writing = self.tier.writes.drop_when_written
        scope, dropped_of = self.scope, self.dropped_of
        while self.slab < len(slabs):
            slab = slabs[self.slab]
            end = slab.num_slots if slab.stride else 0
            while self.slot < end:
                stop = min(end, self.slot + CHECK_EVERY)
                for k in range(self.slot, stop):
                    e = at(slab.offset + k * slab.stride)
                    if e is not None and e.committed and (scope is None
                                                          or e.table[0] in scope):
                        if e.writing:
                            writing.add(e)
                        else:
                            n = drop_one(e)  # with the pages that depend on it
                            self.dropped += n
                            ns = e.table[0]
                            dropped_of[ns] = dropped_of.get(ns, 0) + n
                self.slot = stop
                if self.clock() >= deadline:
                    return
            self.slab, self.slot = self.slab + 1, 0
        self._finish()

    def finish_now(self) -> None:
        """Run the walks asked for to their end at once and answer every waiter, also those
        whose pages wait for an L3 write (shutdown; a flush made on the loop's own thread)."""
        slice_s, self.slice_s = self.slice_s, float("inf")
        try:
            while self.active:
                self.step()
        finally:
            self.slice_s = slice_s
        settling, self.settling = self.settling, []
        for _, answers in settling:
            self._answer(answers)

    def settle(self) -> None:
        """Answer the walks done whose pages pinned by L3 writes have left ``drop_when_written``
        (written and dropped, or the backend detached). The loop calls it each turn while
        ``settling``: a set lookup per page still waiting."""
        pending = self.tier.writes.drop_when_written
        still = []
        for pages, answers in self.settling:
            pages.intersection_update(pending)
            if pages:
                still.append((pages, answers))
            else:
                self._answer(answers)
        self.settling = still

    def _finish(self) -> None:
        pinned = self.tier.writes.drop_when_written
        scope = self.scope
        if scope is not None:
            pinned = {e for e in pinned if e.table[0] in scope}
        later = collections.Counter(e.table[0] for e in pinned)
        n = self.dropped + sum(later.values())
        log.info("flushed %d pages from L2 in %.2f s (%d slices of the loop)%s", n,
                 self.clock() - self.started, self.slices,
                 "" if self.scope is None else f" of {len(self.scope)} namespace(s)")
        waiters, self.waiters = self.waiters, []
        dropped_of = self.dropped_of
        self.slab = -1
        if self.queued:
            self.waiters, self.queued = self.queued, []
            self._begin()
        answers = [(done, n if ns is None else dropped_of.get(ns, 0) + later[ns])
                   for ns, done in waiters]
        if pinned:  # answered once those pages are written and dropped (``settle``)
            self.settling.append((set(pinned), answers))
        else:
            self._answer(answers)

    @staticmethod
    def _answer(answers: list[tuple[Callable[[int], None], int]]) -> None:
        for done, n in answers:
            try:
                done(n)
            except Exception:  # one waiter's bug must not cost the others their answer
                log.exception("answering a flush failed")

    def status(self) -> dict | None:
        """The walk under way (stats, ``hicached status``), or None."""
        if not self.active:
            if self.settling:
                return {"slab": len(self.index.alloc.slabs),
                        "slabs": len(self.index.alloc.slabs), "dropped": self.dropped,
                        "waiting": sum(len(a) for _, a in self.settling),
                        "seconds": round(self.clock() - self.started, 3),
                        "writing": sum(len(p) for p, _ in self.settling)}
            return None
        return {"slab": self.slab, "slabs": len(self.index.alloc.slabs), "dropped": self.dropped,
                "waiting": len(self.waiters) + len(self.queued),
                "seconds": round(self.clock() - self.started, 3)}
