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
hash, itself salted per process: this table never leaves the process), looked up for 1024 keys at once
with numpy. About 220 bytes a page in all (``tools/bench_index.py`` measures it).

``Entry`` is a handle on a page record, made when code asks for one: its fixed fields (table,
key, slot, generation) are copied into it, its mutable state (pins, flags, hits) is read through
to the records, so two handles of one page always agree and a handle of a page that is gone reads
as uncommitted and unpinned. Handles compare equal when they name the same page (record and
generation). A fingerprint collision costs a miss, never wrong bytes: a page is served only after
its key's bytes compared equal.

Eviction asks one policy object which pages go next (``policy.py``): ``_make_room`` when a size
class has no free slot, slab reclaim, quotas, the L3 audit.

Presence (``presence``): a key record's mask is the OR of ``pool_bit`` of the pools holding the
key committed, kept by ``commit`` and ``_unpublish``, so an exists query looks every key up once
for all its pools. With ``shared`` set, every change of a mask is also published in the
shared-memory presence table (``presence.py``), from which clients answer exists without asking,
and so is every committed large page's slot tag (its generation, from ``commit`` until
``_unpublish`` frees the slot), with which clients read pages without a lease.
"""

from __future__ import annotations

import secrets
from array import array
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from hicached.daemon.fptable import FpTable
from hicached.daemon.policy import LruPolicy
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
MAX_TABLES = 32767  # (namespace, pool) pairs a daemon's life may see: an int16 in each record
REPUBLISH_MAX = 32768  # keys a full presence table is refilled with at most (one pause of ~0.1 s)
KEY_BYTES = 64  # a key of up to this many UTF-8 bytes is kept inline in its record (else a dict)
GROW_MIN = 1 << 12  # records added at least when the arrays grow (then an eighth more)

# page flags
COMMITTED, PENDING, IN_L3, WRITING, FROM_L3 = 1, 2, 4, 8, 16
_TOP = 1 << 63  # Python's hash (int64) + 2**63: the same bits as uint64, the top one flipped


class Entry:
    """A handle on one page record (see the module docstring)."""

    __slots__ = ("_ix", "_offset", "gen", "key", "rec", "stride", "table")

    def __init__(self, ix: PageIndex, rec: int, table: TableId, key: str):
        self._ix = ix
        self.rec = rec
        self.table = table
        self.key = key
        self._offset = ix.p_off[rec]
        self.stride = ix.p_stride[rec]
        self.gen = ix.p_gen[rec]

    @property
    def page_bytes(self) -> int:
        return self._ix.p_pbytes[self.rec]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Entry) and self.gen == other.gen and self.rec == other.rec
                and self._ix is other._ix)

    def __hash__(self) -> int:
        return hash(self.gen)

    @property
    def alive(self) -> bool:
        """Its page still holds its slot (committed, pending or unbound)."""
        return self._ix.p_gen[self.rec] == self.gen

    @property
    def offset(self) -> int:
        """Its slot in the arena; -1 once its page is gone."""
        return self._offset if self._ix.p_gen[self.rec] == self.gen else -1

    # each read checks the generation: a handle of a page that is gone reads as gone
    @property
    def committed(self) -> bool:
        ix, r = self._ix, self.rec
        return ix.p_gen[r] == self.gen and ix.p_flags[r] & COMMITTED != 0

    @property
    def in_l3(self) -> bool:
        """A copy is known to be in the L3 backend."""
        ix, r = self._ix, self.rec
        return ix.p_gen[r] == self.gen and ix.p_flags[r] & IN_L3 != 0

    @in_l3.setter
    def in_l3(self, on: bool) -> None:
        self._set_flag(IN_L3, on)

    @property
    def writing(self) -> bool:
        """An L3 write of this page is in flight."""
        ix, r = self._ix, self.rec
        return ix.p_gen[r] == self.gen and ix.p_flags[r] & WRITING != 0

    @writing.setter
    def writing(self, on: bool) -> None:
        self._set_flag(WRITING, on)

    @property
    def from_l3(self) -> bool:
        """Loaded from L3 and not read since (its first read is an L3 hit)."""
        ix, r = self._ix, self.rec
        return ix.p_gen[r] == self.gen and ix.p_flags[r] & FROM_L3 != 0

    @from_l3.setter
    def from_l3(self, on: bool) -> None:
        self._set_flag(FROM_L3, on)

    def _set_flag(self, flag: int, on: bool) -> None:
        ix, r = self._ix, self.rec
        if ix.p_gen[r] == self.gen:
            ix.p_flags[r] = ix.p_flags[r] | flag if on else ix.p_flags[r] & ~flag

    @property
    def pins(self) -> int:
        ix, r = self._ix, self.rec
        return ix.p_pins[r] if ix.p_gen[r] == self.gen else 0

    @property
    def last_used(self) -> int:
        ix, r = self._ix, self.rec
        return ix.p_used[r] if ix.p_gen[r] == self.gen else 0

    @property
    def hits(self) -> int:
        ix, r = self._ix, self.rec
        return ix.p_hits[r] if ix.p_gen[r] == self.gen else 0

    @hits.setter
    def hits(self, n: int) -> None:
        ix, r = self._ix, self.rec
        if ix.p_gen[r] == self.gen:
            ix.p_hits[r] = min(n, 0x7FFFFFFF)

    @property
    def owner(self) -> int:
        """Pending: the session that reserved it (0: the daemon, an L3 load)."""
        ix, r = self._ix, self.rec
        return ix.owners.get(r, 0) if ix.p_gen[r] == self.gen else 0

    @owner.setter
    def owner(self, sid: int) -> None:
        ix, r = self._ix, self.rec
        if ix.p_gen[r] == self.gen:
            ix.owners[r] = sid

    def __repr__(self) -> str:
        state = "committed" if self.committed else "pending" if self.alive else "gone"
        return f"Entry({self.table[1]}:{self.key} @{self.offset} {state} pins={self.pins})"


class _Keys:
    """One namespace's keys: fingerprint -> key record."""

    __slots__ = ("table",)

    def __init__(self):
        self.table = FpTable()


