"""A page's uses while it lives: touched (recency), read (a get's pages: recency, hits and the
lease's pins at once), pinned and unpinned, its hits counted.

One loop a call: at a get's 16-64 random pages the numpy calls and the slab counts by
``np.unique`` cost more than a tight loop; the policy hears of the pages at once
(``touched_many``). ``touch`` stays beside ``touch_many`` (as its batch of one it measured ~1 us
more a call, on the per-page loops that call it).
"""

from __future__ import annotations

from collections.abc import Sequence

from hicached.daemon.entry import COMMITTED, Entry
from hicached.daemon.eviction.interface import EvictionPolicy
from hicached.daemon.records import Records

HITS_MAX = 0x7FFFFFFF


class Uses:
    """Recency, pins and hits of live pages (module docstring). Owns nothing: writes the
    records' ``p_used``, ``p_pins``, ``p_hits`` and ``tick``, the slabs' ``last_used`` and
    ``pinned`` (``SlabAllocator.touch`` / ``touched``); calls the policy's ``touched`` /
    ``touched_many``. A pinned page is never evicted (``evict.py`` checks ``p_pins``)."""

    def __init__(self, records: Records, policy: EvictionPolicy):
        self.records = records
        self.alloc = records.alloc
        self.policy = policy

    def pin(self, entry: Entry) -> None:
        """Keep ``entry`` from eviction (lease, reservation, L3 I/O in flight)."""
        r = self.records
        p = entry.rec
        assert r.p_gen[p] == entry.gen, entry
        if r.p_pins[p] == 0:
            self.alloc.slab_of(entry.slot_offset).pinned += 1
        r.p_pins[p] += 1

    def unpin(self, entry: Entry) -> None:
        """Undo one ``pin`` of ``entry``."""
        r = self.records
        p = entry.rec
        assert r.p_gen[p] == entry.gen and r.p_pins[p] > 0, entry
        r.p_pins[p] -= 1
        if r.p_pins[p] == 0:
            self.alloc.slab_of(entry.slot_offset).pinned -= 1

    def touch(self, entry: Entry) -> None:
        """Mark ``entry`` most recently used: ``touch_many`` of one page, kept on its own for
        the per-page loops that call it (pages read without a lease, present keys of a set):
        ``touch_many((entry,))`` measured 1.8-2.6 us a call against 1.0-1.2 (lru)."""
        r = self.records
        p = entry.rec
        if r.p_gen[p] != entry.gen:
            return
        r.tick = tick = r.tick + 1
        r.p_used[p] = tick
        self.alloc.touch(entry.offset, tick)
        if r.p_flags[p] & COMMITTED:
            self.policy.touched(p)

    def touch_many(self, entries: Sequence[Entry]) -> None:
        """``touch`` of each of ``entries`` in turn, in one pass: ``read_many`` of those still
        in their slot, counting no hit and pinning nothing."""
        gen = self.records.p_gen
        self.read_many([e for e in entries if gen[e.rec] == e.gen], pin=False, hit=False)

    def read_many(self, entries: Sequence[Entry], pin: bool = True, hit: bool = True) -> None:
        """A get's pages, just looked up (each alive): ``touch_many``, ``count_hits`` and
        ``pin_many`` of ``entries`` in one pass, the state they leave called in turn (the
        lease that pins them: ``LeaseTable.new_lease(..., pinned=True)``). ``pin`` False: the
        caller pinned them already (``pin_many``; the pins do not touch what this writes);
        ``hit`` False: no hit counted (``touch_many``)."""
        r = self.records
        gen, used, flags = r.p_gen, r.p_used, r.p_flags
        hits, pins = r.p_hits, r.p_pins
        slabs, slab_bytes = self.alloc.slabs, self.alloc.slab_bytes
        touched: dict = {}  # slab -> None, in the order of their last touch
        ps, ticks = [], []  # the committed pages, for the policy
        tick = r.tick
        for e in entries:
            p = e.rec
            assert gen[p] == e.gen, e
            tick += 1
            used[p] = tick
            slab = slabs[e.slot_offset // slab_bytes]
            slab.last_used = tick
            touched.pop(slab, None)
            touched[slab] = None
            if flags[p] & COMMITTED:
                ps.append(p)
                ticks.append(tick)
            if hit and hits[p] < HITS_MAX:
                hits[p] += 1
            if pin:
                if not pins[p]:
                    slab.pinned += 1
                pins[p] += 1
        r.tick = tick
        self.alloc.touched(touched)
        if ps:
            self.policy.touched_many(ps, ticks)

    def pin_many(self, entries: Sequence[Entry]) -> None:
        """``pin`` of each of ``entries``."""
        r = self.records
        gen, pins = r.p_gen, r.p_pins
        slabs, slab_bytes = self.alloc.slabs, self.alloc.slab_bytes
        for e in entries:
            p = e.rec
            assert gen[p] == e.gen, e
            if pins[p] == 0:
                slabs[e.slot_offset // slab_bytes].pinned += 1
            pins[p] += 1

    def unpin_many(self, entries: Sequence[Entry]) -> None:
        """``unpin`` of each of ``entries``."""
        r = self.records
        gen, pins = r.p_gen, r.p_pins
        slabs, slab_bytes = self.alloc.slabs, self.alloc.slab_bytes
        for e in entries:
            p = e.rec
            assert gen[p] == e.gen and pins[p] > 0, e
            pins[p] -= 1
            if pins[p] == 0:
                slabs[e.slot_offset // slab_bytes].pinned -= 1

    def count_hits(self, entries: Sequence[Entry]) -> None:
        """One more hit for each of ``entries`` (those still in their slot)."""
        r = self.records
        gen, hits = r.p_gen, r.p_hits
        for e in entries:
            p = e.rec
            if gen[p] == e.gen and hits[p] < HITS_MAX:
                hits[p] += 1

