"""The page index's reservations of a call's pages in a few numpy passes (``ReserveOps``, a
mixin of ``batch.BatchOps``; the contract is ``batch.py``'s: exactly the state of ``reserve`` of
each page in turn).

The keys that get a free slot are reserved together: a run of slots off a slab's free stack
(``SlabAllocator.alloc_many``), each record column written once. A call that finds its class
full evicts what its next key would evict and reserves the keys that get the freed slots
together again: a ``prefix`` / ``hybrid`` victim is a leaf segment of tens of pages, an LRU
victim one page (``policy.frees_runs``: LRU's calls go key by key then).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from hicached.daemon.entry import GROW_MIN, KEY_BYTES, PENDING, Entry, TableId, key_fps

if TYPE_CHECKING:
    from hicached.daemon.index import PageIndex

RUN_MIN = 8  # keys that take the slots a victim freed go together from this many
BATCH_MIN = 32  # calls of fewer pages go page by page (a numpy call costs ~1-2 us, a page ~3-5)


class ReserveOps:
    """``PageIndex``'s vectorised reservations (module docstring)."""

    # ------------------------------------------------------------ records in bulk

    def _new_pages(self: PageIndex, n: int) -> np.ndarray:
        """``n`` page records, the ones ``n`` calls of ``_new_page`` would give, in order."""
        out, self._p_top = self._new_records(n, self._p_free, self._p_top, "p_gen",
                                             self._page_cols, self.policy.grow)
        return out

    def _new_keys(self: PageIndex, n: int) -> np.ndarray:
        """``n`` key records, the ones ``n`` calls of ``_new_key`` would give, in order."""
        out, self._k_top = self._new_records(n, self._k_free, self._k_top, "k_len",
                                             self._key_cols, self.policy.grow_keys)
        return out

    def _new_records(self: PageIndex, n: int, free, top: int, sized_by: str, cols,
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
            self._grow(cols, size, size + max(GROW_MIN, size >> 3))
            grow_policy(len(getattr(self, sized_by)))
        out[k:] = np.arange(top, top + n - k)
        return out, top + n - k

    # ------------------------------------------------------------ reserve

    def reserve_many(self: PageIndex, table: TableId, keys: Sequence[str], page_bytes: int,
                     stride: int, owner: int = 0, fps: np.ndarray | None = None,
                     recs: np.ndarray | None = None) -> list[Entry | None]:
        """``reserve`` of each of ``keys`` in turn, each then owned by session ``owner``
        (``Entry.owner``; 0: none set). The caller checks first that no key is committed or
        pending, and that none comes twice; ``fps`` / ``recs``: the keys' ``lookup`` when no
        record came or went since (else they are looked up here).

        The keys that get a free slot are reserved together (a run of slots off the
        allocator, one assignment per column); when the class is full, the victims the next
        key would evict go, and the keys that get the slots they freed are reserved together
        again (a hybrid victim, a leaf segment, frees tens of slots; an LRU victim one: those
        keys go one by one); a key for which nothing may go gets no slot, as on its own. Few
        keys, keys of several lengths, non-ASCII or longer than ``KEY_BYTES``, and keys whose
        fingerprint another key has, go one by one throughout."""
        n = len(keys)
        width = len(keys[0]) if n else 0
        if n < BATCH_MIN or not 0 < width <= KEY_BYTES or not (
                self.alloc.has_free(stride) or self.policy.frees_runs):
            return self._reserve_each(table, keys, page_bytes, stride, owner)
        blob = "".join(keys).encode()
        if len(blob) != n * width:
            return self._reserve_each(table, keys, page_bytes, stride, owner)
        tid = self._tid.get(table)
        if tid is None:
            tid = self.table_id(table)  # (ValueError before anything, as ``reserve``)
            fps = None  # (a new namespace has no key table to have looked in)
        fptable = self._keys[self._ns_id[table[0]]].table
        if fps is None:
            fps = key_fps(keys)
            recs = fptable.get_many(fps)
        if len(set(fps.tolist())) != n:  # a key twice, or two keys of one fingerprint
            return self._reserve_each(table, keys, page_bytes, stride, owner)
        mine = np.frombuffer(blob, np.uint8).reshape(n, width)
        out: list[Entry | None] = []
        at, evicted = 0, False
        while at < n:
            free = self.alloc.free_slots(stride)
            if not free:  # what reserving keys[at] on its own would evict (``_make_room``)
                self.pressed.add(stride)
                if self.take_deferred is not None and self.take_deferred(stride, n - at):
                    evicted = True  # the dead tails a split segment left (``reclaim.py``)
                    continue
                victims = self.policy.make_room(stride)
                if not victims or not self._evict_victims(victims, stride, n - at):
                    out.append(None)  # nothing may go: no room for keys[at]
                    at += 1
                    continue
                evicted = True
                continue
            k = min(free, n - at)
            if k < RUN_MIN and (at or evicted):  # a few slots freed: those keys one by one
                out += self._reserve_each(table, keys[at:at + k], page_bytes, stride, owner)
            else:
                got = self._reserve_run(table, tid, keys[at:at + k], mine[at:at + k],
                                        fps[at:at + k], None if evicted else recs[at:at + k],
                                        page_bytes, stride, owner)
                if got is None:  # a key another key's fingerprint stands for (2^-64)
                    break
                out += got
            at += k
        if at < n:
            out += self._reserve_each(table, keys[at:], page_bytes, stride, owner)
        return out

    def _reserve_run(self: PageIndex, table: TableId, tid: int, keys: Sequence[str],
                     mine: np.ndarray, fps: np.ndarray, recs: np.ndarray | None,
                     page_bytes: int, stride: int, owner: int) -> list[Entry] | None:
        """``reserve`` of each of ``keys`` (``mine``: their bytes, one row each; ``fps`` /
        ``recs``: their fingerprints and key records, None: looked up now), which all get a
        free slot of the class: in one pass. None, having done nothing, when a key record
        ``recs`` names holds another key (the caller goes one by one)."""
        n, width = len(keys), mine.shape[1]
        nsid = self._ns_id[table[0]]
        fptable = self._keys[nsid].table
        if recs is None:
            recs = fptable.get_many(fps)
        cols = self.np
        held = np.flatnonzero(recs >= 0)  # keys another pool of the namespace holds
        if len(held):
            kr = recs[held]
            same = (cols["k_bytes"].reshape(-1, KEY_BYTES)[kr, :width] == mine[held]).all(1)
            if np.count_nonzero(same & (cols["k_len"][kr] == width)) != len(held):
                return None
        runs = self.alloc.alloc_many(stride, n)
        m = sum(len(slots) for _, slots in runs)  # n: the caller counted the free slots
        recs = recs[:m].copy()
        new = np.flatnonzero(recs < 0)
        if len(new):  # key records for the keys L2 holds no page of
            kn = self._new_keys(len(new))
            recs[new] = kn
            cols["k_bytes"].reshape(-1, KEY_BYTES)[kn, :width] = mine[new]
            cols["k_len"][kn] = width
            cols["k_ns"][kn] = nsid
            for name in ("k_sfp", "k_mask", "k_parent"):
                cols[name][kn] = 0
            cols["k_head"][kn] = -1
            cols["k_depth"][kn] = -1
            fptable.put_many(fps[new], kn)
        ps = self._new_pages(m)
        offsets = np.concatenate([np.frombuffer(slots, np.int32).astype(np.int64) * stride
                                  + slab.offset for slab, slots in runs])
        gens = np.arange(self._gen + 1, self._gen + 1 + m, dtype=np.int64)
        self._gen += m
        cols["p_tid"][ps] = tid
        cols["p_krec"][ps] = recs
        cols["p_off"][ps] = offsets
        cols["p_stride"][ps] = stride
        cols["p_pbytes"][ps] = page_bytes
        cols["p_gen"][ps] = gens
        for name in ("p_used", "p_hits"):
            cols[name][ps] = 0
        cols["p_pins"][ps] = 1  # pinned while pending
        cols["p_flags"][ps] = PENDING
        cols["p_knext"][ps] = cols["k_head"][recs]
        cols["k_head"][recs] = ps
        at = 0
        for slab, slots in runs:  # each slab: its new pins, its slot -> record map
            slab.pinned += len(slots)
            smap = self._slots.get(slab.index)
            if smap is None or len(smap) != slab.num_slots:
                smap = self._slots[slab.index] = array("i", [-1]) * slab.num_slots
            np.frombuffer(smap, np.int32)[np.frombuffer(slots, np.int32)] = ps[at:at + len(slots)]
            at += len(slots)
        ns = table[0]
        self.ns_bytes[ns] = self.ns_bytes.get(ns, 0) + m * stride
        make = Entry.__new__
        out: list[Entry] = [make(Entry) for _ in range(m)]
        ps_list = ps.tolist()
        for e, key, p, off, gen in zip(out, keys, ps_list, offsets.tolist(), gens.tolist()):
            e.ix, e.rec, e.table, e.key, e.slot_offset, e.stride, e.gen = (
                self, p, table, key, off, stride, gen)
        pend = self.pending.get(table)
        if pend is None:
            pend = self.pending[table] = {}
        pend.update(zip(keys, out))
        if owner:
            self.owners.update(dict.fromkeys(ps_list, owner))
        return out

    def _reserve_each(self: PageIndex, table: TableId, keys: Sequence[str], page_bytes: int,
                      stride: int, owner: int) -> list[Entry | None]:
        out = [self.reserve(table, key, page_bytes, stride) for key in keys]
        if owner:
            for e in out:
                if e is not None:
                    e.owner = owner
        return out
