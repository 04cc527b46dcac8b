"""The L2 page index: which (namespace, pool, key) lives in which arena slot, and in what state.

A page's states:

    reserve_unbound() --> unbound (pinned, no key: a client's set-ahead slot)
                               | bind(key)
                               v
    reserve() ----------> pending (pinned, invisible) ---commit()---> committed (visible)
                               |                                        |   ^
                               +--abort()--> freed                 pin()|   |unpin()
                                                                        v   |  (leases, L3 I/O)
                                                  evicted when unpinned and the policy says so

Readers only ever look at committed pages, so a page becomes visible exactly when ``commit`` runs
(the control loop is single-threaded: a multi-pool commit is atomic for every reader).

Compact records: a node's L2 holds a million pages or more, so an idle page is no Python object.
Every page is a *page record* (``p_*`` arrays: table, offset, stride, size, generation, recency,
hits, pins, flags, owner, the next page of its key) and every (namespace, key) L2 holds a page of
is a *key record* (``k_*``: the key's bytes, the mask of the pools holding it committed, its first
page, its presence fingerprint, its chain: parent and depth). Each namespace maps its keys to key
records through an open-addressing table of 64-bit fingerprints (``FpTable``; Python's own string
hash, itself salted per process: this table never leaves the process), looked up for 1024 keys at
once with numpy. About 220 bytes a page in all (``tools/bench_index.py`` measures it).

``Entry`` is a handle on a page record, made when code asks for one: its fixed fields (table, key,
slot, generation) are copied into it, its mutable state (pins, flags, hits) is read through to the
records, so two handles of one page always agree and a handle of a page that is gone reads as
uncommitted and unpinned. Handles compare equal when they name the same page (record and
generation). A fingerprint collision costs a miss, never wrong bytes: a page is served only after
its key's bytes compared equal.

Eviction asks one policy object which pages go next (``eviction/``): ``_make_room`` when a size
class has no free slot, slab reclaim, quotas, the L3 audit.

One path per operation where it costs nothing: ``commit`` is ``commit_many`` of one page;
``reserve`` is the page-by-page path of ``reserve_many`` (which goes through it for calls of
few keys; a call through ``reserve_many``'s dispatch measured 4.6-5.1 us against 3.9-4.6);
``touch`` stays beside ``touch_many`` (as its batch of one it measured ~1 us more a call, on
per-page loops). Inside a batch call, pages go one by one (``reserve``, ``_commit_each``: a
numpy call costs ~1-2 us, a page ~3-5) or in a few numpy passes where the call is large enough
to pay for them (``_reserve_run``); both leave exactly the state of its pages done one by one in
turn (``batch.py``).

Presence (``presence``): a key record's mask is the OR of ``pool_bit`` of the pools holding the
key committed, kept by ``commit`` and ``_unpublish``, so an exists query looks every key up once
for all its pools. With ``shared`` set, every change of a mask is also published in the
shared-memory presence table (``presence.py``), from which clients answer exists without asking,
and so is every committed large page's slot tag (its generation, from ``commit`` until
``_unpublish`` frees the slot), with which clients read pages without a lease. A key's mask is
written there once per call that changes it (a commit, ``evict_pages``), never with some of the
call's pools of the key and not the others: clients read the table while the loop writes it.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

from hicached.daemon.batch import BatchOps
from hicached.daemon.eviction.interface import EvictionPolicy
from hicached.daemon.eviction.lru import LruPolicy
from hicached.daemon.records import (  # noqa: F401 - names the daemon imports from here
    _TOP,
    COMMITTED,
    FROM_L3,
    GROW_MIN,
    IN_L3,
    KEY_BYTES,
    MAX_POOLS,
    MAX_TABLES,
    PENDING,
    WRITING,
    Entry,
    Records,
    TableId,
)
from hicached.daemon.slabs import SlabAllocator
from hicached.presence import PresenceTable

SPLIT_MIN = 8  # pages of a leaf segment below which it goes whole (``_evict_victims``)


class PageIndex(BatchOps, Records):
    """Page and key records, pins and eviction over a ``SlabAllocator``.

    Not thread-safe: only the daemon's control loop calls it.
    ``on_evict(entry)`` runs for every evicted committed page (before its slot is reused).
    """

    def __init__(self, allocator: SlabAllocator, on_evict: Callable[[Entry], None] | None = None,
                 policy: EvictionPolicy | None = None, presence: PresenceTable | None = None):
        self.on_evict = on_evict
        self.event_tids: dict = {}  # KV events (kv_events.py): table id -> its EventPool
        self.kv_events = None  # ... and the recorder of their events
        self.policy = policy or LruPolicy()
        self.policy.bind(self)
        self.pressed: set[int] = set()  # size classes a reservation had to evict for (reclaim.py)
        self.commit_tails: Callable[[], bool] = lambda: True  # a commit evicts the tails due
        # where the rest of a leaf segment goes once a reservation has its room (a daemon's
        # idle turns: ``reclaim.py``); None: a victim set goes whole
        self.defer: Callable[[list[int]], None] | None = None
        # (stride, need) -> pages evicted: the deferred pages of that class go first
        self.take_deferred: Callable[[int, int], int] | None = None
        super().__init__(allocator, presence)

    # ------------------------------------------------------------ reserve / commit / abort

    def _take_slot(self, stride: int) -> int | None:
        offset = self.alloc.alloc(stride)
        if offset is None:
            offset = self._make_room(stride)
        return offset

    def _place(self, p: int, offset: int, stride: int) -> None:
        slab = self.alloc.slab_of(offset)
        slots = self._slots.get(slab.index)
        if slots is None or len(slots) != slab.num_slots:
            slots = self._slots[slab.index] = array("i", [-1]) * slab.num_slots
        slots[(offset - slab.offset) // stride] = p

    def _new_gen(self) -> int:
        self._gen += 1
        return self._gen

    def reserve(self, table: TableId, key: str, page_bytes: int, stride: int) -> Entry | None:
        """A pending, pinned entry with a fresh slot, or None when nothing can be evicted (or,
        a 2^-64 event, another key of the namespace has this key's fingerprint).

        The caller checks first that the key is neither committed nor pending. ValueError (from
        ``pool_bit``) when the table would be the namespace's pool past ``MAX_POOLS``. The
        page-by-page path of ``reserve_many`` too (its calls of few keys, and the keys a run
        cannot take), so one key reserved either way leaves the same state.
        """
        tid = self._tid.get(table)
        if tid is None:
            tid = self.table_id(table)  # its pool bit given now, so that commit cannot fail
        offset = self.alloc.alloc(stride)
        if offset is None:
            offset = self._make_room(stride)
            if offset is None:
                return None
        ns = table[0]
        keys = self._keys[self._ns_id[ns]]
        fp = (hash(key) + _TOP) or 1
        k = keys.table.get(fp)
        if k < 0:
            k = self._new_key()
            b = key.encode()
            if 0 < len(b) <= KEY_BYTES:
                self.k_bytes[k * KEY_BYTES:k * KEY_BYTES + len(b)] = b
                self.k_len[k] = len(b)
            else:  # long (or empty: a length of 0 marks a free record)
                self.k_len[k] = 255
                self._long_keys[k] = key
            self.k_ns[k] = self._ns_id[ns]
            self.k_sfp[k] = self.k_mask[k] = self.k_parent[k] = 0
            self.k_head[k] = -1
            self.k_depth[k] = -1
            keys.table.put(fp, k)
        elif not self._same_key(k, key):
            self.alloc.free(offset)
            return None
        p = self._new_page()
        self._gen = gen = self._gen + 1
        self.p_tid[p] = tid
        self.p_krec[p] = k
        self.p_off[p] = offset
        self.p_stride[p] = stride
        self.p_pbytes[p] = page_bytes
        self.p_gen[p] = gen
        self.p_used[p] = self.p_hits[p] = 0
        self.p_pins[p] = 1  # pinned while pending
        self.p_flags[p] = PENDING
        self.p_knext[p] = self.k_head[k]
        self.k_head[k] = p
        slab = self.alloc.slabs[offset // self.alloc.slab_bytes]
        slab.pinned += 1
        slots = self._slots.get(slab.index)
        if slots is None or len(slots) != slab.num_slots:
            slots = self._slots[slab.index] = array("i", [-1]) * slab.num_slots
        slots[(offset - slab.offset) // stride] = p
        self.ns_bytes[ns] = self.ns_bytes.get(ns, 0) + stride
        entry = Entry.__new__(Entry)
        entry.ix, entry.rec, entry.table, entry.key = self, p, table, key
        entry.slot_offset, entry.stride, entry.gen = offset, stride, gen
        pend = self.pending.get(table)
        if pend is None:
            pend = self.pending[table] = {}
        pend[key] = entry
        return entry

    def _init_page(self, p: int, tid: int, k: int, offset: int, page_bytes: int, stride: int,
                   flags: int) -> None:
        self.p_tid[p], self.p_krec[p] = tid, k
        self.p_off[p], self.p_stride[p], self.p_pbytes[p] = offset, stride, page_bytes
        self.p_gen[p] = self._new_gen()
        self.p_used[p] = self.p_hits[p] = self.p_pins[p] = 0
        self.p_flags[p] = flags
        self.p_knext[p] = -1
        self._place(p, offset, stride)

    def reserve_unbound(self, ns: str, stride: int) -> Entry | None:
        """A pinned slot of ``stride`` bytes held for namespace ``ns`` without a key yet (a
        client's set-ahead slot, ``leases.AheadSlots``), or None when nothing can be evicted.
        It counts for the namespace's bytes; ``bind`` gives it a key, ``abort`` frees it."""
        offset = self._take_slot(stride)
        if offset is None:
            return None
        p = self._new_page()
        self._init_page(p, -1, self._ns(ns), offset, 0, stride, 0)  # krec: its namespace
        self.ns_bytes[ns] = self.ns_bytes.get(ns, 0) + stride
        entry = Entry(self, p, (ns, ""), "")
        self.pin(entry)
        return entry

    def bind(self, entry: Entry, table: TableId, key: str, page_bytes: int) -> Entry | None:
        """Turn an unbound slot of ``table``'s namespace into the pending entry of ``key`` (same
        slot, a new generation; ``entry`` is updated and returned). The caller checks first
        that the key is neither committed nor pending; ValueError as ``reserve``; None (the
        slot freed) on a fingerprint collision."""
        p = entry.rec
        assert (entry.alive and self.p_tid[p] < 0
                and self._ns_names[self.p_krec[p]] == table[0]), entry
        tid = self.table_id(table)
        k = self._key_record(table[0], key)
        if k < 0:
            self.abort(entry)
            return None
        self.p_tid[p], self.p_krec[p], self.p_pbytes[p] = tid, k, page_bytes
        self.p_flags[p] = PENDING
        self.p_gen[p] = self._new_gen()
        self.p_knext[p] = self.k_head[k]
        self.k_head[k] = p
        entry.table, entry.key, entry.gen = table, key, self.p_gen[p]
        self.pending.setdefault(table, {})[key] = entry
        return entry

    def commit(self, entry: Entry) -> None:
        """Publish a pending entry: from now on every reader of its table sees it."""
        self.commit_many((entry,))

    def abort(self, entry: Entry) -> None:
        """Drop a pending (or unbound) entry and free its slot."""
        p = entry.rec
        assert entry.alive and not self.p_flags[p] & COMMITTED, entry
        if self.p_flags[p] & PENDING:
            pend = self.pending.get(entry.table)
            if pend is not None and pend.get(entry.key) == entry:
                del pend[entry.key]
                if not pend:
                    del self.pending[entry.table]
        self.unpin(entry)
        self._free_page(p)

    # ------------------------------------------------------------ pins and recency

    def pin(self, entry: Entry) -> None:
        """Keep ``entry`` from eviction (lease, reservation, L3 I/O in flight)."""
        p = entry.rec
        assert self.p_gen[p] == entry.gen, entry
        if self.p_pins[p] == 0:
            self.alloc.slab_of(entry.slot_offset).pinned += 1
        self.p_pins[p] += 1

    def unpin(self, entry: Entry) -> None:
        p = entry.rec
        assert self.p_gen[p] == entry.gen and self.p_pins[p] > 0, entry
        self.p_pins[p] -= 1
        if self.p_pins[p] == 0:
            self.alloc.slab_of(entry.slot_offset).pinned -= 1

    def touch(self, entry: Entry) -> None:
        """Mark ``entry`` most recently used: ``touch_many`` of one page, kept on its own for
        the per-page loops that call it (pages read without a lease, present keys of a set):
        ``touch_many((entry,))`` measured 1.8-2.6 us a call against 1.0-1.2 (lru)."""
        p = entry.rec
        if self.p_gen[p] != entry.gen:
            return
        self._tick += 1
        self.p_used[p] = self._tick
        self.alloc.touch(entry.offset, self._tick)
        if self.p_flags[p] & COMMITTED:
            self.policy.touched(p)

    # ------------------------------------------------------------ eviction

    def lru_order(self, stride: int) -> list[Entry]:
        """Committed entries of a class, least recently used first (for tests and stats)."""
        return [self.handle(p) for p in self.policy.order(stride)]

    def _make_room(self, stride: int) -> int | None:
        self.pressed.add(stride)
        while True:
            if self.take_deferred is not None and self.take_deferred(stride, 1):
                offset = self.alloc.alloc(stride)
                if offset is not None:
                    return offset
                continue
            victims = self.policy.make_room(stride)  # dependants included, in order
            if not victims:
                return None
            if not self._evict_victims(victims, stride, 1):
                return None  # a policy naming only pages that cannot go: no room
            offset = self.alloc.alloc(stride)
            if offset is not None:
                return offset

    def _evict_victims(self, victims: list[int], stride: int, need: int) -> int:
        """Evict ``victims`` (``policy.make_room``'s, in order); returns how many went. A leaf
        segment (``policy.split_ok``) of more than ``SPLIT_MIN`` pages goes key by key from its
        leaf up only until class ``stride`` has ``need`` free slots: the rest, state-less keys
        no hit can use, goes to ``defer`` (the idle turns, or the next reservation that needs
        room: ``reclaim.py``), off the path of the set that asked. So a set that needs one
        slot for a state does not also evict the hundred KV pages only that state made
        useful."""
        if self.defer is None or len(victims) <= SPLIT_MIN or not self.policy.split_ok:
            return self.evict_pages(victims)
        krec, n, i, end = self.p_krec, 0, 0, len(victims)
        while i < end:
            k, j = krec[victims[i]], i
            while i < end and krec[victims[i]] == k:  # (a key's pages are together: states
                i += 1  # first, ``KeyTree._pages``)
            n += self.evict_pages(victims[j:i])
            if self.alloc.free_slots(stride) >= need:
                break
        if i < end:
            self.defer(victims[i:])
        return n

    def _evict_page(self, p: int) -> int:
        """Evict page record ``p`` if it is committed and unpinned (1), else 0."""
        return self.evict_pages((p,))

    def evict_pages(self, pages: Sequence[int], evicting: bool = True) -> int:
        """Evict (``evicting`` False: drop, as a flush does: not counted, no ``on_evict``)
        those of page records ``pages`` that are committed and unpinned, in order; how many
        went. Each key's mask in the shared presence table is written once, before its first
        page here goes, at what it is once they all went: a client answering exists from the
        table never sees a key that some of these pages left and the others not yet (its KV
        page without its INDEXER page: the mirror of the atomic multi-pool commit, the
        policies taking a key's pages together)."""
        flags, pins = self.p_flags, self.p_pins
        live = [p for p in pages if flags[p] & COMMITTED and not pins[p]]
        if not live:
            return 0
        shared = self.shared
        if shared is not None:
            going: dict[int, int] = {}  # key record -> the bits of its pools going
            for p in live:
                k = self.p_krec[p]
                going[k] = going.get(k, 0) | self.t_bit[self.p_tid[p]]
            for k, bits in going.items():
                left = self.k_mask[k] & ~bits
                if left:
                    shared.set(self._sfp(k), left)
                else:
                    shared.remove(self._sfp(k))
        n = 0
        for p in live:
            if not flags[p] & COMMITTED:  # (named twice)
                continue
            if evicting and self.on_evict is not None:
                self.on_evict(self.handle(p))
            self._unpublish(p)
            n += 1
        if evicting:
            self.evictions += n
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

    def _rec_at(self, offset: int) -> int:
        slab = self.alloc.slab_of(offset)
        slots = self._slots.get(slab.index)
        if slots is None or not slab.stride or len(slots) != slab.num_slots:
            return -1
        rel = offset - slab.offset
        if rel % slab.stride:
            return -1
        i = rel // slab.stride
        return slots[i] if i < len(slots) else -1

    def tagged(self, pairs: Sequence[int], ns: str) -> list[Entry]:
        """The committed entries of namespace ``ns`` named by flat (offset, tag) pairs that are
        still in their slot (``Release.touched``: pages a client read without a lease); pairs
        naming nothing (or a trailing odd number) are skipped."""
        out = []
        limit = self.alloc.capacity_bytes
        for i in range(0, len(pairs) - 1, 2):
            off = pairs[i]
            if not 0 <= off < limit:
                continue
            p = self._rec_at(off)
            if (p >= 0 and self.p_flags[p] & COMMITTED and self.p_gen[p] == pairs[i + 1]
                    and self._tables[self.p_tid[p]][0] == ns):
                out.append(self.handle(p))
        return out

    def at(self, offset: int) -> Entry | None:
        """The entry (any state) holding the slot at ``offset``, or None."""
        p = self._rec_at(offset)
        if p < 0 or self.p_off[p] != offset:
            return None
        if self.p_flags[p] & PENDING:  # its live handle (unless fenced: ``leases.py``)
            e = self.pending.get(self._tables[self.p_tid[p]], {}).get(self._key_of(self.p_krec[p]))
            if e is not None and e.rec == p:
                return e
        return self.handle(p)

    def _unpublish(self, p: int) -> None:
        """Page record ``p`` leaves L2 (its slot freed; the caller, ``evict_pages``, wrote
        its key's mask in the shared presence table before)."""
        tid, k = self.p_tid[p], self.p_krec[p]
        self.policy.removed(p)
        self._tcount[tid] -= 1
        self.committed_count -= 1
        left = self.k_mask[k] & ~self.t_bit[tid]
        self.k_mask[k] = left
        if tid in self.event_tids:  # before its key record may go
            self.kv_events.removed_l2(self.event_tids[tid], self._key_of(k))
        if self.shared is not None:
            self.shared.clear_tag(self.p_off[p], self.p_stride[p])  # before the slot is freed
        self.p_flags[p] &= ~COMMITTED
        self._free_page(p)

    def _free_page(self, p: int) -> None:
        """Free page record ``p`` and its slot (and its key record with its key's last page)."""
        tid, k = self.p_tid[p], self.p_krec[p]
        ns = self._tables[tid][0] if tid >= 0 else self._ns_names[k]
        offset = self.p_off[p]
        self.ns_bytes[ns] -= self.p_stride[p]
        slab = self.alloc.slab_of(offset)
        self._slots[slab.index][(offset - slab.offset) // slab.stride] = -1
        self.alloc.free(offset)
        if tid >= 0:  # unlink from its key's pages
            nxt = self.p_knext[p]
            if self.k_head[k] == p:
                self.k_head[k] = nxt
            else:
                q = self.k_head[k]
                while self.p_knext[q] != p:
                    q = self.p_knext[q]
                self.p_knext[q] = nxt
            if self.k_head[k] < 0:
                self._free_key(k)
        self.p_gen[p] = self.p_flags[p] = self.p_pins[p] = 0
        self.owners.pop(p, None)
        self._p_free.append(p)

    def _free_key(self, k: int) -> None:
        self.policy.key_freed(k)
        self._keys[self.k_ns[k]].table.remove((hash(self._key_of(k)) + _TOP) or 1)
        if self.k_len[k] == 255:
            del self._long_keys[k]
        self.k_len[k] = 0
        self._k_free.append(k)
