"""A committed page leaving L2: evicted (the policy chose it, or a quota, or the L3 audit) or
dropped (a flush).

A page leaves in one place, ``Evictor.evict_pages``, whatever asked: the shared presence
table's masks of its keys are written first (once per key, at what they are once all the
call's pages went: a client answering exists from the table never sees a key that some of its
pages left and the others not yet, the mirror of the atomic multi-pool commit), then each page
is told to whoever listens (``on_evict``: the L3 write-back of an evicted page, before its slot
is reused; the KV events of its table), its slot tag is cleared, the policy forgets it and its
records and slot are freed (``Records.free_page``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hicached.daemon.entry import COMMITTED, Entry
from hicached.daemon.eviction.interface import EvictionPolicy
from hicached.daemon.kv_events import NullKVEvents
from hicached.daemon.records import Records

# pages from which an eviction takes its pages in one pass: its numpy calls cost ~25 us a call,
# and it saves ~1.5 us a page of ~5.5 (measured: even at 16 pages, 0.75 x at 128); most of what
# is left is each key's (its key table, the presence table, the policy's tree)
BATCH_MIN = 16


class Evictor:
    """Takes committed, unpinned pages out of L2 (module docstring). Owns nothing but what it
    was given; mutates the records (columns, counts: ``evictions``, ``committed_count``), the
    shared presence table (``records.shared``) and, through ``Records.free_page`` /
    ``free_pages``, the slab allocator. Calls the policy's ``removed`` / ``removed_many`` /
    ``doomed``, ``events.removed_l2`` and ``on_evict``. Never evicts a pending or pinned page.
    ``batch_min``: the pages from which a call takes them in one pass (a test sets it out of
    reach to compare with page by page)."""

    def __init__(self, records: Records, policy: EvictionPolicy, events: NullKVEvents,
                 on_evict: Callable[[Entry], None] | None = None):
        self.records = records
        self.policy = policy
        self.events = events
        self.on_evict = on_evict
        # pages an eviction takes in one pass (``_unpublish_many``); fewer, one by one
        self.batch_min = BATCH_MIN

    def evict_pages(self, pages: Sequence[int], evicting: bool = True) -> int:
        """Evict (``evicting`` False: drop, as a flush does: not counted, no ``on_evict``)
        those of page records ``pages`` that are committed and unpinned, in order; how many
        went. Each key's mask in the shared presence table is written once, before its first
        page here goes, at what it is once they all went: a client answering exists from the
        table never sees a key that some of these pages left and the others not yet (its KV
        page without its INDEXER page: the mirror of the atomic multi-pool commit, the
        policies taking a key's pages together)."""
        r = self.records
        flags, pins = r.p_flags, r.p_pins
        live = [p for p in pages if flags[p] & COMMITTED and not pins[p]]
        if not live:
            return 0
        shared = r.shared
        if shared is not None:
            going: dict[int, int] = {}  # key record -> the bits of its pools going
            for p in live:
                k = r.p_krec[p]
                going[k] = going.get(k, 0) | r.t_bit[r.p_tid[p]]
            for k, bits in going.items():
                left = r.k_mask[k] & ~bits
                if left:
                    shared.set(r.sfp(k), left)
                else:
                    shared.remove(r.sfp(k))
        if (len(live) >= self.batch_min and (not evicting or self.on_evict is None)
                and len(set(live)) == len(live)):
            self._unpublish_many(live)
            n = len(live)
        else:
            n = self._unpublish_each(live, evicting)
        if evicting:
            r.evictions += n
        return n

    def _unpublish_each(self, live: list[int], evicting: bool) -> int:
        """``_unpublish`` of each of ``live`` in turn, ``on_evict`` first (a page named twice
        goes once); how many went."""
        r = self.records
        flags = r.p_flags
        n = 0
        for p in live:
            if not flags[p] & COMMITTED:  # (named twice)
                continue
            if evicting and self.on_evict is not None:
                self.on_evict(r.handle(p))
            self._unpublish(p)
            n += 1
        return n

    def _unpublish_many(self, live: list[int]) -> None:
        """``_unpublish`` of each of ``live`` (committed, unpinned, each once) in turn, in one
        pass: the policy told of them all, then the counts, masks, events and slot tags at once,
        then ``Records.free_pages`` (the slots freed and keys unlinked in order)."""
        r = self.records
        arr = np.array(live, np.int64)
        self.policy.removed_many(live, arr)
        cols = r.np
        tids, krecs = cols["p_tid"][arr], cols["p_krec"][arr]
        tcount, masks = r.tcount, cols["k_mask"]
        if tids[0] == tids[-1] and not np.count_nonzero(tids != tids[0]):  # (mostly: one pool)
            tid = int(tids[0])
            tcount[tid] -= len(live)
            masks[krecs] &= ~r.t_bit[tid]  # (a key twice: the same bit cleared)
        else:
            t_bit = r.t_bit
            for tid, k in zip(tids.tolist(), krecs.tolist()):
                tcount[tid] -= 1
                masks[k] &= ~t_bit[tid]
        r.committed_count -= len(live)
        events = self.events
        if events.tids:  # (before a key record may go)
            for tid, k in zip(tids.tolist(), krecs.tolist()):
                if tid in events.tids:
                    events.removed_l2(events.tids[tid], r.key_of(k))
        if r.shared is not None:  # before the slots are freed
            r.shared.clear_tags(cols["p_off"][arr], cols["p_stride"][arr])
        r.free_pages(live, arr)

    def evict(self, entry: Entry) -> int:
        """Remove a committed, unpinned entry from L2 and free its slot, with the pages the
        policy says depend on it (before it: ``policy.doomed``); returns the pages evicted."""
        assert entry.committed and entry.pins == 0, entry
        return self.evict_pages(self.policy.doomed(entry.rec))

    def drop(self, entries: Sequence[Entry]) -> int:
        """Remove committed, unpinned entries (and their dependants); returns how many pages
        were dropped."""
        return sum(self.drop_one(e) for e in list(entries))

    def drop_one(self, entry: Entry) -> int:
        """Remove ``entry`` if it is committed and unpinned (flush), with its dependants as
        ``evict``; the pages dropped (0: ``entry`` stays)."""
        if entry.committed and entry.pins == 0:
            return self.evict_pages(self.policy.doomed(entry.rec), evicting=False)
        return 0

    def _unpublish(self, p: int) -> None:
        """Page record ``p`` leaves L2 (its slot freed; the caller, ``evict_pages``, wrote
        its key's mask in the shared presence table before)."""
        r = self.records
        tid, k = r.p_tid[p], r.p_krec[p]
        self.policy.removed(p)
        r.tcount[tid] -= 1
        r.committed_count -= 1
        left = r.k_mask[k] & ~r.t_bit[tid]
        r.k_mask[k] = left
        events = self.events
        if tid in events.tids:  # before its key record may go
            events.removed_l2(events.tids[tid], r.key_of(k))
        if r.shared is not None:
            r.shared.clear_tag(r.p_off[p], r.p_stride[p])  # before the slot is freed
        r.p_flags[p] &= ~COMMITTED
        r.free_page(p)
