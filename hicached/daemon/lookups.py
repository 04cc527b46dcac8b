"""The page index's lookups: a key's committed page in a pool, a call's pages, the presence
masks of an exists.

``Lookups`` reads ``Records`` (``records.py``: the columns; ``index.py`` says what they hold)
and changes nothing. A few keys are looked up one by one in a tight loop (``_get_each``: the
16 pages of a get or a set are most of what the control loop spends on such a call), many at
once with numpy
(``lookup``: the key table's ``get_many``, the keys' bytes compared as one array). Both give
the same answer: a fingerprint collision costs a miss, never another key's page.
"""

from __future__ import annotations

from collections.abc import Sequence
import numpy as np

from hicached.daemon.entry import _TOP, COMMITTED, KEY_BYTES, Entry, TableId, key_fps
from hicached.daemon.records import Records

VECTOR_MIN = 32  # keys looked up at once from (a numpy call costs ~1-2 us, a key ~3)


class Lookups:
    """The index's reads by key (module docstring): owns nothing, mutates nothing; reads the
    records given (``records``) and makes handles (``Entry``) on them. The index offers its
    methods as its own (``PageIndex.get``, ``get_many``, ``lookup``, ...)."""

    def __init__(self, records: Records):
        self.records = records
        self._pending = records.pending  # (the records' own dict, never replaced: one hop
        # less on a set's path, a lookup per key)

    def get(self, table: TableId, key: str) -> Entry | None:
        """The committed entry of ``key`` or None."""
        r = self.records
        t = r.tids.get(table)
        if t is None:
            return None
        keys = r.key_tables[r.ns_ids[table[0]]]
        k = keys.table.get((hash(key) + _TOP) or 1)
        if k < 0:
            return None
        n = r.k_len[k]
        if n == 255:
            if r.long_keys.get(k) != key:
                return None
        else:
            b = key.encode()
            if len(b) != n or r.k_bytes[k * KEY_BYTES:k * KEY_BYTES + n] != b:
                return None
        p = r.k_head[k]
        while p >= 0 and r.p_tid[p] != t:
            p = r.p_knext[p]
        if p < 0 or not r.p_flags[p] & COMMITTED:
            return None
        return Entry(r, p, table, key)

    def _get_each(self, table: TableId, keys: Sequence[str]) -> list[Entry | None]:
        """``get`` of each key, in one loop (a call's few keys: the lookups of a get or a set
        of 16 pages are most of what the loop spends on them)."""
        r = self.records
        t = r.tids.get(table)
        if t is None:
            return [None] * len(keys)
        get_rec = r.key_tables[r.ns_ids[table[0]]].table.get
        k_len, k_bytes, k_head, long_keys = r.k_len, r.k_bytes, r.k_head, r.long_keys
        p_tid, p_knext, p_flags = r.p_tid, r.p_knext, r.p_flags
        p_off, p_stride, p_gen = r.p_off, r.p_stride, r.p_gen
        new, out = Entry.__new__, []
        for key in keys:
            k = get_rec((hash(key) + _TOP) or 1)
            if k >= 0:
                n = k_len[k]
                if n == 255:
                    if long_keys.get(k) != key:
                        k = -1
                else:
                    b = key.encode()
                    if len(b) != n or k_bytes[k * KEY_BYTES:k * KEY_BYTES + n] != b:
                        k = -1
            p = k_head[k] if k >= 0 else -1
            while p >= 0 and p_tid[p] != t:
                p = p_knext[p]
            if p < 0 or not p_flags[p] & COMMITTED:
                out.append(None)
                continue
            e = new(Entry)
            e.ix, e.rec, e.table, e.key, e.slot_offset, e.stride, e.gen = (
                r, p, table, key, p_off[p], p_stride[p], p_gen[p])
            out.append(e)
        return out

    def get_many(self, table: TableId, keys: Sequence[str]) -> list[Entry | None]:
        """``get`` of every key (one vectorised lookup when they are many)."""
        return self.lookup(table, keys)[0]

    def lookup(self, table: TableId, keys: Sequence[str]
               ) -> tuple[list[Entry | None], np.ndarray | None, np.ndarray | None]:
        """``get_many``, with the keys' fingerprints (``key_fps``) and what the namespace's key
        table holds for each (a key record, -1: none) when it looked them up at once, else None:
        ``reserve_many`` takes them, if no record came or went since, instead of asking again."""
        r = self.records
        n = len(keys)
        if n < VECTOR_MIN:
            return self._get_each(table, keys), None, None
        out: list[Entry | None] = [None] * n
        t = r.tids.get(table)
        if t is None:
            return out, None, None
        ks = r.key_tables[r.ns_ids[table[0]]]
        fps = key_fps(keys)
        recs = ks.table.get_many(fps)
        idx = np.flatnonzero(recs >= 0)
        if not idx.size:
            return out, fps, recs
        kr = recs[idx]
        cols = r.np
        width = len(keys[0])
        blob = "".join(keys).encode() if 0 < width <= KEY_BYTES else b""
        if len(blob) == n * width:  # one ASCII length: the keys' bytes compared at once
            mine = np.frombuffer(blob, np.uint8).reshape(n, width)[idx]
            held = cols["k_bytes"].reshape(-1, KEY_BYTES)[kr, :width]
            same = (held == mine).all(1) & (cols["k_len"][kr] == width)
        else:
            same = np.fromiter((r.same_key(k, keys[i])
                                for k, i in zip(kr.tolist(), idx.tolist())), bool, len(kr))
        idx, kr = idx[same], kr[same]
        pages = cols["k_head"][kr]
        other = np.flatnonzero(cols["p_tid"][pages] != t)
        if other.size:  # the key's first page is another pool's: walk its pages
            tid, nxt = r.p_tid, r.p_knext
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
            e.ix, e.rec, e.table, e.key, e.slot_offset, e.stride, e.gen = (
                r, p, table, keys[i], off, stride, gen)
        return out, fps, recs

    def get_pending(self, table: TableId, key: str) -> Entry | None:
        """The pending entry of ``key`` in ``table`` (its live handle) or None."""
        p = self._pending.get(table)
        return p.get(key) if p else None

    def contains(self, table: TableId, keys: Sequence[str]) -> np.ndarray:
        """Per key (bool): ``table`` holds it committed."""
        r = self.records
        tid = r.tids.get(table)
        if tid is None:
            return np.zeros(len(keys), bool)
        if len(keys) < VECTOR_MIN:  # a few: one by one is cheaper than the vectorised calls
            return np.fromiter((e is not None for e in self.get_many(table, keys)), bool,
                               len(keys))
        return (self.presence(table[0], keys, verify=True) & r.t_bit[tid]) != 0

    def presence(self, ns: str, keys: Sequence[str], verify: bool = False) -> np.ndarray:
        """Per key (int64): the OR of ``pool_bit`` of every pool of ``ns`` holding it committed.
        Fingerprints only (a collision, a 2^-64 event, reads as present) unless ``verify``."""
        r = self.records
        i = r.ns_ids.get(ns)
        n = len(keys)
        if i is None or not n:
            return np.zeros(n, np.int64)
        ks = r.key_tables[i]
        if n < VECTOR_MIN:  # a few: one by one is cheaper than the vectorised calls
            get, same, mask = ks.table.get, r.same_key, r.k_mask
            out = np.zeros(n, np.int64)
            for j, key in enumerate(keys):
                k = get((hash(key) + _TOP) or 1)
                if k >= 0 and (not verify or same(k, key)):
                    out[j] = mask[k]
            return out
        fps = key_fps(keys)
        recs = ks.table.get_many(fps)
        found = recs >= 0
        out = np.zeros(n, np.int64)
        if found.any():
            out[found] = r.np["k_mask"][recs[found]]
            if verify:
                for j in np.flatnonzero(found).tolist():
                    if not r.same_key(int(recs[j]), keys[j]):
                        out[j] = 0
        return out
