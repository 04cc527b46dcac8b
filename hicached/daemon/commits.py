"""Committing a call's pages: from pending to visible, in one step for every reader.

A commit publishes pending pages in turn: flags, the table's count, the key's presence mask
(and, with the shared presence table, the mask and each large page's slot tag, from which
clients answer exists and read without a lease), the recency (the call's pages the most
recently used, in its order), the policy told (``inserted`` / ``inserted_many``), the
reservation's pin dropped, the KV events told, and the tails the policy says no hit can use
evicted (``policy.stale``; in a daemon's idle turns instead: ``reclaim.py``).

``commit`` is ``commit_many`` of one page. Few pages go one by one (``_commit_each``); a call
of ``BATCH_MIN`` pages or more in a few numpy passes, each column written once (issue 24: a
set of 128 pages cost ~5 us a page one by one). What must stay true: either way the state is
exactly that of committing the pages one by one in turn (records, ticks, recency lists, slab
ages, the presence table's bytes); a page not as it should be goes the one-by-one way, which
raises where committing it alone would. A key's mask is written in the presence table once per
call, with all its pools of the call: clients read the table while the loop writes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hicached.daemon.entry import COMMITTED, PENDING, Entry
from hicached.daemon.evict import Evictor
from hicached.daemon.eviction.interface import EvictionPolicy
from hicached.daemon.kv_events import NullKVEvents
from hicached.daemon.reclaim import Reclaimer
from hicached.daemon.records import Records
from hicached.daemon.reserving import BATCH_MIN
from hicached.presence import fingerprints


def handles(entries: Sequence[Entry]) -> tuple[np.ndarray, np.ndarray]:
    """(page records, generations) of ``entries`` as int64 arrays."""
    n = len(entries)
    return (np.fromiter((e.rec for e in entries), np.int64, n),
            np.fromiter((e.gen for e in entries), np.int64, n))


class Commits:
    """Publishes pending pages (module docstring). Owns nothing: writes the records (flags,
    masks, counts, ticks, pins, pending handles, owners), the shared presence table
    (``records.shared``), the slabs' ``last_used`` and ``pinned``; calls the policy's
    ``inserted`` / ``inserted_many`` and ``stale``, ``events.stored``, and, for the tails due,
    ``evictor.evict_pages`` when the reclaimer says a commit takes them (``commit_tails``)."""

    def __init__(self, records: Records, policy: EvictionPolicy, events: NullKVEvents,
                 evictor: Evictor, reclaimer: Reclaimer):
        self.records = records
        self.alloc = records.alloc
        self.policy = policy
        self.events = events
        self.evictor = evictor
        self.reclaimer = reclaimer

    def commit(self, entry: Entry) -> None:
        """Publish a pending entry: from now on every reader of its table sees it."""
        self.commit_many((entry,))

    def commit_many(self, entries: Sequence[Entry], events: bool = True) -> None:
        """Publish pending entries, in turn, in one pass (a call's pages: the slabs' recency
        once). Every entry must be pending and pinned, each once; the state afterwards is
        exactly that of committing them one by one (``commit``): in particular a call's pages
        are the most recently used in its order, and the policy hears of them in that order
        (``inserted_many``: what it needs of the state between two of them is given).
        ``events`` False: no KV events (a commit in slices tells its pages at its end)."""
        r = self.records
        n = len(entries)
        if n < BATCH_MIN:
            return self._commit_each(entries, events)
        ps, gens = handles(entries)
        cols = r.np
        flags = cols["p_flags"][ps]
        bad = cols["p_gen"][ps] != gens  # (count_nonzero: cheaper than any() on a few pages)
        bad |= (flags & PENDING) == 0
        bad |= cols["p_pins"][ps] <= 0
        ps_list = ps.tolist()
        if np.count_nonzero(bad) or len(set(ps_list)) != n:
            return self._commit_each(entries, events)  # raises where one by one raises
        pending = r.pending
        for e in entries:
            pend = pending[e.table]
            del pend[e.key]
            if not pend:
                del pending[e.table]
        cols["p_flags"][ps] = (flags & np.uint8(0xFF ^ PENDING)) | COMMITTED
        if r.owners:
            pop = r.owners.pop
            for p in ps_list:
                pop(p, None)
        tids = cols["p_tid"][ps]
        if not np.count_nonzero(tids != tids[0]):
            r.tcount[tids[0]] += n
        else:
            for tid, count in zip(*np.unique(tids, return_counts=True)):
                r.tcount[tid] += int(count)
        r.committed_count += n
        krecs = cols["p_krec"][ps]
        bits = np.asarray(r.t_bit, np.int64)[tids]
        masks = cols["k_mask"]
        mask_before = masks[krecs]
        if len(set(krecs.tolist())) == n:
            masks[krecs] = mask_before | bits
            firsts = None
        else:  # a key's pages in several pools: each key once, where it first comes
            np.bitwise_or.at(masks, krecs, bits)
            firsts = np.sort(np.unique(krecs, return_index=True)[1])
        tick = r.tick
        used = cols["p_used"]
        used_before = used[ps]
        used[ps] = np.arange(tick + 1, tick + 1 + n, dtype=np.int64)
        r.tick = tick + n
        if r.journaling:  # before the presence table and the answer: a commit a client may
            r.journal_pages(ps, entries)  # see (exists, a Committed) is journaled
        if r.shared is not None:
            self._publish(entries, ps, krecs, mask_before, firsts)
        self.policy.inserted_many(ps, used_before, mask_before)
        offsets = cols["p_off"][ps]
        pins = cols["p_pins"]
        pins[ps] -= 1  # unpinned: a pending page's reservation pin
        self._touch_slabs(offsets // self.alloc.slab_bytes, tick)
        self._count_pinned(offsets[pins[ps] == 0], -1)
        if self.events.tids and events:
            self.events.stored(entries, r.chain)
        if self.reclaimer.commit_tails():  # (a daemon's idle turns take them: ``reclaim.py``)
            self.evictor.evict_pages(self.policy.stale())  # pages no hit can use (``hybrid.py``)

    def _publish(self, entries: Sequence[Entry], ps: np.ndarray, krecs: np.ndarray,
                 mask_before: np.ndarray, firsts: np.ndarray | None) -> None:
        """Publish a commit's changed masks (and its large pages' slot tags) in the shared
        presence table, as ``commit`` of each page does (``PresenceTable.set_many``: the same
        bytes), its keys fingerprinted in one call (``presence.fingerprints``) where they are
        of one namespace. ``firsts``: the position of each key's first page (None: every page
        is its key's only one)."""
        r = self.records
        cols, shared = r.np, r.shared
        pos = np.arange(len(ps)) if firsts is None else firsts
        keys = krecs[pos]
        sfps = cols["k_sfp"][keys]
        todo = np.flatnonzero(sfps == 0)
        if len(todo):
            ns = cols["k_ns"][keys[todo]]
            if not np.count_nonzero(ns != ns[0]):
                fps = fingerprints(r.seed(r.ns_names[ns[0]]),
                                   [entries[i].key for i in pos[todo].tolist()])
                if fps is not None:
                    sfps[todo] = fps
                    cols["k_sfp"][keys[todo]] = fps
        new = cols["k_mask"][keys]
        changed = np.flatnonzero(new != mask_before[pos])
        sfps, new = sfps[changed], new[changed]
        for j in np.flatnonzero(sfps == 0).tolist():  # fingerprinted one by one
            sfps[j] = r.sfp(int(keys[changed[j]]))
        shared.set_many(sfps, new)
        if shared.tag_count and np.count_nonzero(cols["p_stride"][ps] >= shared.grain):
            for e in entries:
                shared.publish_tag(e.slot_offset, e.stride, e.gen)

    def _touch_slabs(self, slab_ids: np.ndarray, tick: int) -> None:
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

    def _commit_each(self, entries: Sequence[Entry], events: bool = True) -> None:
        """``commit_many`` one page after the other (few pages, or a page not as it should be:
        the AssertionError is raised where committing one by one raises it)."""
        r = self.records
        shared, alloc, policy = r.shared, self.alloc, self.policy
        slabs, slab_bytes = alloc.slabs, alloc.slab_bytes
        flags, pins, used, mask_of = r.p_flags, r.p_pins, r.p_used, r.k_mask
        touched: dict = {}  # slab -> None, in the order of their last touch
        owners = r.owners
        tick = r.tick
        masks_before: dict[int, int] = {}  # key record -> its mask before the call
        for e in entries:
            p = e.rec
            if r.p_gen[p] != e.gen or not flags[p] & PENDING:
                raise AssertionError(f"{e!r} is not pending")
            pend = r.pending[e.table]
            del pend[e.key]
            if not pend:
                del r.pending[e.table]
            flags[p] = (flags[p] & ~PENDING) | COMMITTED
            if owners:
                owners.pop(p, None)
            tid = r.p_tid[p]
            r.tcount[tid] += 1
            r.committed_count += 1
            k = r.p_krec[p]
            masks_before.setdefault(k, mask_of[k])
            mask_of[k] |= r.t_bit[tid]
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
        if r.journaling:
            r.journal_pages(np.fromiter((e.rec for e in entries), np.int64, len(entries)),
                            entries)
        # (before the masks: a page an exists sees is journaled)
        if shared is not None:  # each key's mask once, with all its pools of the call: a
            for k, old in masks_before.items():  # reader of the table never sees one without
                if mask_of[k] != old:  # the others (as ``_publish``)
                    shared.set(r.sfp(k), mask_of[k])
        r.tick = tick
        alloc.touched(touched)
        if self.events.tids and events:
            self.events.stored(entries, r.chain)
        if self.reclaimer.commit_tails():
            # pages no hit can use any more (``hybrid.py``)
            self.evictor.evict_pages(policy.stale())

    def _count_pinned(self, offsets: np.ndarray, delta: int) -> None:
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
