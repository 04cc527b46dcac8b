"""The page index's per-call paths: a call's pages reserved, committed, touched, pinned and
counted in a few numpy passes instead of a Python loop per page.

A set of 128 pages used to cost the control loop ~5 us a page in ``reserve`` and ``commit``
(issue 24: a dozen record writes through memoryviews, the key table's scalar probes, a policy
call, per page), against ~2 us with the dict index before it. Here each column of the records is
written once per call by fancy assignment, slots come off a slab's free stack a run at a time
(``SlabAllocator.alloc_many``), and the eviction policy hears of the call's pages at once
(``inserted_many`` / ``touched_many``).

What must stay true: every call here leaves exactly the state of its pages done one by one in
turn (the page-by-page paths: ``reserve``, ``_commit_each``, ``touch``) (records, slots,
generations, ticks, recency lists,
slab ages, the presence table's bytes). So a call takes the vectorised path only where the
order of its pages cannot matter (a call that must evict for its slots takes the slots each
victim frees together: ``reserving.py``); everything else (a fingerprint collision, keys the
records cannot hold inline, an entry that is not in the state the call expects) goes through the
scalar path, page by page, as before. The key table's layout may
differ (where an insert lands in its probe run): no lookup can tell.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from hicached.daemon.entry import (
    COMMITTED,
    PENDING,
    Entry,
)
from hicached.daemon.reserving import BATCH_MIN, ReserveOps
from hicached.presence import fingerprints

if TYPE_CHECKING:
    from hicached.daemon.index import PageIndex

HITS_MAX = 0x7FFFFFFF


def handles(entries: Sequence[Entry]) -> tuple[np.ndarray, np.ndarray]:
    """(page records, generations) of ``entries`` as int64 arrays."""
    n = len(entries)
    return (np.fromiter((e.rec for e in entries), np.int64, n),
            np.fromiter((e.gen for e in entries), np.int64, n))


class BatchOps(ReserveOps):
    """``PageIndex``'s vectorised calls (see the module docstring; reservations:
    ``reserving.py``); a mixin over ``Records`` whose scalar twins (``reserve``, ``touch``, ...)
    ``PageIndex`` defines."""

    # ------------------------------------------------------------ commit

    def commit_many(self: PageIndex, entries: Sequence[Entry], events: bool = True) -> None:
        """Publish pending entries, in turn, in one pass (a call's pages: the slabs' recency
        once). Every entry must be pending and pinned, each once; the state afterwards is
        exactly that of committing them one by one (``commit``): in particular a call's pages
        are the most recently used in its order, and the policy hears of them in that order
        (``inserted_many``: what it needs of the state between two of them is given).
        ``events`` False: no KV events (a commit in slices tells its pages at its end)."""
        n = len(entries)
        if n < BATCH_MIN:
            return self._commit_each(entries, events)
        ps, gens = handles(entries)
        cols = self.np
        flags = cols["p_flags"][ps]
        bad = cols["p_gen"][ps] != gens  # (count_nonzero: cheaper than any() on a few pages)
        bad |= (flags & PENDING) == 0
        bad |= cols["p_pins"][ps] <= 0
        ps_list = ps.tolist()
        if np.count_nonzero(bad) or len(set(ps_list)) != n:
            return self._commit_each(entries, events)  # raises where one by one raises
        pending = self.pending
        for e in entries:
            pend = pending[e.table]
            del pend[e.key]
            if not pend:
                del pending[e.table]
        cols["p_flags"][ps] = (flags & np.uint8(0xFF ^ PENDING)) | COMMITTED
        if self.owners:
            pop = self.owners.pop
            for p in ps_list:
                pop(p, None)
        tids = cols["p_tid"][ps]
        if not np.count_nonzero(tids != tids[0]):
            self._tcount[tids[0]] += n
        else:
            for tid, count in zip(*np.unique(tids, return_counts=True)):
                self._tcount[tid] += int(count)
        self.committed_count += n
        krecs = cols["p_krec"][ps]
        bits = np.asarray(self.t_bit, np.int64)[tids]
        masks = cols["k_mask"]
        mask_before = masks[krecs]
        if len(set(krecs.tolist())) == n:
            masks[krecs] = mask_before | bits
            firsts = None
        else:  # a key's pages in several pools: each key once, where it first comes
            np.bitwise_or.at(masks, krecs, bits)
            firsts = np.sort(np.unique(krecs, return_index=True)[1])
        if self.shared is not None:
            self._publish(entries, ps, krecs, mask_before, firsts)
        tick = self._tick
        used = cols["p_used"]
        used_before = used[ps]
        used[ps] = np.arange(tick + 1, tick + 1 + n, dtype=np.int64)
        self._tick = tick + n
        self.policy.inserted_many(ps, used_before, mask_before)
        offsets = cols["p_off"][ps]
        pins = cols["p_pins"]
        pins[ps] -= 1  # unpinned: a pending page's reservation pin
        self._touch_slabs(offsets // self.alloc.slab_bytes, tick)
        self._count_pinned(offsets[pins[ps] == 0], -1)
        if self.event_tids and events:
            self.kv_events.stored(entries)
        if self.commit_tails():  # (a daemon's idle turns take them: ``reclaim.py``)
            self.evict_pages(self.policy.stale())  # pages no hit can use (``hybrid.py``)

    def _publish(self: PageIndex, entries: Sequence[Entry], ps: np.ndarray, krecs: np.ndarray,
                 mask_before: np.ndarray, firsts: np.ndarray | None) -> None:
        """Publish a commit's changed masks (and its large pages' slot tags) in the shared
        presence table, as ``commit`` of each page does (``PresenceTable.set_many``: the same
        bytes), its keys fingerprinted in one call (``presence.fingerprints``) where they are
        of one namespace. ``firsts``: the position of each key's first page (None: every page
        is its key's only one)."""
        cols, shared = self.np, self.shared
        pos = np.arange(len(ps)) if firsts is None else firsts
        keys = krecs[pos]
        sfps = cols["k_sfp"][keys]
        todo = np.flatnonzero(sfps == 0)
        if len(todo):
            ns = cols["k_ns"][keys[todo]]
            if not np.count_nonzero(ns != ns[0]):
                fps = fingerprints(self.seed(self._ns_names[ns[0]]),
                                   [entries[i].key for i in pos[todo].tolist()])
                if fps is not None:
                    sfps[todo] = fps
                    cols["k_sfp"][keys[todo]] = fps
        new = cols["k_mask"][keys]
        changed = np.flatnonzero(new != mask_before[pos])
        sfps, new = sfps[changed], new[changed]
        for j in np.flatnonzero(sfps == 0).tolist():  # fingerprinted one by one
            sfps[j] = self._sfp(int(keys[changed[j]]))
        shared.set_many(sfps, new)
        if shared.tag_count and np.count_nonzero(cols["p_stride"][ps] >= shared.grain):
            for e in entries:
                shared.publish_tag(e.slot_offset, e.stride, e.gen)

    def _touch_slabs(self: PageIndex, slab_ids: np.ndarray, tick: int) -> None:
        """The pages in slabs ``slab_ids`` were used at ticks ``tick + 1``, ``tick + 2``, ...
        in turn: each slab's ``last_used`` is its last page's, and they become their class's
        most recently used in the order of their last page (``SlabAllocator.touched``)."""
        slabs = self.alloc.slabs
        n = len(slab_ids)
        if slab_ids[0] == slab_ids[-1] and not np.count_nonzero(slab_ids != slab_ids[0]):
            slab = slabs[slab_ids[0]]
            slab.last_used = tick + n
            self.alloc.touched((slab,))
            return
        ids, last = np.unique(slab_ids[::-1], return_index=True)
        last = n - 1 - last  # the position of each slab's last page
        order = np.argsort(last)
        touched = []
        for i, pos in zip(ids[order].tolist(), last[order].tolist()):
            slab = slabs[i]
            slab.last_used = tick + 1 + pos
            touched.append(slab)
        self.alloc.touched(touched)

    def _commit_each(self: PageIndex, entries: Sequence[Entry], events: bool = True) -> None:
        """``commit_many`` one page after the other (few pages, or a page not as it should be:
        the AssertionError is raised where committing one by one raises it)."""
        shared, alloc, policy = self.shared, self.alloc, self.policy
        slabs, slab_bytes = alloc.slabs, alloc.slab_bytes
        flags, pins, used, mask_of = self.p_flags, self.p_pins, self.p_used, self.k_mask
        touched: dict = {}  # slab -> None, in the order of their last touch
        owners = self.owners
        tick = self._tick
        masks_before: dict[int, int] = {}  # key record -> its mask before the call
        for e in entries:
            p = e.rec
            if self.p_gen[p] != e.gen or not flags[p] & PENDING:
                raise AssertionError(f"{e!r} is not pending")
            pend = self.pending[e.table]
            del pend[e.key]
            if not pend:
                del self.pending[e.table]
            flags[p] = (flags[p] & ~PENDING) | COMMITTED
            if owners:
                owners.pop(p, None)
            tid = self.p_tid[p]
            self._tcount[tid] += 1
            self.committed_count += 1
            k = self.p_krec[p]
            masks_before.setdefault(k, mask_of[k])
            mask_of[k] |= self.t_bit[tid]
            if shared is not None:
                shared.publish_tag(e.slot_offset, e.stride, e.gen)
            tick += 1
            used[p] = tick
            policy.inserted(p)
            slab = slabs[e.slot_offset // slab_bytes]
            slab.last_used = tick
            touched.pop(slab, None)
            touched[slab] = None
            if pins[p] <= 0:
                raise AssertionError(f"{e!r} is not pinned")
            pins[p] -= 1  # unpin
            if pins[p] == 0:
                slab.pinned -= 1
        if shared is not None:  # each key's mask once, with all its pools of the call: a
            for k, old in masks_before.items():  # reader of the table never sees one without
                if mask_of[k] != old:  # the others (as ``_publish``)
                    shared.set(self._sfp(k), mask_of[k])
        self._tick = tick
        alloc.touched(touched)
        if self.event_tids and events:
            self.kv_events.stored(entries)
        if self.commit_tails():
            self.evict_pages(policy.stale())  # pages no hit can use any more (``hybrid.py``)

    # ------------------------------------------------------------ recency, pins, hits
    # (one loop a call: at a get's 16-64 random pages the numpy calls and the slab counts by
    # ``np.unique`` cost more than a tight loop; the policy hears of the pages at once)

    def touch_many(self: PageIndex, entries: Sequence[Entry]) -> None:
        """``touch`` of each of ``entries`` in turn, in one pass (a get's pages)."""
        gen, used, flags = self.p_gen, self.p_used, self.p_flags
        slabs, slab_bytes = self.alloc.slabs, self.alloc.slab_bytes
        touched: dict = {}  # slab -> None, in the order of their last touch
        ps, ticks = [], []  # the committed pages, for the policy
        tick = self._tick
        for e in entries:
            p = e.rec
            if gen[p] != e.gen:
                continue
            tick += 1
            used[p] = tick
            slab = slabs[e.slot_offset // slab_bytes]
            slab.last_used = tick
            touched.pop(slab, None)
            touched[slab] = None
            if flags[p] & COMMITTED:
                ps.append(p)
                ticks.append(tick)
        self._tick = tick
        self.alloc.touched(touched)
        if ps:
            self.policy.touched_many(ps, ticks)

    def read_many(self: PageIndex, entries: Sequence[Entry], pin: bool = True) -> None:
        """A get's pages, just looked up (each alive): ``touch_many``, ``count_hits`` and
        ``pin_many`` of ``entries`` in one pass, the state they leave called in turn (the
        lease that pins them: ``LeaseTable.new_lease(..., pinned=True)``). ``pin`` False: the
        caller pinned them already (``pin_many``; the pins do not touch what this writes)."""
        gen, used, flags = self.p_gen, self.p_used, self.p_flags
        hits, pins = self.p_hits, self.p_pins
        slabs, slab_bytes = self.alloc.slabs, self.alloc.slab_bytes
        touched: dict = {}  # slab -> None, in the order of their last touch
        ps, ticks = [], []  # the committed pages, for the policy
        tick = self._tick
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
            if hits[p] < HITS_MAX:
                hits[p] += 1
            if pin:
                if not pins[p]:
                    slab.pinned += 1
                pins[p] += 1
        self._tick = tick
        self.alloc.touched(touched)
        if ps:
            self.policy.touched_many(ps, ticks)

    def pin_many(self: PageIndex, entries: Sequence[Entry]) -> None:
        """``pin`` of each of ``entries``."""
        gen, pins = self.p_gen, self.p_pins
        slabs, slab_bytes = self.alloc.slabs, self.alloc.slab_bytes
        for e in entries:
            p = e.rec
            assert gen[p] == e.gen, e
            if pins[p] == 0:
                slabs[e.slot_offset // slab_bytes].pinned += 1
            pins[p] += 1

    def unpin_many(self: PageIndex, entries: Sequence[Entry]) -> None:
        """``unpin`` of each of ``entries``."""
        gen, pins = self.p_gen, self.p_pins
        slabs, slab_bytes = self.alloc.slabs, self.alloc.slab_bytes
        for e in entries:
            p = e.rec
            assert gen[p] == e.gen and pins[p] > 0, e
            pins[p] -= 1
            if pins[p] == 0:
                slabs[e.slot_offset // slab_bytes].pinned -= 1

    def count_hits(self: PageIndex, entries: Sequence[Entry]) -> None:
        """One more hit for each of ``entries`` (those still in their slot)."""
        gen, hits = self.p_gen, self.p_hits
        for e in entries:
            p = e.rec
            if gen[p] == e.gen and hits[p] < HITS_MAX:
                hits[p] += 1

    def _count_pinned(self: PageIndex, offsets: np.ndarray, delta: int) -> None:
        """``delta`` more pinned pages in the slab of each of ``offsets``."""
        if not len(offsets):
            return
        slabs = self.alloc.slabs
        ids = offsets // self.alloc.slab_bytes
        if ids[0] == ids[-1] and not np.count_nonzero(ids != ids[0]):
            slabs[ids[0]].pinned += delta * len(ids)
            return
        for i in ids.tolist():
            slabs[i].pinned += delta
