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

from hicached.daemon.entry import COMMITTED, Entry
from hicached.daemon.eviction.interface import EvictionPolicy
from hicached.daemon.kv_events import NullKVEvents
from hicached.daemon.records import Records


class Evictor:
    """Takes committed, unpinned pages out of L2 (module docstring). Owns nothing but what it
    was given; mutates the records (columns, counts: ``evictions``, ``committed_count``), the
    shared presence table (``records.shared``) and, through ``Records.free_page``, the slab
    allocator. Calls the policy's ``removed`` / ``doomed``, ``events.removed_l2`` and
    ``on_evict``. Never evicts a pending or pinned page."""

    def __init__(self, records: Records, policy: EvictionPolicy, events: NullKVEvents,
                 on_evict: Callable[[Entry], None] | None = None):
        self.records = records
        self.policy = policy
        self.events = events
        self.on_evict = on_evict

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
        n = 0
        for p in live:
            if not flags[p] & COMMITTED:  # (named twice)
                continue
            if evicting and self.on_evict is not None:
                self.on_evict(r.handle(p))
            self._unpublish(p)
            n += 1
        if evicting:
            r.evictions += n
        return n

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
