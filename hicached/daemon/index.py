"""The L2 page index: which (namespace, pool, key) lives in which arena slot, and in what state.

A page is an ``Entry``. Its states:

    reserve_unbound() --> unbound (pinned, no key: a client's set-ahead slot)
                               | bind(key)
                               v
    reserve() ----------> pending (pinned, invisible) ---commit()---> committed (visible, in LRU)
                               |                                        |   ^
                               +--abort()--> freed                 pin()|   |unpin()
                                                                        v   |  (leases, L3 I/O)
                                                  evicted when unpinned and least recently used

Readers only ever look at committed tables, so a page becomes visible exactly when ``commit`` runs
(the control loop is single-threaded: a multi-pool commit is atomic for every reader).

Eviction (``_make_room``): when a size class has no free slot, compare its least recently used
unpinned page with the least recently used unpinned slab of *another* class; evict whichever was
used longer ago (a whole slab frees room for any page size). ``ticks`` are a counter, not a clock,
so eviction order is exact and testable.

Presence (``presence``): besides the per-pool tables, each namespace keeps one map key -> bitmask of
the pools holding that key committed (``pool_bit``), kept by ``commit`` and ``_unpublish``, so an
exists query looks every key up once for all its pools. With ``shared`` set, every change of a
mask is also published in the shared-memory presence table (``presence.py``), from which clients
answer exists without asking, and so is every committed large page's slot tag (``Entry.gen``, from
``commit`` until ``_unpublish`` frees the slot), with which clients read pages without a lease.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import repeat

import numpy as np

from hicached.daemon.slabs import SlabAllocator
from hicached.presence import (
    MAX_LOAD,
    PresenceTable,
    fingerprint,
    fingerprints,
    namespace_seed,
)

TableId = tuple[str, str]  # (namespace digest, pool name)
MAX_POOLS = 63  # pools a namespace may have: one bit each in an int64 presence mask
REPUBLISH_MAX = 32768  # keys a full presence table is refilled with at most (one pause of ~0.1 s)


class Entry:
    """One page in L2."""

    __slots__ = (
        "committed",
        "fp",
        "from_l3",
        "gen",
        "hits",
        "in_l3",
        "key",
        "last_used",
        "offset",
        "owner",
        "page_bytes",
        "pins",
        "stride",
        "table",
        "writing",
    )

    def __init__(self, table: TableId, key: str, offset: int, page_bytes: int, stride: int):
        self.table = table
        self.key = key
        self.offset = offset
        self.page_bytes = page_bytes
        self.stride = stride
        self.pins = 0
        self.committed = False
        self.last_used = 0
        self.in_l3 = False  # a copy is known to be in the L3 backend
        self.hits = 0
        self.writing = False  # an L3 write of this page is in flight
        self.owner = 0  # pending: the session that reserved it (0: the daemon, an L3 load)
        self.gen = 0  # the slot's generation for this page (PageIndex.reserve; Leased.tags)
        self.fp = 0  # its key's fingerprint in the shared presence table (0: not computed)
        self.from_l3 = False  # loaded from L3 and not read since (its first read is an L3 hit)

    def __repr__(self) -> str:
        state = "committed" if self.committed else "pending"
        return f"Entry({self.table[1]}:{self.key} @{self.offset} {state} pins={self.pins})"


class PageIndex:
    """Entries, per-class LRU, pins and eviction over a ``SlabAllocator``.

    Not thread-safe: only the daemon's control loop calls it.
    ``on_evict(entry)`` runs for every evicted committed page (before its slot is reused).
    """

    def __init__(self, allocator: SlabAllocator, on_evict: Callable[[Entry], None] | None = None):
        self.alloc = allocator
        self.on_evict = on_evict
        self.tables: dict[TableId, dict[str, Entry]] = {}
        self.pending: dict[TableId, dict[str, Entry]] = {}
        self._lru: dict[int, OrderedDict[Entry, None]] = {}
        self._by_offset: dict[int, Entry] = {}
        self._tick = 0
        # Slot generations: a random start, so tags of an earlier daemon never match this one's.
        self._gen = secrets.randbits(48) << 8
        self.evictions = 0
        self.ns_bytes: dict[str, int] = {}  # namespace digest -> slot bytes held (quotas.py)
        self._presence: dict[str, dict[str, int]] = {}  # ns -> key -> mask of pools committing it
        self._bits: dict[str, dict[str, int]] = {}  # ns -> pool -> its bit in those masks
        self.shared: PresenceTable | None = None  # those masks, published for clients
        self._seeds: dict[str, int] = {}  # ns -> its fingerprint seed in ``shared``
        self._links: dict[str, dict[str, tuple[str | None, int]]] = {}  # ns -> key -> chain()

    # ------------------------------------------------------------ lookups

    def table(self, table: TableId) -> dict[str, Entry]:
        """The committed entries of a table (created empty on first use)."""
        t = self.tables.get(table)
        if t is None:
            t = self.tables[table] = {}
        return t

    def get(self, table: TableId, key: str) -> Entry | None:
        """The committed entry of ``key`` or None."""
        t = self.tables.get(table)
        return t.get(key) if t else None

    def get_pending(self, table: TableId, key: str) -> Entry | None:
        p = self.pending.get(table)
        return p.get(key) if p else None

    def pool_bit(self, table: TableId) -> int:
        """The bit of ``table``'s pool in its namespace's presence masks (given on first use;
        ValueError past ``MAX_POOLS`` pools in one namespace)."""
        ns, pool = table
        bits = self._bits.setdefault(ns, {})
        bit = bits.get(pool)
        if bit is None:
            if len(bits) >= MAX_POOLS:
                raise ValueError(f"a namespace holds at most {MAX_POOLS} pools")
            bit = bits[pool] = 1 << len(bits)
        return bit

    def presence(self, ns: str, keys: Sequence[str]) -> np.ndarray:
        """Per key (int64): the OR of ``pool_bit`` of every pool of ``ns`` holding it committed."""
        masks = self._presence.get(ns)
        if not masks:
            return np.zeros(len(keys), np.int64)
        return np.fromiter(map(masks.get, keys, repeat(0)), np.int64, count=len(keys))

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables.values())

    # ------------------------------------------------------------ reserve / commit / abort

    def reserve(self, table: TableId, key: str, page_bytes: int, stride: int) -> Entry | None:
        """A pending, pinned entry with a fresh slot, or None when nothing can be evicted.

        The caller checks first that the key is neither committed nor pending. ValueError (from
        ``pool_bit``) when the table would be the namespace's pool past ``MAX_POOLS``.
        """
        self.pool_bit(table)  # given now, so that commit cannot fail
        offset = self.alloc.alloc(stride)
        if offset is None:
            offset = self._make_room(stride)
            if offset is None:
                return None
        entry = Entry(table, key, offset, page_bytes, stride)
        self._gen += 1
        entry.gen = self._gen
        self.ns_bytes[table[0]] = self.ns_bytes.get(table[0], 0) + stride
        self._by_offset[offset] = entry
        self.pending.setdefault(table, {})[key] = entry
        self.pin(entry)
        return entry

    def reserve_unbound(self, ns: str, stride: int) -> Entry | None:
        """A pinned slot of ``stride`` bytes held for namespace ``ns`` without a key yet (a
        client's set-ahead slot, ``leases.AheadSlots``), or None when nothing can be evicted.
        It counts for the namespace's bytes; ``bind`` gives it a key, ``abort`` frees it."""
        offset = self.alloc.alloc(stride)
        if offset is None:
            offset = self._make_room(stride)
            if offset is None:
                return None
        entry = Entry((ns, ""), "", offset, 0, stride)
        self.ns_bytes[ns] = self.ns_bytes.get(ns, 0) + stride
        self._by_offset[offset] = entry
        self.pin(entry)
        return entry

    def bind(self, entry: Entry, table: TableId, key: str, page_bytes: int) -> Entry:
        """Turn an unbound slot of ``table``'s namespace into the pending entry of ``key`` (same
        slot, a new generation). The caller checks first that the key is neither committed nor
        pending; ValueError as ``reserve``."""
        assert not entry.key and not entry.committed and entry.table[0] == table[0], entry
        self.pool_bit(table)
        entry.table, entry.key, entry.page_bytes = table, key, page_bytes
        self._gen += 1
        entry.gen = self._gen
        self.pending.setdefault(table, {})[key] = entry
        return entry

    def commit(self, entry: Entry) -> None:
        """Publish a pending entry: from now on every reader of its table sees it."""
        self.commit_many((entry,))

    def commit_many(self, entries: Sequence[Entry]) -> None:
        """Publish pending entries, in turn, in one pass (a call's pages: the per-table lookups
        once, the slabs' recency once). Every entry must be pending, each once; the state
        afterwards is exactly that of committing them one by one."""
        self.fingerprint_all(entries)
        shared, alloc = self.shared, self.alloc
        slabs, slab_bytes = alloc.slabs, alloc.slab_bytes
        per_table: dict[TableId, tuple] = {}
        touched: dict = {}  # slab -> None, in the order of their last touch
        tick = self._tick
        for e in entries:
            table, key = e.table, e.key
            t = per_table.get(table)
            if t is None:
                t = per_table[table] = (self.pending[table], self.table(table),
                                        self._presence.setdefault(table[0], {}),
                                        self.pool_bit(table))
            pend, committed, masks, bit = t
            if e.committed or pend.get(key) is not e:
                raise AssertionError(f"{e!r} is not pending")
            del pend[key]
            e.committed = True
            committed[key] = e
            old = masks.get(key, 0)
            masks[key] = new = old | bit
            if shared is not None:
                if new != old:
                    shared.set(self._fp(e), new)
                shared.publish_tag(e.offset, e.stride, e.gen)
            lru = self._lru.get(e.stride)
            if lru is None:
                lru = self._lru[e.stride] = OrderedDict()
            lru[e] = None  # new to the LRU: its end is where ``touch`` would move it
            tick += 1
            e.last_used = tick
            slab = slabs[e.offset // slab_bytes]
            slab.last_used = tick
            touched.pop(slab, None)
            touched[slab] = None
            if e.pins <= 0:
                raise AssertionError(f"{e!r} is not pinned")
            e.pins -= 1  # unpin
            if e.pins == 0:
                slab.pinned -= 1
        self._tick = tick
        alloc.touched(touched)

    def abort(self, entry: Entry) -> None:
        """Drop a pending (or unbound) entry and free its slot."""
        assert not entry.committed
        p = self.pending.get(entry.table)
        if p is not None and p.get(entry.key) is entry:
            del p[entry.key]
        self.unpin(entry)
        self._free_slot(entry)

    # ------------------------------------------------------------ pins and recency

    def pin(self, entry: Entry) -> None:
        """Keep ``entry`` from eviction (lease, reservation, L3 I/O in flight)."""
        if entry.pins == 0:
            self.alloc.slab_of(entry.offset).pinned += 1
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        assert entry.pins > 0, entry
        entry.pins -= 1
        if entry.pins == 0:
            self.alloc.slab_of(entry.offset).pinned -= 1

    def touch(self, entry: Entry) -> None:
        """Mark ``entry`` most recently used."""
        self._tick += 1
        entry.last_used = self._tick
        self.alloc.touch(entry.offset, self._tick)
        lru = self._lru.get(entry.stride)
        if lru is not None and entry in lru:
            lru.move_to_end(entry)

    # ------------------------------------------------------------ eviction

    def lru_order(self, stride: int) -> list[Entry]:
        """Committed entries of a class, least recently used first (for tests and stats)."""
        return list(self._lru.get(stride, ()))

    def _oldest_unpinned(self, stride: int) -> Entry | None:
        for entry in self._lru.get(stride, ()):
            if entry.pins == 0:
                return entry
        return None

    def _make_room(self, stride: int) -> int | None:
        while True:
            page = self._oldest_unpinned(stride)
            slab = self.alloc.oldest_unpinned(stride)
            if page is not None and (slab is None or page.last_used <= slab.last_used):
                self.evict(page)
            elif slab is not None:
                for offset in list(slab.slot_offsets()):
                    victim = self._by_offset.get(offset)
                    if victim is not None:
                        self.evict(victim)
            else:
                return None
            offset = self.alloc.alloc(stride)
            if offset is not None:
                return offset

    def evict(self, entry: Entry) -> None:
        """Remove a committed, unpinned entry from L2 and free its slot."""
        assert entry.committed and entry.pins == 0, entry
        if self.on_evict is not None:
            self.on_evict(entry)
        self._unpublish(entry)
        self.evictions += 1

    def drop(self, entries: Sequence[Entry]) -> int:
        """Remove committed, unpinned entries; returns how many were dropped."""
        return sum(self.drop_one(e) for e in list(entries))

    def drop_one(self, entry: Entry) -> bool:
        """Remove ``entry`` if it is committed and unpinned (flush); whether it was."""
        if entry.committed and entry.pins == 0:
            self._unpublish(entry)
            return True
        return False

    def tagged(self, pairs: Sequence[int], ns: str) -> list[Entry]:
        """The committed entries of namespace ``ns`` named by flat (offset, tag) pairs that are
        still in their slot (``Release.touched``: pages a client read without a lease); pairs
        naming nothing (or a trailing odd number) are skipped."""
        out = []
        by_offset = self._by_offset
        for i in range(0, len(pairs) - 1, 2):
            e = by_offset.get(pairs[i])
            if e is not None and e.committed and e.gen == pairs[i + 1] and e.table[0] == ns:
                out.append(e)
        return out

    def at(self, offset: int) -> Entry | None:
        """The entry (any state) holding the slot at ``offset``, or None."""
        return self._by_offset.get(offset)

    def _unpublish(self, entry: Entry) -> None:
        del self.tables[entry.table][entry.key]
        masks = self._presence[entry.table[0]]
        left = masks[entry.key] & ~self.pool_bit(entry.table)
        if left:
            masks[entry.key] = left
        else:
            del masks[entry.key]
        if self.shared is not None:
            self.shared.clear_tag(entry.offset, entry.stride)  # before the slot is freed
            if left:
                self.shared.set(self._fp(entry), left)
            else:
                self.shared.remove(self._fp(entry))
        del self._lru[entry.stride][entry]
        entry.committed = False
        self._free_slot(entry)

    def republish(self, at_most: int = REPUBLISH_MAX) -> bool:
        """Refill a full presence table once L2 holds few enough keys again (at most half the
        table's load, and ``at_most``: each costs ~3 us of the loop); whether it did."""
        t = self.shared
        if t is None or not t.overflowed:
            return False
        n = sum(len(masks) for masks in self._presence.values())
        if n > min(at_most, t.slots * MAX_LOAD / 2):
            return False
        return t.rebuild((fingerprint(self.seed(ns), key), mask)
                         for ns, masks in self._presence.items() for key, mask in masks.items())

    def fingerprint_all(self, entries: Sequence[Entry]) -> None:
        """Fingerprint the keys of ``entries`` in one vectorised call (a commit's pages), so
        that publishing them costs ~0.7 us a key instead of ~2.5 (``presence.fingerprints``)."""
        todo = [e for e in entries if not e.fp] if self.shared is not None else ()
        if len(todo) < 8 or any(e.table[0] != todo[0].table[0] for e in todo):
            return  # few, or of several namespaces: one by one when published
        fps = fingerprints(self.seed(todo[0].table[0]), [e.key for e in todo])
        if fps is not None:
            for e, fp in zip(todo, fps.tolist(), strict=True):
                e.fp = fp

    def seed(self, ns: str) -> int:
        """The fingerprint seed of namespace ``ns`` in the shared presence table."""
        seed = self._seeds.get(ns)
        if seed is None:
            seed = self._seeds[ns] = namespace_seed(ns)
        return seed

    def _fp(self, entry: Entry) -> int:
        if not entry.fp:
            entry.fp = fingerprint(self.seed(entry.table[0]), entry.key)
        return entry.fp

    def _free_slot(self, entry: Entry) -> None:
        self.ns_bytes[entry.table[0]] -= entry.stride
        del self._by_offset[entry.offset]
        self.alloc.free(entry.offset)
        entry.offset = -1

    # ------------------------------------------------------------ chains (a stand-in)

    def link(self, ns: str, keys: Sequence[str], parent: str | None, depth: int) -> None:
        """Record that ``keys`` are consecutive pages of one sequence of namespace ``ns``
        (``Reserve.anchor_pool``): keys[0]'s parent is ``parent`` (None: a root, or not known),
        keys[i+1]'s is keys[i]; keys[i] has ``depth + i`` pages before it (-1 when ``depth`` is
        -1: not known). Only keys the index holds (pending or committed, in any pool of ``ns``)
        are linked; a key linked again keeps the newest links.

        A stand-in: links are not forgotten when a key leaves L2, only no longer reported
        (``chain``), so the map grows with every key ever linked."""
        links = self._links.setdefault(ns, {})
        for i, key in enumerate(keys):
            if self._holds(ns, key):
                links[key] = (keys[i - 1] if i else parent, depth + i if depth >= 0 else -1)

    def chain(self, ns: str, key: str) -> tuple[str | None, int]:
        """(parent key or None, depth or -1) of ``key`` in namespace ``ns`` (``link``); (None,
        -1) for a key never linked or no longer held."""
        found = self._links.get(ns, {}).get(key)
        return found if found is not None and self._holds(ns, key) else (None, -1)

    def _holds(self, ns: str, key: str) -> bool:
        """Whether some pool of ``ns`` holds ``key``, committed or pending."""
        if self._presence.get(ns, {}).get(key):
            return True
        return any(key in self.pending.get((ns, pool), ()) for pool in self._bits.get(ns, ()))
