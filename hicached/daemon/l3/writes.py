"""The write half of the L3 tier (``tier.L3Tier``, see its docstring for the policies): which
committed L2 pages go to L3 and when, and what a finished write changes.

Pages queued for or being written to L3 are pinned. Under write_back the dirty pages are pinned
anyway (L2 holds their only copy) and written under pressure; under write-through and selective
writes the pins are new, so they are bounded: past ``WRITING_MAX`` of the arena, new writes are
dropped (``l3_writes_dropped``; the pages stay in L2, evictable) rather than pinning the arena
full while L3 lags, which would leave sets no room.

``L3Writes`` owns the write half's state: the dirty pages (``dirty``), the put job of each
page being written (``put_job_of``), the pages an L2 flush drops once written
(``drop_when_written``), the bytes the writes pin (``writing_bytes``) and whether the last write
failed (``failing``). It mutates the pages' ``in_l3`` / ``writing`` flags and pins. The tier
builds it with itself and its collaborators: it reads the tier's backend, ``attached``, write
policy and threshold, submits its put jobs through the tier (``submit_job``), counts in the
tier's ``counters`` and tells the tier what the store holds (``remember``); the index pins,
unpins and drops pages, ``kv_events`` hears of pages stored. The tier hands it the put jobs it
collects (``done``). Control loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from hicached.daemon.index import Entry, PageIndex, TableId
from hicached.daemon.kv_events import NullKVEvents, l3_medium
from hicached.daemon.l3.workers import IOJob

if TYPE_CHECKING:  # (the tier builds this object: no import at run time)
    from hicached.daemon.l3.tier import L3Tier

log = logging.getLogger("hicached.daemon.l3.tier")

DIRTY_HIGH = 0.5  # write_back: start writing when dirty pages fill this share of the arena
DIRTY_TARGET = 0.4  # ... and write the oldest until they are below this share
HEADS_MAX = 4096  # pages of a chain written before one write_back pick at most
WRITING_MAX = 0.5  # share of the arena that pages waiting for their write may pin (not dirty)


class L3Writes:
    """What is written to L3 and when, and what a finished write changes; see the module
    docstring."""

    def __init__(self, tier: L3Tier, index: PageIndex, kv_events: NullKVEvents) -> None:
        self.tier = tier
        self.index = index
        self.kv_events = kv_events
        self.dirty: dict[Entry, None] = {}  # write_back: committed pages L3 lacks (pinned)
        self.put_job_of: dict[Entry, IOJob] = {}  # pages being written -> their put job
        self.drop_when_written: set[Entry] = set()  # flushed from L2 once in L3
        # bytes the pages queued for or being written to L3 pin (dirty ones, pinned anyway, not
        # counted), in all and per put job (id)
        self.writing_bytes = 0
        self._writing_of: dict[int, int] = {}
        self._failing = False  # the last write job stored nothing it sent

    @property
    def failing(self) -> bool:
        """The last write job of the attached backend stored nothing it sent."""
        return self._failing

    def on_attach(self) -> None:
        """A backend was attached: its writes have not failed yet."""
        self._failing = False

    def on_detach(self, name: str) -> None:
        """Backend ``name`` was detached: the dirty pages it never got stay in L2 only, unpinned
        (``Operations.detach_backend`` writes them first, within a bound), and the pages a flush
        left for their writes are no longer dropped once written."""
        if self.dirty:
            log.warning("L3 backend %s detached with %d write-back pages it never got: they "
                        "stay in L2 only", name, len(self.dirty))
            self.tier.counters["l3_dirty_dropped"] += len(self.dirty)
        for e in self.dirty:
            self.index.unpin(e)
        self.dirty.clear()
        self.drop_when_written.clear()

    def make_dirty(self, e: Entry) -> None:
        """write_back: ``e`` (committed) is dirty, pinned till it is written."""
        if e not in self.dirty:
            self.index.pin(e)
            self.dirty[e] = None

    def on_commit(self, entries: Sequence[Entry]) -> None:
        """Pages just committed: under write_through written now, under write_back dirty
        (pinned; the oldest written if dirty pages fill too much of the arena)."""
        tier = self.tier
        if not tier.attached or not entries:
            return
        if tier.write_policy == "write_through":
            self.write(entries)
        elif tier.write_policy == "write_back":
            for e in entries:
                if not e.in_l3:
                    self.make_dirty(e)
            self.relieve_pressure()

    def on_present(self, entries: Sequence[Entry]) -> None:
        """A set named pages L2 holds already: under write_through, those not known to be in
        L3 (their write was dropped, or the store lost them) are written now."""
        if self.tier.write_policy == "write_through" and self.tier.attached:
            self.write([e for e in entries if not e.in_l3 and not e.writing])

    @property
    def selective(self) -> bool:
        """Hits may start writes (``on_hit``)."""
        return self.tier.write_policy == "write_through_selective" and self.tier.attached

    def on_hit(self, e: Entry) -> None:
        """A get hit ``e``: under write_through_selective, written once its hits reach the
        threshold (a state only once its KV prefix is stored or being written)."""
        tier = self.tier
        if (tier.write_policy == "write_through_selective" and tier.attached
                and e.hits >= tier.threshold and not e.in_l3 and not e.writing
                and self._prefix_stored(e)):
            self.write([e])

    def _prefix_stored(self, e: Entry) -> bool:
        """A state (a trailing pool's page) is worth an L3 write only once its key's KV pages
        are stored or being written (``hybrid.py``: a state without its prefix restores
        nothing); any other page always is."""
        ix = self.index
        ns = e.table[0]
        trail = ix.trailing(ns)
        if not trail or not trail & ix.pool_bit(e.table):
            return True
        return all(p.in_l3 or p.writing for p in ix.key_pages(ns, e.key)
                   if not trail & ix.pool_bit(p.table))

    def relieve_pressure(self, force: bool = False) -> int:
        """write_back: write the least recently used dirty pages when they fill more than
        DIRTY_HIGH of the arena, or at least one when ``force`` (a reservation found no room),
        until the dirty pages not being written are below DIRTY_TARGET; returns how many."""
        if not self.dirty or not self.tier.attached:
            return 0
        arena = self.index.alloc.capacity_bytes
        todo = [e for e in self.dirty if not e.writing]
        dirty = sum(e.stride for e in todo)
        if not force and dirty <= DIRTY_HIGH * arena:
            return 0
        todo.sort(key=lambda e: e.last_used)
        pick = []
        for e in todo:
            if pick and dirty <= DIRTY_TARGET * arena:
                break
            pick.append(e)
            dirty -= e.stride
        n = self.write(self._heads_first(pick))
        self.tier.counters["write_backs"] += n
        return n

    def _heads_first(self, pick: list[Entry]) -> list[Entry]:
        """``pick`` with the dirty pages of each one's chain above it, each chain from its root
        side: the store is written heads before tails, so a crash never leaves it holding a
        tail whose head it lacks (``Records.parent_pages``: the chains the sets named)."""
        out: dict[Entry, None] = {}
        for e in pick:
            up, pages = [], [e]
            while pages and len(up) < HEADS_MAX:
                dirty = [p for p in pages if p in self.dirty and not p.writing and p not in out]
                if not dirty:
                    break
                up.append(dirty)
                pages = self.index.parent_pages(dirty[0])
            for group in reversed(up):
                out.update(dict.fromkeys(group))
        return list(out)

    def write_back_all(self, only: Iterable[Entry] | None = None) -> int:
        """Queue every dirty page (flush, shutdown, policy change; ``only``: those of them, a
        namespace's flush); returns how many."""
        todo = [e for e in (self.dirty if only is None else only)
                if e in self.dirty and not e.writing]
        n = self.write(todo) if self.tier.attached else 0
        self.tier.counters["write_backs"] += n
        return n

    def write(self, entries: Iterable[Entry], force: bool = False) -> int:
        """Send committed pages not known to be in L3 to the writer thread (pinned until
        written); it asks the store which it has first and sends only the others. ``force``:
        past the ``WRITING_MAX`` bound too (someone waits for these pages: ``store_now``)."""
        by_table: dict[TableId, list[Entry]] = {}
        for e in entries:
            if not e.in_l3 and not e.writing and e.committed:
                by_table.setdefault(e.table, []).append(e)
        tier = self.tier
        queued = 0
        room = WRITING_MAX * self.index.alloc.capacity_bytes
        for (ns, pool), todo in by_table.items():
            # dirty pages (write_back) are pinned already: their writes pin nothing more
            nbytes = sum(e.stride for e in todo if e not in self.dirty)
            job = IOJob("put", ns, pool, [e.key for e in todo], [e.offset for e in todo],
                        todo[0].page_bytes, todo, backend=tier.backend)
            if (not force and nbytes and self.writing_bytes
                    and self.writing_bytes + nbytes > room) or not tier.submit_job(job):
                tier.counters["l3_writes_dropped"] += len(todo)
                continue
            for e in todo:
                self.index.pin(e)
                e.writing = True
                self.put_job_of[e] = job
            self.writing_bytes += nbytes
            self._writing_of[id(job)] = nbytes
            queued += len(todo)
        return queued

    def store_now(self, entries: Sequence[Entry], waiter: Any) -> list[IOJob]:
        """Have committed ``entries`` stored in L3 now, whatever the write policy (a
        ``WaitStored``: the PD prefill publishes its pages to another node): those being
        written are waited for, the others written at once (write_back's dirty pages and pages
        below the selective threshold too; past ``WRITING_MAX``, as the caller's pages are few
        and waited for). ``waiter`` joins each put job; returns them. A page that is neither
        in L3 nor being written afterwards could not be queued (the writer's queue is full)."""
        jobs: dict[int, IOJob] = {}
        todo = []
        for e in entries:
            job = self.put_job_of.get(e)
            if job is not None:
                jobs[id(job)] = job
            elif not e.in_l3:
                todo.append(e)
        if todo:
            self.tier.counters["l3_forced_writes"] += self.write(todo, force=True)
            for e in todo:
                job = self.put_job_of.get(e)
                if job is not None:
                    jobs[id(job)] = job
        for job in jobs.values():
            job.waiters.append(waiter)
        return list(jobs.values())

    def _clean(self, e: Entry) -> None:
        """``e`` is in L3 now: no longer dirty."""
        e.in_l3 = True
        self.tier.remember(e.table, e.key)
        if self.dirty.pop(e, 0) is None:
            self.index.unpin(e)
        self._maybe_drop(e)

    def _maybe_drop(self, e: Entry) -> None:
        """A page flushed from L2 while an L3 write pinned it goes once nothing pins it."""
        if e in self.drop_when_written and not e.writing and e not in self.dirty:
            self.drop_when_written.discard(e)
            self.index.drop_one(e)  # unless a lease pins it now

    def lost_copy(self, e: Entry) -> None:
        """L3 may no longer hold ``e``: not clean, and under write_back dirty again (L2 may
        hold its only copy; its write asks the store first)."""
        tier = self.tier
        if e.in_l3 and tier.write_policy == "write_back" and tier.attached:
            self.make_dirty(e)
        e.in_l3 = False

    def done(self, job: IOJob, current: bool) -> None:
        """A finished put job (``current``: of the attached backend): its pages are clean
        (in L3) or, where it failed, in L2 only and no longer dirty."""
        counters = self.tier.counters
        ok_n = 0
        self.writing_bytes -= self._writing_of.pop(id(job), 0)
        if current:  # KV events, while the pages are pinned (their chain links in L2)
            self.kv_events.stored([e for e, ok in zip(job.entries, job.result) if ok],
                                  self.index.chain, l3_medium(job.backend.name))
        for e, ok in zip(job.entries, job.result):
            self.put_job_of.pop(e, None)
            e.writing = False
            self.index.unpin(e)
            ok_n += bool(ok)
            if ok and current:
                self._clean(e)
            elif e in self.dirty:
                # a failing L3 must not pin the arena full: the page stays in L2, evictable
                del self.dirty[e]
                self.index.unpin(e)
            self._maybe_drop(e)
        counters["l3_writes"] += ok_n - len(job.already)  # those L3 had were not sent
        counters["l3_write_failures"] += len(job.result) - ok_n
        if current and job.result:
            failing = ok_n == 0
            if failing != self._failing:
                log.log(logging.WARNING if failing else logging.INFO, "L3 %s writes %s",
                        job.backend.name, "fail (pages stay in L2 only)" if failing
                        else "succeed again")
                self._failing = failing
