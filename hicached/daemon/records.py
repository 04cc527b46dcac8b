"""The page index's records: every page and every key L2 holds, as columns of numbers.

``index.py``'s module docstring says what the records hold and why. ``Records`` owns them and
the maps over them (tables and namespaces, each namespace's key table, each slab's slot -> page
record map); it makes and frees records, reads and links keys (chains), and fingerprints keys
for the shared presence table. It decides nothing: the operations on a call's pages
(``reserving.py``, ``commits.py``, ``uses.py``, ``evict.py``) change its columns, in place.
``Entry`` (``entry.py``) is a handle on one of its page records.
"""

from __future__ import annotations

import secrets
import struct
from array import array
from collections.abc import Iterator, Sequence

import numpy as np

from hicached.daemon.columns import grown
from hicached.daemon.entry import (
    _TOP,
    COMMITTED,
    GROW_MIN,
    IN_L3,
    JOURNALED,
    KEY_BYTES,
    MAX_POOLS,
    MAX_TABLES,
    Entry,
    TableId,
    _Keys,
    key_fps,
)
from hicached.daemon.eviction.interface import EvictionPolicy
from hicached.daemon.journal import GRAIN, RECORD, Journal, NullJournal
from hicached.daemon.slabs import SlabAllocator
from hicached.presence import (
    MAX_LOAD,
    PresenceTable,
    fingerprint,
    namespace_seed,
)

# commits of fewer pages are journaled page by page (``journal_each``: ~3.5 us a page here,
# where the numpy pass costs ~35 us a call, and ~0.1 us a page more)
JOURNAL_BATCH_MIN = 10
_KEY_AT = RECORD.fields["key"][1]  # (the key's bytes in a journal record)
REPUBLISH_MAX = 32768  # keys a full presence table is refilled with at most (one pause of ~0.1 s)


