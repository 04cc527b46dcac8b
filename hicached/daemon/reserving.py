"""Reserving slots for a call's pages: the first step of a page's life (``index.py``).

A page is reserved pending and pinned (``reserve``, the keys of a call: ``reserve_many``), or
as an unbound slot a client holds ahead of its keys (``reserve_unbound``, then ``bind``), and
dropped again before its commit (``abort``). A key reserved either way leaves the same state:
``reserve_many`` is ``reserve`` of each key in turn (the contract of ``commits.py`` too), but
for one thing below: under ``prefix`` / ``hybrid`` a call whose class is short evicts first.

The keys that get a free slot are reserved together: a run of slots off a slab's free stack
(``SlabAllocator.alloc_many``), each record column written once. Under a policy whose victims
free runs of slots (``policy.frees_runs``: ``prefix`` / ``hybrid``, a victim a leaf segment), a
call whose class is short of slots for its keys first evicts what they need
(``Reclaimer.evict_first``), then reserves its keys in one run. The victims are those of key by
key, since a reservation changes nothing a policy reads: in a namespace with no trailing pool
(attention-only: no state) the sets the policy names one after the other, several a policy call
where it can tell them (``make_room_many``); with trailing pools one set at a time, each split
where the class has room for the call's keys (a state's reservation evicts the state and its
key's KV page; in a daemon the rest of the segment is deferred to the idle turns), so exactly
what its keys, one by one, would evict in turn. Which of the freed slots and records each key
gets differs from key by key, nothing else (``tests/daemon/test_index_batch.py``'s
``one_by_one`` is the reference; what stays after each call is key by key's). Under LRU (an LRU
victim is one page, and a slot handed out moves its slab's last use, which LRU weighs), a call
that finds its class full evicts what its next key would evict and reserves the keys that get
the freed slots, key by key. A fingerprint collision, keys of several lengths, non-ASCII or
longer than ``KEY_BYTES``, and calls of few keys go page by page (``reserve``: a numpy call
costs ~1-2 us, a page ~3-5).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from hicached.daemon.entry import (
    _TOP,
    COMMITTED,
    JOURNALED,
    KEY_BYTES,
    PENDING,
    Entry,
    TableId,
    key_fps,
)
from hicached.daemon.eviction.interface import EvictionPolicy
from hicached.daemon.reclaim import Reclaimer
from hicached.daemon.records import Records

RUN_MIN = 8  # keys that take the slots a victim freed go together from this many
BATCH_MIN = 32  # calls of fewer pages go page by page (a numpy call costs ~1-2 us, a page ~3-5)


class Reservations:
    """Reserves slots for pages (module docstring). Owns nothing: it writes the records
    (``records``: new page and key records, pending handles, owners, bytes per namespace),
    takes slots off the allocator (``records.alloc``) and, when a class is full, asks the
    reclaimer for room (``Reclaimer.make_room``, ``evict_for``: which evict). It
    reads the policy's ``frees_runs`` and asks its ``make_room`` for a call's victims."""

    def __init__(self, records: Records, policy: EvictionPolicy, reclaimer: Reclaimer):
        self.records = records
        self.alloc = records.alloc
        self.policy = policy
        self.reclaimer = reclaimer

    def reserve(self, table: TableId, key: str, page_bytes: int, stride: int) -> Entry | None:
        """A pending, pinned entry with a fresh slot, or None when nothing can be evicted (or,
        a 2^-64 event, another key of the namespace has this key's fingerprint).

        The caller checks first that the key is neither committed nor pending. ValueError (from
        ``pool_bit``) when the table would be the namespace's pool past ``MAX_POOLS``. The
        page-by-page path of ``reserve_many`` too (its calls of few keys, and the keys a run
        cannot take), so one key reserved either way leaves the same state.
        """
        r = self.records
        tid = r.tids.get(table)
        if tid is None:
            tid = r.table_id(table)  # its pool bit given now, so that commit cannot fail
        alloc = self.alloc
        offset = alloc.alloc(stride)
        if offset is None:
            offset = self.reclaimer.make_room(stride)
            if offset is None:
                return None
        ns = table[0]
        keys = r.key_tables[r.ns_ids[ns]]
        fp = (hash(key) + _TOP) or 1
        k = keys.table.get(fp)
        if k < 0:
            k = r.add_key(keys, fp, r.ns_ids[ns], key)
        elif not r.same_key(k, key):
            alloc.free(offset)
            return None
        p = r.new_page()
        r.gen = gen = r.gen + 1
        r.p_tid[p] = tid
        r.p_krec[p] = k
        r.p_off[p] = offset
        r.p_stride[p] = stride
        r.p_pbytes[p] = page_bytes
        r.p_gen[p] = gen
        r.p_used[p] = r.p_hits[p] = 0
        r.p_pins[p] = 1  # pinned while pending
        r.p_flags[p] = PENDING
        r.p_knext[p] = r.k_head[k]
        r.k_head[k] = p
        slab = alloc.slabs[offset // alloc.slab_bytes]
        slab.pinned += 1
        slots = r.slot_recs.get(slab.index)
        if slots is None or len(slots) != slab.num_slots:
            slots = r.slot_recs[slab.index] = array("i", [-1]) * slab.num_slots
        slots[(offset - slab.offset) // stride] = p
        r.ns_bytes[ns] = r.ns_bytes.get(ns, 0) + stride
        entry = Entry.__new__(Entry)
        entry.ix, entry.rec, entry.table, entry.key = r, p, table, key
        entry.slot_offset, entry.stride, entry.gen = offset, stride, gen
        pend = r.pending.get(table)
        if pend is None:
            pend = r.pending[table] = {}
        pend[key] = entry
        return entry

    def reserve_unbound(self, ns: str, stride: int) -> Entry | None:
        """A pinned slot of ``stride`` bytes held for namespace ``ns`` without a key yet (a
        client's set-ahead slot, ``leases.AheadSlots``), or None when nothing can be evicted.
        It counts for the namespace's bytes; ``bind`` gives it a key, ``abort`` frees it."""
        r = self.records
        offset = self.alloc.alloc(stride)
        if offset is None:
            offset = self.reclaimer.make_room(stride)
            if offset is None:
                return None
        p = r.new_page()
        r.init_page(p, -1, r.ns_id(ns), offset, 0, stride, 0)  # krec: its namespace
        r.ns_bytes[ns] = r.ns_bytes.get(ns, 0) + stride
        entry = Entry(r, p, (ns, ""), "")
        r.p_pins[p] = 1  # pinned (``Uses.pin``)
        self.alloc.slab_of(offset).pinned += 1
        return entry

    def bind(self, entry: Entry, table: TableId, key: str, page_bytes: int) -> Entry | None:
        """Turn an unbound slot of ``table``'s namespace into the pending entry of ``key`` (same
        slot, a new generation; ``entry`` is updated and returned). The caller checks first
        that the key is neither committed nor pending; ValueError as ``reserve``; None (the
        slot freed) on a fingerprint collision."""
        r = self.records
        p = entry.rec
        assert (entry.alive and r.p_tid[p] < 0
                and r.ns_names[r.p_krec[p]] == table[0]), entry
        tid = r.table_id(table)
        k = r.key_record(table[0], key)
        if k < 0:
            self.abort(entry)
            return None
        r.p_tid[p], r.p_krec[p], r.p_pbytes[p] = tid, k, page_bytes
        r.p_flags[p] = PENDING
        r.p_gen[p] = r.new_gen()
        r.p_knext[p] = r.k_head[k]
        r.k_head[k] = p
        entry.table, entry.key, entry.gen = table, key, r.p_gen[p]
        r.pending.setdefault(table, {})[key] = entry
        return entry

    def abort(self, entry: Entry) -> None:
        """Drop a pending (or unbound) entry and free its slot."""
        r = self.records
        p = entry.rec
        assert entry.alive and not r.p_flags[p] & COMMITTED, entry
        if r.p_flags[p] & PENDING:
            pend = r.pending.get(entry.table)
            if pend is not None and pend.get(entry.key) == entry:
                del pend[entry.key]
                if not pend:
                    del r.pending[entry.table]
        assert r.p_gen[p] == entry.gen and r.p_pins[p] > 0, entry  # unpinned (``Uses.unpin``)
        r.p_pins[p] -= 1
        if r.p_pins[p] == 0:
            self.alloc.slab_of(entry.slot_offset).pinned -= 1
        r.free_page(p)

    def reserve_many(self, table: TableId, keys: Sequence[str], page_bytes: int,
                     stride: int, owner: int = 0, fps: np.ndarray | None = None,
                     recs: np.ndarray | None = None, evict_first: bool = True
                     ) -> list[Entry | None]:
        """``reserve`` of each of ``keys`` in turn, each then owned by session ``owner``
        (``Entry.owner``; 0: none set), after, under ``prefix`` / ``hybrid``, evicting what
        they need first when the class is short (``evict_first``; False: a caller that did,
        ``set_control.py``, the rest key by key).
        The caller checks first that no key is committed or pending, and that none comes
        twice; ``fps`` / ``recs``: the keys' ``lookup`` when no record came or went since (else
        they are looked up here).

        The keys that get a free slot are reserved together (a run of slots off the
        allocator, one assignment per column); when the class is full, the victims the next
        key would evict go, and the keys that get the slots they freed are reserved together
        again (a hybrid victim, a leaf segment, frees tens of slots; an LRU victim one: those
        keys go one by one); a key for which nothing may go gets no slot, as on its own. Few
        keys, keys of several lengths, non-ASCII or longer than ``KEY_BYTES``, and keys whose
        fingerprint another key has, go one by one throughout."""
        r = self.records
        n = len(keys)
        width = len(keys[0]) if n else 0
        evicted = False  # (then ``recs``, looked up before, may name freed key records)
        first = evict_first and self.reclaimer.evicts_first(table[0])
        if first and self.alloc.free_slots(stride) < n:  # the call's victims first
            evicted = self.reclaimer.evict_first(stride, n, table[0]) > 0
        many = first and self.reclaimer.names_many(table[0])
        if n < BATCH_MIN or not 0 < width <= KEY_BYTES or not (
                self.alloc.has_free(stride) or self.policy.frees_runs):
            return self._reserve_each(table, keys, page_bytes, stride, owner)
        blob = "".join(keys).encode()
        if len(blob) != n * width:
            return self._reserve_each(table, keys, page_bytes, stride, owner)
        tid = r.tids.get(table)
        if tid is None:
            tid = r.table_id(table)  # (ValueError before anything, as ``reserve``)
            fps = None  # (a new namespace has no key table to have looked in)
        fptable = r.key_tables[r.ns_ids[table[0]]].table
        if fps is None:
            fps = key_fps(keys)
            recs = fptable.get_many(fps)
        if len(set(fps.tolist())) != n:  # a key twice, or two keys of one fingerprint
            return self._reserve_each(table, keys, page_bytes, stride, owner)
        mine = np.frombuffer(blob, np.uint8).reshape(n, width)
        out: list[Entry | None] = []
        at = 0
        while at < n:
            free = self.alloc.free_slots(stride)
            if not free:  # what reserving keys[at] on its own would evict (``_make_room``)
                got = self.reclaimer.evict_for(stride, n - at, many)
                if not got:
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

    def _reserve_run(self, table: TableId, tid: int, keys: Sequence[str],
                     mine: np.ndarray, fps: np.ndarray, recs: np.ndarray | None,
                     page_bytes: int, stride: int, owner: int) -> list[Entry] | None:
        """``reserve`` of each of ``keys`` (``mine``: their bytes, one row each; ``fps`` /
        ``recs``: their fingerprints and key records, None: looked up now), which all get a
        free slot of the class: in one pass. None, having done nothing, when a key record
        ``recs`` names holds another key (the caller goes one by one)."""
        r = self.records
        n, width = len(keys), mine.shape[1]
        nsid = r.ns_ids[table[0]]
        fptable = r.key_tables[nsid].table
        if recs is None:
            recs = fptable.get_many(fps)
        cols = r.np
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
            kn = r.new_keys(len(new))
            recs[new] = kn
            cols["k_bytes"].reshape(-1, KEY_BYTES)[kn, :width] = mine[new]
            cols["k_len"][kn] = width
            cols["k_ns"][kn] = nsid
            for name in ("k_sfp", "k_mask", "k_parent"):
                cols[name][kn] = 0
            cols["k_head"][kn] = -1
            cols["k_depth"][kn] = -1
            fptable.put_many(fps[new], kn)
        ps = r.new_pages(m)
        offsets = np.concatenate([np.frombuffer(slots, np.int32).astype(np.int64) * stride
                                  + slab.offset for slab, slots in runs])
        gens = np.arange(r.gen + 1, r.gen + 1 + m, dtype=np.int64)
        r.gen += m
        cols["p_tid"][ps] = tid
        cols["p_krec"][ps] = recs
        cols["p_off"][ps] = offsets
        cols["p_stride"][ps] = stride
        cols["p_pbytes"][ps] = page_bytes
        cols["p_gen"][ps] = gens
        for name in ("p_used", "p_hits"):
            cols[name][ps] = 0
        cols["p_pins"][ps] = 1  # pinned while pending
        journaled = r.journal_reserved(offsets, gens, fps[:m], mine[:m], tid, stride, page_bytes)
        cols["p_flags"][ps] = PENDING | JOURNALED if journaled else PENDING
        cols["p_knext"][ps] = cols["k_head"][recs]
        cols["k_head"][recs] = ps
        at = 0
        for slab, slots in runs:  # each slab: its new pins, its slot -> record map
            slab.pinned += len(slots)
            smap = r.slot_recs.get(slab.index)
            if smap is None or len(smap) != slab.num_slots:
                smap = r.slot_recs[slab.index] = array("i", [-1]) * slab.num_slots
            np.frombuffer(smap, np.int32)[np.frombuffer(slots, np.int32)] = ps[at:at + len(slots)]
            at += len(slots)
        ns = table[0]
        r.ns_bytes[ns] = r.ns_bytes.get(ns, 0) + m * stride
        make = Entry.__new__
        out: list[Entry] = [make(Entry) for _ in range(m)]
        ps_list = ps.tolist()
        for e, key, p, off, gen in zip(out, keys, ps_list, offsets.tolist(), gens.tolist()):
            e.ix, e.rec, e.table, e.key, e.slot_offset, e.stride, e.gen = (
                r, p, table, key, off, stride, gen)
        pend = r.pending.get(table)
        if pend is None:
            pend = r.pending[table] = {}
        pend.update(zip(keys, out))
        if owner:
            r.owners.update(dict.fromkeys(ps_list, owner))
        return out

    def _reserve_each(self, table: TableId, keys: Sequence[str], page_bytes: int,
                      stride: int, owner: int) -> list[Entry | None]:
        """``reserve`` of each key, one by one, each then owned by ``owner`` (0: none)."""
        out = [self.reserve(table, key, page_bytes, stride) for key in keys]
        if owner:
            for e in out:
                if e is not None:
                    e.owner = owner
        return out