class PageIndex:
    """Page and key records, pins and eviction over a ``SlabAllocator``.

    Not thread-safe: only the daemon's control loop calls it.
    ``on_evict(entry)`` runs for every evicted committed page (before its slot is reused).
    """

    def __init__(self, allocator: SlabAllocator, on_evict: Callable[[Entry], None] | None = None,
                 policy: LruPolicy | None = None):
        self.alloc = allocator
        self.on_evict = on_evict
        self.policy = policy or LruPolicy()
        self.policy.bind(self)
        # page and key records: numpy columns (zeroed lazily by the kernel, so capacity not yet
        # used costs no memory, and ``np`` gives vectorised reads), read and written one item at
        # a time through memoryviews (``p_*``, ``k_*``: Python ints, about as fast as a list)
        self.np: dict[str, np.ndarray] = {}
        size = np.int32 if allocator.slab_bytes < 1 << 31 else np.int64  # a page fits a slab
        self._page_cols = {
            "p_tid": np.int16,  # table id (``_tables``), -1 while unbound
            "p_krec": np.int32,  # key record (unbound: its namespace id)
            "p_off": np.int64, "p_stride": size, "p_pbytes": size,
            "p_gen": np.int64,  # 0 while the record is free
            "p_used": np.int64,  # tick of its last use
            "p_hits": np.int32, "p_pins": np.int32, "p_flags": np.uint8,
            "p_knext": np.int32,  # the next page record of the same key, -1 at the end
        }
        self._key_cols = {
            "k_bytes": (np.uint8, KEY_BYTES),  # the key's UTF-8 bytes
            "k_len": np.uint8,  # 0: free record; 255: the key is in ``_long_keys``
            "k_ns": np.int16,
            "k_sfp": np.uint64,  # its fingerprint in the shared presence table (0: not yet)
            "k_mask": np.int64,  # pools holding it committed (``pool_bit``)
            "k_head": np.int32,  # its first page record
            "k_parent": np.uint64,  # the parent key's fingerprint in its namespace (0: none)
            "k_depth": np.int32,  # pages before it in its chain (-1: unknown)
        }
        self._grow(self._page_cols, 0, 0)
        self._grow(self._key_cols, 0, 0)
        self.owners: dict[int, int] = {}  # pending page record -> the session that reserved it
        self._p_top = self._k_top = 0  # records ever used (those above were never touched)
        self._p_free = array("i")  # records freed since, to be used again first
        self._k_free = array("i")
        self._long_keys: dict[int, str] = {}
        # tables and namespaces
        self._tables: list[TableId] = []
        self._tid: dict[TableId, int] = {}
        self._tcount: list[int] = []  # committed pages per table
        self._tbit: list[int] = []
        self._ns_names: list[str] = []
        self._ns_id: dict[str, int] = {}
        self._keys: list[_Keys] = []
        # slot -> page record, per slab (an array of its slots), for ``at`` / ``tagged``
        self._slots: dict[int, array] = {}
        self.pending: dict[TableId, dict[str, Entry]] = {}  # pending pages: live handles
        self._tick = 0
        # Slot generations: a random start, so tags of an earlier daemon never match this one's.
        self._gen = secrets.randbits(48) << 8
        self.evictions = 0
        self.committed_count = 0
        self.ns_bytes: dict[str, int] = {}  # namespace digest -> slot bytes held (quotas.py)
        self._bits: dict[str, dict[str, int]] = {}  # ns -> pool -> its bit in the masks
        self.shared: PresenceTable | None = None  # those masks, published for clients
        self._seeds: dict[str, int] = {}  # ns -> its fingerprint seed in ``shared``

    # ------------------------------------------------------------ records

    def _grow(self, cols: dict, old: int, new: int) -> None:
        """Columns ``cols`` of ``old`` records now hold ``new``."""
        for name, dtype in cols.items():
            dtype, width = dtype if isinstance(dtype, tuple) else (dtype, 1)
            arr = np.zeros(new * width, dtype)
            if old:
                arr[:old * width] = self.np[name]
            self.np[name] = arr
            setattr(self, name, memoryview(arr))

    def _new_page(self) -> int:
        if self._p_free:
            return self._p_free.pop()
        p = self._p_top
        if p == len(self.p_gen):
            new = p + max(GROW_MIN, p >> 3)
            self._grow(self._page_cols, p, new)
            self.policy.grow(new)
        self._p_top = p + 1
        return p

    def _new_key(self) -> int:
        if self._k_free:
            return self._k_free.pop()
        k = self._k_top
        if k == len(self.k_len):
            self._grow(self._key_cols, k, k + max(GROW_MIN, k >> 3))
        self._k_top = k + 1
        return k

    def _ns(self, ns: str) -> int:
        i = self._ns_id.get(ns)
        if i is None:
            i = self._ns_id[ns] = len(self._ns_names)
            self._ns_names.append(ns)
            self._keys.append(_Keys())
        return i

    def table_id(self, table: TableId) -> int:
        """``table``'s id in the page records, given on first use (ValueError past
        ``MAX_TABLES`` (namespace, pool) pairs in this daemon's life, or as ``pool_bit``)."""
        tid = self._tid.get(table)
        if tid is None:
            if len(self._tables) >= MAX_TABLES:
                raise ValueError(f"this daemon has seen {MAX_TABLES} (namespace, pool) pairs, the "
                                 "most its page records can tell apart: restart it")
            bit = self.pool_bit(table)
            tid = self._tid[table] = len(self._tables)
            self._tables.append(table)
            self._tcount.append(0)
            self._tbit.append(bit)
            self._ns(table[0])
        return tid

    def _fp(self, keys: _Keys, key: str) -> int:
        return (hash(key) + _TOP) or 1

    def _key_of(self, k: int) -> str:
        n = self.k_len[k]
        if n == 255:
            return self._long_keys[k]
        return self.k_bytes[k * KEY_BYTES:k * KEY_BYTES + n].tobytes().decode()

    def _find_key(self, ns: str, key: str) -> int:
        """The key record of (ns, key), or -1."""
        i = self._ns_id.get(ns)
        if i is None:
            return -1
        keys = self._keys[i]
        k = keys.table.get(self._fp(keys, key))
        if k < 0 or not self._same_key(k, key):
            return -1
        return k

    def _same_key(self, k: int, key: str) -> bool:
        n = self.k_len[k]
        if n == 255:
            return self._long_keys.get(k) == key
        b = key.encode()
        at = k * KEY_BYTES
        return len(b) == n and self.k_bytes[at:at + n] == b

    def _key_record(self, ns: str, key: str) -> int:
        """The key record of (ns, key), made if missing; -1 on a fingerprint collision."""
        keys = self._keys[self._ns(ns)]
        fp = self._fp(keys, key)
        k = keys.table.get(fp)
        if k >= 0:
            return k if self._same_key(k, key) else -1
        k = self._new_key()
        b = key.encode()
        if 0 < len(b) <= KEY_BYTES:
            self.k_bytes[k * KEY_BYTES:k * KEY_BYTES + len(b)] = b
            self.k_len[k] = len(b)
        else:  # long (or empty: a length of 0 marks a free record)
            self.k_len[k] = 255
            self._long_keys[k] = key
        self.k_ns[k] = self._ns_id[ns]
        self.k_sfp[k] = 0
        self.k_mask[k] = 0
        self.k_head[k] = -1
        self.k_parent[k] = 0
        self.k_depth[k] = -1
        keys.table.put(fp, k)
        return k

    def _page_of(self, k: int, tid: int) -> int:
        p = self.k_head[k]
        while p >= 0 and self.p_tid[p] != tid:
            p = self.p_knext[p]
        return p

    def handle(self, p: int, key: str | None = None) -> Entry:
        tid = self.p_tid[p]
        if tid < 0:
            return Entry(self, p, (self._ns_names[self.p_krec[p]], ""), "")
        return Entry(self, p, self._tables[tid], self._key_of(self.p_krec[p]) if key is None
                     else key)

    # ------------------------------------------------------------ lookups

    def get(self, table: TableId, key: str) -> Entry | None:
        """The committed entry of ``key`` or None."""
        t = self._tid.get(table)
        if t is None:
            return None
        keys = self._keys[self._ns_id[table[0]]]
        k = keys.table.get((hash(key) + _TOP) or 1)
        if k < 0:
            return None
        n = self.k_len[k]
        if n == 255:
            if self._long_keys.get(k) != key:
                return None
        else:
            b = key.encode()
            if len(b) != n or self.k_bytes[k * KEY_BYTES:k * KEY_BYTES + n] != b:
                return None
        p = self.k_head[k]
        while p >= 0 and self.p_tid[p] != t:
            p = self.p_knext[p]
        if p < 0 or not self.p_flags[p] & COMMITTED:
            return None
        return Entry(self, p, table, key)

    def get_many(self, table: TableId, keys: Sequence[str]) -> list[Entry | None]:
        """``get`` of every key (one vectorised lookup when they are many)."""
        n = len(keys)
        if n < 32:
            return [self.get(table, key) for key in keys]
        out: list[Entry | None] = [None] * n
        t = self._tid.get(table)
        if t is None:
            return out
        ks = self._keys[self._ns_id[table[0]]]
        fps = np.fromiter(map(hash, keys), np.int64, count=n).view(np.uint64)
        fps ^= np.uint64(_TOP)
        fps[fps == 0] = 1
        recs = ks.table.get_many(fps)
        idx = np.flatnonzero(recs >= 0)
        if not idx.size:
            return out
        kr = recs[idx]
        cols = self.np
        width = len(keys[0])
        blob = "".join(keys).encode() if 0 < width <= KEY_BYTES else b""
        if len(blob) == n * width:  # one ASCII length: the keys' bytes compared at once
            mine = np.frombuffer(blob, np.uint8).reshape(n, width)[idx]
            held = cols["k_bytes"].reshape(-1, KEY_BYTES)[kr, :width]
            same = (held == mine).all(1) & (cols["k_len"][kr] == width)
        else:
            same = np.fromiter((self._same_key(k, keys[i])
                                for k, i in zip(kr.tolist(), idx.tolist())), bool, len(kr))
        idx, kr = idx[same], kr[same]
        pages = cols["k_head"][kr]
        other = np.flatnonzero(cols["p_tid"][pages] != t)
        if other.size:  # the key's first page is another pool's: walk its pages
            tid, nxt = self.p_tid, self.p_knext
            for j in other.tolist():
                p = int(pages[j])
                while p >= 0 and tid[p] != t:
                    p = nxt[p]
                pages[j] = p
            found = pages >= 0
            idx, pages = idx[found], pages[found]
        live = (cols["p_flags"][pages] & COMMITTED) != 0
        idx, pages = idx[live], pages[live]
        new = Entry.__new__
        for i, p, off, stride, gen in zip(idx.tolist(), pages.tolist(),
                                          cols["p_off"][pages].tolist(),
                                          cols["p_stride"][pages].tolist(),
                                          cols["p_gen"][pages].tolist()):
            e = out[i] = new(Entry)
            e._ix, e.rec, e.table, e.key, e._offset, e.stride, e.gen = (
                self, p, table, keys[i], off, stride, gen)
        return out

    def get_pending(self, table: TableId, key: str) -> Entry | None:
        p = self.pending.get(table)
        return p.get(key) if p else None

    def contains(self, table: TableId, keys: Sequence[str]) -> np.ndarray:
        """Per key (bool): ``table`` holds it committed."""
        tid = self._tid.get(table)
        if tid is None:
            return np.zeros(len(keys), bool)
        if len(keys) < 32:  # a few: one by one is cheaper than the vectorised calls
            return np.fromiter((e is not None for e in self.get_many(table, keys)), bool,
                               len(keys))
        return (self.presence(table[0], keys, verify=True) & self._tbit[tid]) != 0

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

    def presence(self, ns: str, keys: Sequence[str], verify: bool = False) -> np.ndarray:
        """Per key (int64): the OR of ``pool_bit`` of every pool of ``ns`` holding it committed.
        Fingerprints only (a collision, a 2^-64 event, reads as present) unless ``verify``."""
        i = self._ns_id.get(ns)
        n = len(keys)
        if i is None or not n:
            return np.zeros(n, np.int64)
        ks = self._keys[i]
        if n < 32:  # a few: one by one is cheaper than the vectorised calls
            get, same, mask = ks.table.get, self._same_key, self.k_mask
            out = np.zeros(n, np.int64)
            for j, key in enumerate(keys):
                k = get((hash(key) + _TOP) or 1)
                if k >= 0 and (not verify or same(k, key)):
                    out[j] = mask[k]
            return out
        fps = np.fromiter(map(hash, keys), np.int64, count=n).view(np.uint64)
        fps ^= np.uint64(_TOP)
        fps[fps == 0] = 1
        recs = ks.table.get_many(fps)
        found = recs >= 0
        out = np.zeros(n, np.int64)
        if found.any():
            out[found] = self.np["k_mask"][recs[found]]
            if verify:
                for j in np.flatnonzero(found).tolist():
                    if not self._same_key(int(recs[j]), keys[j]):
                        out[j] = 0
        return out

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
        return {t: n for t, n in zip(self._tables, self._tcount) if n}

    def entries(self, ns: str | None = None) -> Iterator[Entry]:
        """Every committed page (of ``ns``), in no particular order."""
        nsid = self._ns_id.get(ns, -2) if ns is not None else -1
        for p in range(self._p_top):
            if self.p_flags[p] & COMMITTED and (nsid == -1 or self.k_ns[self.p_krec[p]] == nsid):
                yield self.handle(p)

    # ------------------------------------------------------------ chains

    def link(self, ns: str, keys: Sequence[str], parent: str | None, depth: int) -> None:
        """``keys[0]``'s parent is ``parent`` (None: a root, of unknown depth unless ``depth``
        >= 0), ``keys[i+1]``'s is ``keys[i]``; depth of ``keys[i]`` is ``depth + i`` (-1 when
        unknown). Kept for keys L2 holds a page of (pending or committed), by (namespace,
        key), until the last page of the key leaves; the newest link wins."""
        i = self._ns_id.get(ns)
        if i is None:
            return
        ks = self._keys[i]
        prev = self._fp(ks, parent) if parent is not None else 0
        n = len(keys)
        if n >= 32:  # vectorised (a fingerprint collision, 2^-64, mislinks a key: advice only)
            fps = np.fromiter(map(hash, keys), np.int64, count=n).view(np.uint64)
            fps ^= np.uint64(_TOP)
            fps[fps == 0] = 1
            recs = ks.table.get_many(fps)
            parents = np.empty(n, np.uint64)
            parents[0] = prev
            parents[1:] = fps[:-1]
            held = recs >= 0
            self.np["k_parent"][recs[held]] = parents[held]
            self.np["k_depth"][recs[held]] = (np.flatnonzero(held) + depth if depth >= 0
                                              else -1)
            return
        for j, key in enumerate(keys):
            fp = self._fp(ks, key)
            k = ks.table.get(fp)
            if k >= 0 and self._same_key(k, key):
                self.k_parent[k] = prev
                self.k_depth[k] = depth + j if depth >= 0 else -1
            prev = fp

    def chain(self, ns: str, key: str) -> tuple[str | None, int]:
        """(the parent key, when L2 holds a page of it, else None; the depth, -1 unknown)."""
        k = self._find_key(ns, key)
        if k < 0:
            return None, -1
        parent = None
        if self.k_parent[k]:
            pk = self._keys[self.k_ns[k]].table.get(self.k_parent[k])
            if pk >= 0:
                parent = self._key_of(pk)
        return parent, self.k_depth[k]

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
        ``pool_bit``) when the table would be the namespace's pool past ``MAX_POOLS``.
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
        entry._ix, entry.rec, entry.table, entry.key = self, p, table, key
        entry._offset, entry.stride, entry.gen = offset, stride, gen
        pend = self.pending.get(table)
        if pend is None:
            pend = self.pending[table] = {}
        pend[key] = entry
        return entry

    def _init_page(self, p: int, tid: int, k: int, offset: int, page_bytes: int, stride: int,
                   flags: int) -> None:
        self.p_tid[p] = tid
        self.p_krec[p] = k
        self.p_off[p] = offset
        self.p_stride[p] = stride
        self.p_pbytes[p] = page_bytes
        self.p_gen[p] = self._new_gen()
        self.p_used[p] = 0
        self.p_hits[p] = 0
        self.p_pins[p] = 0
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

    def commit_many(self, entries: Sequence[Entry]) -> None:
        """Publish pending entries, in turn, in one pass (a call's pages: the slabs' recency
        once). Every entry must be pending, each once; the state afterwards is exactly that of
        committing them one by one."""
        self.fingerprint_all(entries)
        shared, alloc, policy = self.shared, self.alloc, self.policy
        slabs, slab_bytes = alloc.slabs, alloc.slab_bytes
        flags, pins, used, mask_of = self.p_flags, self.p_pins, self.p_used, self.k_mask
        touched: dict = {}  # slab -> None, in the order of their last touch
        owners = self.owners
        tick = self._tick
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
            old = mask_of[k]
            mask_of[k] = new = old | self._tbit[tid]
            if shared is not None:
                if new != old:
                    shared.set(self._sfp(k), new)
                shared.publish_tag(e._offset, e.stride, e.gen)
            tick += 1
            used[p] = tick
            policy.inserted(p)
            slab = slabs[e._offset // slab_bytes]
            slab.last_used = tick
            touched.pop(slab, None)
            touched[slab] = None
            if pins[p] <= 0:
                raise AssertionError(f"{e!r} is not pinned")
            pins[p] -= 1  # unpin
            if pins[p] == 0:
                slab.pinned -= 1
        self._tick = tick
        alloc.touched(touched)

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
            self.alloc.slab_of(entry._offset).pinned += 1
        self.p_pins[p] += 1

    def unpin(self, entry: Entry) -> None:
        p = entry.rec
        assert self.p_gen[p] == entry.gen and self.p_pins[p] > 0, entry
        self.p_pins[p] -= 1
        if self.p_pins[p] == 0:
            self.alloc.slab_of(entry._offset).pinned -= 1

    def touch(self, entry: Entry) -> None:
        """Mark ``entry`` most recently used."""
        p = entry.rec
        if self.p_gen[p] != entry.gen:
            return
        self._tick += 1
        self.p_used[p] = self._tick
        self.alloc.touch(entry.offset, self._tick)
        if self.p_flags[p] & COMMITTED:
            self.policy.touched(p)

    def touch_many(self, entries: Sequence[Entry]) -> None:
        """``touch`` of each of ``entries`` in turn, in one pass (a get's pages)."""
        gen, used, flags, policy = self.p_gen, self.p_used, self.p_flags, self.policy
        slabs, slab_bytes = self.alloc.slabs, self.alloc.slab_bytes
        touched: dict = {}  # slab -> None, in the order of their last touch
        tick = self._tick
        for e in entries:
            p = e.rec
            if gen[p] != e.gen:
                continue
            tick += 1
            used[p] = tick
            slab = slabs[e._offset // slab_bytes]
            slab.last_used = tick
            touched.pop(slab, None)
            touched[slab] = None
            if flags[p] & COMMITTED:
                policy.touched(p)
        self._tick = tick
        self.alloc.touched(touched)

    def pin_many(self, entries: Sequence[Entry]) -> None:
        """``pin`` of each of ``entries``."""
        gen, pins = self.p_gen, self.p_pins
        slabs, slab_bytes = self.alloc.slabs, self.alloc.slab_bytes
        for e in entries:
            p = e.rec
            assert gen[p] == e.gen, e
            if pins[p] == 0:
                slabs[e._offset // slab_bytes].pinned += 1
            pins[p] += 1

    def unpin_many(self, entries: Sequence[Entry]) -> None:
        """``unpin`` of each of ``entries``."""
        gen, pins = self.p_gen, self.p_pins
        slabs, slab_bytes = self.alloc.slabs, self.alloc.slab_bytes
        for e in entries:
            p = e.rec
            assert gen[p] == e.gen and pins[p] > 0, e
            pins[p] -= 1
            if pins[p] == 0:
                slabs[e._offset // slab_bytes].pinned -= 1

    def count_hits(self, entries: Sequence[Entry]) -> None:
        """One more hit for each of ``entries`` (those still in their slot)."""
        gen, hits = self.p_gen, self.p_hits
        for e in entries:
            p = e.rec
            if gen[p] == e.gen and hits[p] < 0x7FFFFFFF:
                hits[p] += 1

    # ------------------------------------------------------------ eviction

    def lru_order(self, stride: int) -> list[Entry]:
        """Committed entries of a class, least recently used first (for tests and stats)."""
        return [self.handle(p) for p in self.policy.order(stride)]

    def _make_room(self, stride: int) -> int | None:
        while True:
            victims = self.policy.make_room(stride)
            if not victims:
                return None
            for p in victims:
                self.evict(self.handle(p))
            offset = self.alloc.alloc(stride)
            if offset is not None:
                return offset

    def evict(self, entry: Entry) -> None:
        """Remove a committed, unpinned entry from L2 and free its slot."""
        assert entry.committed and entry.pins == 0, entry
        if self.on_evict is not None:
            self.on_evict(entry)
        self._unpublish(entry.rec)
        self.evictions += 1

    def drop(self, entries: Sequence[Entry]) -> int:
        """Remove committed, unpinned entries; returns how many were dropped."""
        return sum(self.drop_one(e) for e in list(entries))

    def drop_one(self, entry: Entry) -> bool:
        """Remove ``entry`` if it is committed and unpinned (flush); whether it was."""
        if entry.committed and entry.pins == 0:
            self._unpublish(entry.rec)
            return True
        return False

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
        tid, k = self.p_tid[p], self.p_krec[p]
        self.policy.removed(p)
        self._tcount[tid] -= 1
        self.committed_count -= 1
        left = self.k_mask[k] & ~self._tbit[tid]
        self.k_mask[k] = left
        if self.shared is not None:
            self.shared.clear_tag(self.p_off[p], self.p_stride[p])  # before the slot is freed
            if left:
                self.shared.set(self._sfp(k), left)
            else:
                self.shared.remove(self._sfp(k))
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
        self.p_gen[p] = 0
        self.owners.pop(p, None)
        self.p_flags[p] = 0
        self.p_pins[p] = 0
        self._p_free.append(p)

    def _free_key(self, k: int) -> None:
        keys = self._keys[self.k_ns[k]]
        keys.table.remove(self._fp(keys, self._key_of(k)))
        if self.k_len[k] == 255:
            del self._long_keys[k]
        self.k_len[k] = 0
        self._k_free.append(k)

    def republish(self, at_most: int = REPUBLISH_MAX) -> bool:
        """Refill a full presence table once L2 holds few enough keys again (at most half the
        table's load, and ``at_most``: each costs ~3 us of the loop); whether it did."""
        t = self.shared
        if t is None or not t.overflowed:
            return False
        ks = np.flatnonzero(self.np["k_mask"][:self._k_top]).tolist()
        if len(ks) > min(at_most, t.slots * MAX_LOAD / 2):
            return False
        return t.rebuild((self._sfp(k), self.k_mask[k]) for k in ks)

    def fingerprint_all(self, entries: Sequence[Entry]) -> None:
        """Fingerprint the keys of ``entries`` in one vectorised call (a commit's pages), so
        that publishing them costs ~0.7 us a key instead of ~2.5 (``presence.fingerprints``)."""
        if self.shared is None:
            return
        todo = [e for e in entries if not self.k_sfp[self.p_krec[e.rec]]]
        if len(todo) < 8 or any(e.table[0] != todo[0].table[0] for e in todo):
            return  # few, or of several namespaces: one by one when published
        fps = fingerprints(self.seed(todo[0].table[0]), [e.key for e in todo])
        if fps is not None:
            for e, fp in zip(todo, fps.tolist(), strict=True):
                self.k_sfp[self.p_krec[e.rec]] = fp

    def seed(self, ns: str) -> int:
        """The fingerprint seed of namespace ``ns`` in the shared presence table."""
        seed = self._seeds.get(ns)
        if seed is None:
            seed = self._seeds[ns] = namespace_seed(ns)
        return seed

    def _sfp(self, k: int) -> int:
        fp = self.k_sfp[k]
        if not fp:
            fp = self.k_sfp[k] = fingerprint(self.seed(self._ns_names[self.k_ns[k]]),
                                             self._key_of(k))
        return fp