class Records:
    """The page index's records (module docstring): it owns the page and key columns, the ids
    of tables and namespaces, the namespaces' key tables, the slot -> record maps, the
    generation and tick counters, the pending handles and owners, and the bytes per namespace.

    It is the ``IndexView`` the policy reads (``eviction/interface.py``; ``policy.bind`` is
    called here): ``page_top``, ``key_top``, ``tick`` are plain fields, read-only to all but the
    index's operations (``reserving.py``, ``commits.py``, ``uses.py``, ``evict.py``), which
    write columns and counters in place. It mutates only its own fields; it calls the policy's
    record hooks (``grow``, ``grow_keys``, ``key_freed``, ``linked``) and the allocator's
    ``free`` (``free_page``). Not thread-safe: the control loop alone calls it.
    """

    def __init__(self, allocator: SlabAllocator, policy: EvictionPolicy,
                 presence: PresenceTable | None = None, journal: Journal | None = None,
                 first_gen: int | None = None):
        self.alloc = allocator
        self.policy = policy
        # the journal of committed slots (``journal.py``): written at commit (``commits.py``),
        # cleared here before a slot is freed; pages of a stride below its grain are not in it
        self.journal = journal if journal is not None else NullJournal()
        self.journal_grain = GRAIN if journal is not None else 1 << 62
        self.journaling = journal is not None  # (none: a commit builds nothing for it)
        # page and key records: numpy columns, each in a mapping of its own (``columns.py``:
        # zeroed lazily by the kernel, so capacity not yet used costs no memory; ``np`` gives
        # vectorised reads), read and written one item at a time through memoryviews (``p_*``,
        # ``k_*``: Python ints, about as fast as a list)
        self.np: dict[str, np.ndarray] = {}
        size = np.int32 if allocator.slab_bytes < 1 << 31 else np.int64  # a page fits a slab
        self.page_cols = {
            "p_tid": np.int16,  # table id (``table_of``), -1 while unbound
            "p_krec": np.int32,  # key record (unbound: its namespace id)
            "p_off": np.int64, "p_stride": size, "p_pbytes": size,
            "p_gen": np.int64,  # 0 while the record is free
            "p_used": np.int64,  # tick of its last use
            "p_hits": np.int32, "p_pins": np.int32, "p_flags": np.uint8,
            "p_knext": np.int32,  # the next page record of the same key, -1 at the end
        }
        self.key_cols = {
            "k_bytes": (np.uint8, KEY_BYTES),  # the key's UTF-8 bytes
            "k_len": np.uint8,  # 0: free record; 255: the key is in ``long_keys``
            "k_ns": np.int16,
            "k_sfp": np.uint64,  # its fingerprint in the shared presence table (0: not yet)
            "k_mask": np.int64,  # pools holding it committed (``pool_bit``)
            "k_head": np.int32,  # its first page record
            "k_parent": np.uint64,  # the parent key's fingerprint in its namespace (0: none)
            "k_depth": np.int32,  # pages before it in its chain (-1: unknown)
        }
        self.grow(self.page_cols, 0, 0)
        self.grow(self.key_cols, 0, 0)
        self.owners: dict[int, int] = {}  # pending page record -> the session that reserved it
        self.page_top = self.key_top = 0  # records ever used (those above were never touched)
        self.page_free = array("i")  # records freed since, to be used again first
        self.key_free = array("i")
        self.long_keys: dict[int, str] = {}
        # tables and namespaces
        self.table_of: list[TableId] = []
        self.tids: dict[TableId, int] = {}
        self.tcount: list[int] = []  # committed pages per table
        self.t_bit: list[int] = []
        self.ns_names: list[str] = []
        self.ns_ids: dict[str, int] = {}
        self.ns_trail: list[int] = []  # per namespace id: the bits of its trailing pools
        self.t_jid = array("i")  # per table id: its id in the journal (-1: not journaled)
        self.t_state = bytearray()  # per table id: 1 if its pool is one of its namespace's
        # trailing pools (its pages are states; ``t_bit[tid] & ns_trail[ns]`` in one lookup)
        self.key_tables: list[_Keys] = []
        # slot -> page record, per slab (an array of its slots), for ``at`` / ``tagged``
        self.slot_recs: dict[int, array] = {}
        self.pending: dict[TableId, dict[str, Entry]] = {}  # pending pages: live handles
        self.tick = 0
        # Slot generations: above every tag of the daemon whose arena this one adopted
        # (``first_gen``: ``journal.first_gen``), else a random start, so tags of an earlier
        # daemon never match this one's.
        self.gen = first_gen if first_gen is not None else secrets.randbits(48) << 8
        self.evictions = 0
        self.committed_count = 0
        self.ns_bytes: dict[str, int] = {}  # namespace digest -> slot bytes held (quotas.py)
        self.pool_bits: dict[str, dict[str, int]] = {}  # ns -> pool -> its bit in the masks
        self.shared = presence  # those masks, published for clients (None: not published)
        self.seeds: dict[str, int] = {}  # ns -> its fingerprint seed in ``shared``
        policy.bind(self)

    # ------------------------------------------------------------ the policies' read view
    # (``eviction/interface.py``: ``IndexView``; also ``orphans.py`` and ``reclaim.py``)

    @property
    def namespace_count(self) -> int:
        """Namespaces seen: their ids are ``range(namespace_count)``."""
        return len(self.ns_names)

    def namespace_id(self, ns: str) -> int:
        """The id of namespace digest ``ns`` (``k_ns``), -1 when never seen."""
        return self.ns_ids.get(ns, -1)

    def table_ids(self, ns: str) -> list[int]:
        """The table ids (``p_tid``) of namespace ``ns``'s pools."""
        return [t for t, (t_ns, _) in enumerate(self.table_of) if t_ns == ns]

    def slab_pages(self, slab_index: int) -> Sequence[int]:
        """The page records in slab ``slab_index``'s slots, slot order (-1: an empty slot;
        empty for a slab never used). The index's own array: read, never keep, never write."""
        return self.slot_recs.get(slab_index, ())

    def key_records(self, nsid: int, fps: np.ndarray) -> np.ndarray:
        """Per key-table fingerprint ``fps`` (uint64; ``k_parent`` holds such), the key
        record of namespace id ``nsid`` it stands for, -1 for none (int64)."""
        return self.key_tables[nsid].table.get_many(fps).astype(np.int64)

    # ------------------------------------------------------------ records

    def grow(self, cols: dict, old: int, new: int) -> None:
        """Columns ``cols`` of ``old`` records now hold ``new``."""
        for name, dtype in cols.items():
            dtype, width = dtype if isinstance(dtype, tuple) else (dtype, 1)
            arr = grown(self.np[name][:old * width] if old else (), new * width, dtype)
            self.np[name] = arr
            setattr(self, name, memoryview(arr))

    def new_page(self) -> int:
        if self.page_free:
            return self.page_free.pop()
        p = self.page_top
        if p == len(self.p_gen):
            new = p + max(GROW_MIN, p >> 3)
            self.grow(self.page_cols, p, new)
            self.policy.grow(new)
        self.page_top = p + 1
        return p

    def new_key(self) -> int:
        if self.key_free:
            return self.key_free.pop()
        k = self.key_top
        if k == len(self.k_len):
            new = k + max(GROW_MIN, k >> 3)
            self.grow(self.key_cols, k, new)
            self.policy.grow_keys(new)
        self.key_top = k + 1
        return k

    # ------------------------------------------------------------ records made and freed

    def new_pages(self, n: int) -> np.ndarray:
        """``n`` page records, the ones ``n`` calls of ``new_page`` would give, in order."""
        out, self.page_top = self._new_records(n, self.page_free, self.page_top, "p_gen",
                                               self.page_cols, self.policy.grow)
        return out

    def new_keys(self, n: int) -> np.ndarray:
        """``n`` key records, the ones ``n`` calls of ``new_key`` would give, in order."""
        out, self.key_top = self._new_records(n, self.key_free, self.key_top, "k_len",
                                              self.key_cols, self.policy.grow_keys)
        return out

    def _new_records(self, n: int, free, top: int, sized_by: str, cols,
                     grow_policy) -> tuple[np.ndarray, int]:
        """(``n`` records: the last freed first, then new ones from ``top``; the new top). The
        columns ``cols`` (their length: column ``sized_by``'s) grow as one record at a time
        would grow them, step by step, and the policy's with them (``grow_policy``)."""
        out = np.empty(n, np.int64)
        k = min(n, len(free))
        if k:
            out[:k] = np.frombuffer(free[len(free) - k:][::-1], np.int32)
            del free[len(free) - k:]
        while top + n - k > len(getattr(self, sized_by)):
            size = len(getattr(self, sized_by))
            self.grow(cols, size, size + max(GROW_MIN, size >> 3))
            grow_policy(len(getattr(self, sized_by)))
        out[k:] = np.arange(top, top + n - k)
        return out, top + n - k

    def new_gen(self) -> int:
        """A fresh slot generation."""
        self.gen += 1
        return self.gen

    def place(self, p: int, offset: int, stride: int) -> None:
        """Page record ``p`` holds the slot at ``offset`` (its slab's slot map)."""
        slab = self.alloc.slab_of(offset)
        slots = self.slot_recs.get(slab.index)
        if slots is None or len(slots) != slab.num_slots:
            slots = self.slot_recs[slab.index] = array("i", [-1]) * slab.num_slots
        slots[(offset - slab.offset) // stride] = p

    def init_page(self, p: int, tid: int, k: int, offset: int, page_bytes: int, stride: int,
                  flags: int) -> None:
        """Fill page record ``p`` (a fresh generation, unpinned, no use yet) and place it."""
        self.p_tid[p], self.p_krec[p] = tid, k
        self.p_off[p], self.p_stride[p], self.p_pbytes[p] = offset, stride, page_bytes
        self.p_gen[p] = self.new_gen()
        self.p_used[p] = self.p_hits[p] = self.p_pins[p] = 0
        self.p_flags[p] = flags
        self.p_knext[p] = -1
        self.place(p, offset, stride)

    def rec_at(self, offset: int) -> int:
        """The page record holding the slot at ``offset`` (any state), -1 for none."""
        slab = self.alloc.slab_of(offset)
        slots = self.slot_recs.get(slab.index)
        if slots is None or not slab.stride or len(slots) != slab.num_slots:
            return -1
        rel = offset - slab.offset
        if rel % slab.stride:
            return -1
        i = rel // slab.stride
        return slots[i] if i < len(slots) else -1

    def free_page(self, p: int) -> None:
        """Free page record ``p`` and its slot (and its key record with its key's last page)."""
        tid, k = self.p_tid[p], self.p_krec[p]
        ns = self.table_of[tid][0] if tid >= 0 else self.ns_names[k]
        offset = self.p_off[p]
        self.ns_bytes[ns] -= self.p_stride[p]
        if self.p_stride[p] >= self.journal_grain:
            self.journal.clear(offset)  # before the free: the slot may be handed out next
        slab = self.alloc.slab_of(offset)
        self.slot_recs[slab.index][(offset - slab.offset) // slab.stride] = -1
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
        self.page_free.append(p)

    def free_pages(self, ps: list[int], arr: np.ndarray) -> None:
        """``free_page`` of each of page records ``ps`` (``arr``: the same, int64; each once,
        each of a bound table: an eviction's committed pages, ``Evictor``) in turn, in one pass:
        the columns at once, then the slots freed and the keys unlinked (their records freed
        with their last page) in the order of ``ps``: the same state, to the free lists'
        order. (Every journal record is cleared before the first slot is freed.)"""
        cols = self.np
        tids, offs, strides = cols["p_tid"][arr], cols["p_off"][arr], cols["p_stride"][arr]
        ns_bytes, table_of = self.ns_bytes, self.table_of
        if tids[0] == tids[-1] and not np.count_nonzero(tids != tids[0]):
            ns_bytes[table_of[int(tids[0])][0]] -= int(strides.sum())
        else:
            for tid, stride in zip(tids.tolist(), strides.tolist()):
                ns_bytes[table_of[tid][0]] -= stride
        journaled = strides >= self.journal_grain
        if journaled.any():
            self.journal.clear_many(offs[journaled])
        sb = self.alloc.slab_bytes
        slabs = offs // sb
        slots = (offs - slabs * sb) // strides  # (a committed page's stride is its slab's)
        if slabs[0] == slabs[-1] and not np.count_nonzero(slabs != slabs[0]):  # (one slab)
            np.frombuffer(self.slot_recs[int(slabs[0])], np.int32)[slots] = -1
        else:
            for si in dict.fromkeys(slabs.tolist()):
                np.frombuffer(self.slot_recs[si], np.int32)[slots[slabs == si]] = -1
        self.alloc.free_many(offs.tolist())
        k_head, knext, free_key = self.k_head, self.p_knext, self._free_key
        for p, k in zip(ps, cols["p_krec"][arr].tolist()):  # unlink from its key's pages
            nxt = knext[p]
            q = k_head[k]
            if q == p:
                k_head[k] = nxt
                if nxt < 0:
                    free_key(k)
            else:
                while knext[q] != p:
                    q = knext[q]
                knext[q] = nxt
        cols["p_gen"][arr] = 0
        cols["p_flags"][arr] = 0
        cols["p_pins"][arr] = 0
        owners = self.owners
        if owners:
            for p in ps:
                owners.pop(p, None)
        self.page_free.extend(ps)

    def _free_key(self, k: int) -> None:
        self.policy.key_freed(k)
        self.key_tables[self.k_ns[k]].table.remove((hash(self.key_of(k)) + _TOP) or 1)
        if self.k_len[k] == 255:
            del self.long_keys[k]
        self.k_len[k] = 0
        self.key_free.append(k)

    def ns_id(self, ns: str) -> int:
        """The id of namespace digest ``ns``, given on first use (its key table made)."""
        i = self.ns_ids.get(ns)
        if i is None:
            i = self.ns_ids[ns] = len(self.ns_names)
            self.ns_names.append(ns)
            self.key_tables.append(_Keys())
            self.ns_trail.append(0)
        return i

    def table_id(self, table: TableId) -> int:
        """``table``'s id in the page records, given on first use (ValueError past
        ``MAX_TABLES`` (namespace, pool) pairs in this daemon's life, or as ``pool_bit``)."""
        tid = self.tids.get(table)
        if tid is None:
            if len(self.table_of) >= MAX_TABLES:
                raise ValueError(f"this daemon has seen {MAX_TABLES} (namespace, pool) pairs, the "
                                 "most its page records can tell apart: restart it")
            bit = self.pool_bit(table)
            tid = self.tids[table] = len(self.table_of)
            self.table_of.append(table)
            self.tcount.append(0)
            self.t_bit.append(bit)
            self.t_state.append(1 if self.ns_trail[self.ns_id(table[0])] & bit else 0)
            self.t_jid.append(self.journal.table(table[0], table[1], bool(self.t_state[tid])))
        return tid

    def mark_trailing(self, table: TableId) -> None:
        """``table``'s pool has TRAILING_PAGES hits (a state: ``Reserve.trailing``)."""
        tid = self.table_id(table)
        self.ns_trail[self.ns_ids[table[0]]] |= self.t_bit[tid]
        self.t_state[tid] = 1
        self.journal.table(table[0], table[1], True)

    def trailing(self, ns: str) -> int:
        """The pool bits of namespace ``ns``'s trailing pools."""
        i = self.ns_ids.get(ns)
        return self.ns_trail[i] if i is not None else 0

    def fp(self, keys: _Keys, key: str) -> int:
        return (hash(key) + _TOP) or 1

    def key_of(self, k: int) -> str:
        n = self.k_len[k]
        if n == 255:
            return self.long_keys[k]
        return self.k_bytes[k * KEY_BYTES:k * KEY_BYTES + n].tobytes().decode()

    def find_key(self, ns: str, key: str) -> int:
        """The key record of (ns, key), or -1."""
        i = self.ns_ids.get(ns)
        if i is None:
            return -1
        keys = self.key_tables[i]
        k = keys.table.get(self.fp(keys, key))
        if k < 0 or not self.same_key(k, key):
            return -1
        return k

    def same_key(self, k: int, key: str) -> bool:
        n = self.k_len[k]
        if n == 255:
            return self.long_keys.get(k) == key
        b = key.encode()
        at = k * KEY_BYTES
        return len(b) == n and self.k_bytes[at:at + n] == b

    def key_record(self, ns: str, key: str) -> int:
        """The key record of (ns, key), made if missing; -1 on a fingerprint collision."""
        keys = self.key_tables[self.ns_id(ns)]
        fp = self.fp(keys, key)
        k = keys.table.get(fp)
        if k >= 0:
            return k if self.same_key(k, key) else -1
        return self.add_key(keys, fp, self.ns_ids[ns], key)

    def add_key(self, keys: _Keys, fp: int, nsid: int, key: str) -> int:
        """A new key record for ``key`` of namespace id ``nsid``, with no page, no parent and
        an unknown depth, entered in ``keys`` (its namespace's key table) under fingerprint
        ``fp``, which the caller found free there."""
        k = self.new_key()
        b = key.encode()
        if 0 < len(b) <= KEY_BYTES:
            self.k_bytes[k * KEY_BYTES:k * KEY_BYTES + len(b)] = b
            self.k_len[k] = len(b)
        else:  # long (or empty: a length of 0 marks a free record)
            self.k_len[k] = 255
            self.long_keys[k] = key
        self.k_ns[k] = nsid
        self.k_sfp[k] = self.k_mask[k] = self.k_parent[k] = 0
        self.k_head[k] = -1
        self.k_depth[k] = -1
        keys.table.put(fp, k)
        return k

    def page_of(self, k: int, tid: int) -> int:
        p = self.k_head[k]
        while p >= 0 and self.p_tid[p] != tid:
            p = self.p_knext[p]
        return p

    def handle(self, p: int, key: str | None = None) -> Entry:
        tid = self.p_tid[p]
        if tid < 0:
            return Entry(self, p, (self.ns_names[self.p_krec[p]], ""), "")
        return Entry(self, p, self.table_of[tid], self.key_of(self.p_krec[p]) if key is None
                     else key)

    def pool_bit(self, table: TableId) -> int:
        """The bit of ``table``'s pool in its namespace's presence masks (given on first use;
        ValueError past ``MAX_POOLS`` pools in one namespace)."""
        ns, pool = table
        bits = self.pool_bits.setdefault(ns, {})
        bit = bits.get(pool)
        if bit is None:
            if len(bits) >= MAX_POOLS:
                raise ValueError(f"a namespace holds at most {MAX_POOLS} pools")
            bit = bits[pool] = 1 << len(bits)
        return bit

    def __len__(self) -> int:
        return self.committed_count

    @property
    def tables(self) -> dict[TableId, dict[str, Entry]]:
        """Committed entries per table: a snapshot, made on demand (tests and tools; it walks
        every page)."""
        out: dict[TableId, dict[str, Entry]] = {}
        for e in self.entries():
            out.setdefault(e.table, {})[e.key] = e
        return out

    def table(self, table: TableId) -> dict[str, Entry]:
        """The committed entries of one table: a snapshot, as ``tables``."""
        return {e.key: e for e in self.entries() if e.table == table}

    def counts(self) -> dict[TableId, int]:
        """Committed pages per table."""
        return {t: n for t, n in zip(self.table_of, self.tcount) if n}

    def entries(self, ns: str | None = None) -> Iterator[Entry]:
        """Every committed page (of ``ns``), in no particular order."""
        nsid = self.ns_ids.get(ns, -2) if ns is not None else -1
        for p in range(self.page_top):
            if self.p_flags[p] & COMMITTED and (nsid == -1 or self.k_ns[self.p_krec[p]] == nsid):
                yield self.handle(p)

    def forget_in_l3(self, handles: bool = False, ns: str | None = None) -> list[Entry]:
        """Clear the "in L3" flag of every committed page (of namespace digest ``ns``) at once
        (an L3 detached, cleared or that may have lost its pages: a few ms for a million
        pages, where a walk of handles held the control loop for seconds); with ``handles``,
        those of the pages that had it, in record order (else none)."""
        top = self.page_top
        flags = self.np["p_flags"][:top]
        mine = (flags & (COMMITTED | IN_L3)) == (COMMITTED | IN_L3)
        if ns is not None:
            nsid = self.ns_ids.get(ns)
            if nsid is None:
                return []
            mine &= self.np["k_ns"][self.np["p_krec"][:top]] == nsid  # (committed: a key's)
        had = np.flatnonzero(mine)
        flags[had] &= np.uint8(0xFF ^ IN_L3)
        offs = self.np["p_off"][had][self.np["p_stride"][had] >= self.journal_grain]
        for off in offs.tolist():
            self.journal.set_in_l3(off, False)
        return [self.handle(p) for p in had.tolist()] if handles else []

    # ------------------------------------------------------------ chains

    def link(self, ns: str, keys: Sequence[str], parent: str | None, depth: int) -> None:
        """``keys[0]``'s parent is ``parent`` (None: a root, of unknown depth unless ``depth``
        >= 0), ``keys[i+1]``'s is ``keys[i]``; depth of ``keys[i]`` is ``depth + i`` (-1 when
        unknown). Kept for keys L2 holds a page of (pending or committed), by (namespace,
        key), until the last page of the key leaves; the newest link wins."""
        i = self.ns_ids.get(ns)
        if i is None:
            return
        ks = self.key_tables[i]
        prev = self.fp(ks, parent) if parent is not None else 0
        n = len(keys)
        if n >= 32:  # vectorised (a fingerprint collision, 2^-64, mislinks a key: advice only)
            fps = key_fps(keys)
            recs = ks.table.get_many(fps)
            parents = np.empty(n, np.uint64)
            parents[0] = prev
            parents[1:] = fps[:-1]
            held = recs >= 0
            self.np["k_parent"][recs[held]] = parents[held]
            self.np["k_depth"][recs[held]] = (np.flatnonzero(held) + depth if depth >= 0
                                              else -1)
            self.policy.linked(recs, ks.table.get(prev) if prev else -1)
            return
        up = ks.table.get(prev) if prev else -1
        recs = []
        for j, key in enumerate(keys):
            fp = self.fp(ks, key)
            k = ks.table.get(fp)
            if k >= 0 and self.same_key(k, key):
                self.k_parent[k] = prev
                self.k_depth[k] = depth + j if depth >= 0 else -1
            else:
                k = -1
            recs.append(k)
            prev = fp
        self.policy.linked(recs, up)

    def parent_pages(self, entry: Entry) -> list[Entry]:
        """The committed pages of ``entry``'s parent key (its chain's page before it), every
        pool; empty when L2 holds none or the chain is not known."""
        k = self.p_krec[entry.rec]
        if self.p_gen[entry.rec] != entry.gen or not self.k_parent[k]:
            return []
        return self.committed_pages(self.key_tables[self.k_ns[k]].table.get(self.k_parent[k]))

    def key_pages(self, ns: str, key: str) -> list[Entry]:
        """The committed pages of (``ns``, ``key``), every pool."""
        return self.committed_pages(self.find_key(ns, key))

    def committed_pages(self, k: int) -> list[Entry]:
        out = []
        p = self.k_head[k] if k >= 0 else -1
        while p >= 0:
            if self.p_flags[p] & COMMITTED:
                out.append(self.handle(p))
            p = self.p_knext[p]
        return out

    def chain(self, ns: str, key: str) -> tuple[str | None, int]:
        """(the parent key, when L2 holds a page of it, else None; the depth, -1 unknown)."""
        k = self.find_key(ns, key)
        if k < 0:
            return None, -1
        parent = None
        if self.k_parent[k]:
            pk = self.key_tables[self.k_ns[k]].table.get(self.k_parent[k])
            if pk >= 0:
                parent = self.key_of(pk)
        return parent, self.k_depth[k]

    # ------------------------------------------------------------ the journal

    def journal_reserved(self, offsets: np.ndarray, gens: np.ndarray, fps: np.ndarray,
                         mine: np.ndarray, tid: int, stride: int, page_bytes: int) -> bool:
        """Slots just reserved in one run (``Reservations``), for keys of ``mine``'s bytes
        (one row each) with fingerprints ``fps``, of table ``tid``: write their journal
        records' fixed part now, from what the run has in hand (``Journal.write_fixed``:
        not valid until their commit), and say whether it did (the pages are then flagged
        ``JOURNALED``: their commit writes the rest, ``journal_pages``)."""
        n = len(offsets)
        if not self.journaling or stride < self.journal_grain or n < JOURNAL_BATCH_MIN:
            return False
        jt = self.t_jid[tid]
        if jt < 0:
            return False
        rec = np.zeros(n, RECORD)
        rec["gen"] = gens
        rec["offset"] = offsets
        rec["fp"] = fps
        rec["page_bytes"] = page_bytes
        rec["stride"] = stride
        rec["table"] = jt
        rec["key_len"] = width = mine.shape[1]
        rec.view(np.uint8).reshape(n, RECORD.itemsize)[:, _KEY_AT:_KEY_AT + width] = mine
        self.journal.write_fixed(offsets, rec.view(np.uint64).reshape(n, 16))
        return True

    def journal_pages(self, ps: np.ndarray, entries: Sequence[Entry]) -> None:
        """Journal committed page records ``ps`` (int64; ``journal.py``) of ``entries`` (their
        handles, in order): those of a stride of at least the journal's grain, of a table it
        names. Pages whose reservation wrote their record's fixed part (all ``JOURNALED``):
        the rest (``Journal.write_rest``); else few pages one by one in Python
        (``journal_each``), more in one numpy pass.

        A chain is journaled as this process's key-table fingerprints, the key's own and its
        parent's (``k_parent``): the successor matches the two among the records it adopts,
        all written by one process (it journals what it adopts again, under its own)."""
        if len(ps) < JOURNAL_BATCH_MIN:
            return self.journal_each(ps.tolist(), [e.key for e in entries])
        cols = self.np
        flags = cols["p_flags"][ps]
        if np.bitwise_and.reduce(flags) & JOURNALED:
            krecs = cols["p_krec"][ps]
            self.journal.write_rest(cols["p_off"][ps], cols["p_used"][ps],
                                    cols["k_parent"][krecs], cols["k_depth"][krecs],
                                    flags & (COMMITTED | IN_L3))
            return
        keys = [e.key for e in entries]
        strides = cols["p_stride"][ps]
        jt = np.frombuffer(self.t_jid, np.int32)[cols["p_tid"][ps]]
        fps = key_fps(keys)
        if strides.min() < self.journal_grain or jt.min() < 0:
            keep = (strides >= self.journal_grain) & (jt >= 0)
            ps, strides, jt, fps, flags = ps[keep], strides[keep], jt[keep], fps[keep], flags[keep]
            if not len(ps):
                return
        krecs = cols["p_krec"][ps]
        rec = np.empty(len(ps), RECORD)  # field by field: numpy casts as it stores
        rec["seq"] = cols["p_used"][ps]
        rec["gen"] = cols["p_gen"][ps]
        rec["offset"] = offs = cols["p_off"][ps]
        rec["fp"] = fps
        rec["parent"] = cols["k_parent"][krecs]
        rec["depth"] = cols["k_depth"][krecs]
        rec["page_bytes"] = cols["p_pbytes"][ps]
        rec["stride"] = strides
        rec["table"] = jt
        lens = rec["key_len"]
        lens[:] = cols["k_len"][krecs]
        lens[lens == 255] = 0
        rec["flags"] = flags & (COMMITTED | IN_L3)
        body = rec.view(np.uint64).reshape(-1, 16)
        body[:, 7:15] = cols["k_bytes"].view(np.uint64).reshape(-1, 8)[krecs]
        self.journal.write(offs, body)

    def journal_each(self, ps: list[int], keys: Sequence[str]) -> None:
        """``journal_pages`` of a few pages (page records ``ps`` of ``keys``), one by one:
        Python ints, no numpy call."""
        grain, t_jid, journal = self.journal_grain, self.t_jid, self.journal
        kb = self.k_bytes
        for p, key in zip(ps, keys):
            stride = self.p_stride[p]
            if stride < grain:
                continue
            jt = t_jid[self.p_tid[p]]
            if jt < 0:
                continue
            k = self.p_krec[p]
            n = self.k_len[k]
            words = [self.p_used[p], self.p_gen[p], self.p_off[p], (hash(key) + _TOP) or 1,
                     self.k_parent[k], (self.k_depth[k] & 0xFFFFFFFF) | (self.p_pbytes[p] << 32),
                     stride | (jt << 32) | ((0 if n == 255 else n) << 48)
                     | ((self.p_flags[p] & (COMMITTED | IN_L3)) << 56)]
            words += struct.unpack_from("<8Q", kb, k * KEY_BYTES)
            journal.write_one(self.p_off[p], words)

    # ------------------------------------------------------------ the shared presence table

    def republish(self, at_most: int = REPUBLISH_MAX) -> bool:
        """Refill a full presence table once L2 holds few enough keys again (at most half the
        table's load, and ``at_most``: each costs ~3 us of the loop); whether it did."""
        t = self.shared
        if t is None or not t.overflowed:
            return False
        ks = np.flatnonzero(self.np["k_mask"][:self.key_top]).tolist()
        if len(ks) > min(at_most, t.slots * MAX_LOAD / 2):
            return False
        return t.rebuild((self.sfp(k), self.k_mask[k]) for k in ks)

    def seed(self, ns: str) -> int:
        """The fingerprint seed of namespace ``ns`` in the shared presence table."""
        seed = self.seeds.get(ns)
        if seed is None:
            seed = self.seeds[ns] = namespace_seed(ns)
        return seed

    def sfp(self, k: int) -> int:
        fp = self.k_sfp[k]
        if not fp:
            fp = self.k_sfp[k] = fingerprint(self.seed(self.ns_names[self.k_ns[k]]),
                                             self.key_of(k))
        return fp
