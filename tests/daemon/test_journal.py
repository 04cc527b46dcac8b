"""The journal of committed slots (``daemon/journal.py``) and adoption through the index's own
operations (``daemon/adoption.py``), on real journal files in /dev/shm: what is written at
commit, cleared before a free, torn records dropped, crashes at named points (the journal's
bytes copied at that instant are what a successor finds), slot claims, tags across
incarnations."""

import glob
import os
import uuid

import numpy as np
import pytest

from hicached.daemon.adoption import adopt
from hicached.daemon.index import PageIndex
from hicached.daemon.journal import GEN_GAP, GRAIN, Journal, file_bytes, first_gen
from hicached.daemon.slabs import SlabAllocator
from hicached.errors import ArenaError

ARENA, SLAB = 1 << 20, 1 << 16
T1, T2, T3 = ("ns-a", "kv"), ("ns-a", "state"), ("ns-b", "kv")
PB = 8192  # page bytes (stride 8 KiB: journaled); 8 slots a slab


@pytest.fixture
def meta():
    path = f"/dev/shm/hicached-test-{os.getpid()}-{uuid.uuid4().hex[:8]}.meta"
    yield path
    for p in [path] + glob.glob(path + ".copy-*"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def make(journal, kept=None):
    alloc = SlabAllocator(ARENA, SLAB, handed_out=journal.handed_out)
    return PageIndex(alloc, journal=journal, first_gen=first_gen(kept))


def put(ix, table, keys, page_bytes=PB, depth=None):
    es = [ix.reserve(table, k, page_bytes, -(-page_bytes // 64) * 64) for k in keys]
    if depth is not None:  # a chain: linked between reserve and commit, as a set does
        ix.link(table[0], keys, None, depth)
    ix.commit_many(es)
    return es


def crash_copy(j: Journal, meta: str) -> Journal:
    """The journal as a daemon killed now leaves it: its bytes at this instant, opened by a
    successor (the original stays mapped, as a killed daemon's file would be)."""
    copy = f"{meta}.copy-{uuid.uuid4().hex[:8]}"
    with open(copy, "wb") as f:
        f.write(bytes(j._buf))
    return Journal.adopt(copy, ARENA, SLAB)


def kept_at_crash(j: Journal, meta: str):
    """What a successor of a daemon killed now would adopt (``Journal.kept``)."""
    copy = crash_copy(j, meta)
    try:
        return copy.kept()
    finally:
        copy.close(keep=False)


def test_a_commit_is_journaled_and_a_successor_rebuilds_the_index_in_exact_slots(meta):
    j = Journal.create(meta, ARENA, SLAB, incarnation=1)
    ix = make(j)
    a = put(ix, T1, [f"a{i}" for i in range(5)], depth=0)
    put(ix, T3, ["b0", "b1"], page_bytes=5000)  # another stride class, another namespace
    ix.mark_trailing(T2)
    put(ix, T2, ["a4"])
    ix.touch(a[0])  # a0 used last
    top = ix.records.page_top
    j.stop(ix.records.np["p_used"][:top], ix.records.np["p_off"][:top])
    old = {(e.table, e.key): e.offset for e in ix.entries()}
    order = [(e.table, e.key) for e in ix.lru_order(PB)]
    j.close(keep=True)

    j2 = Journal.adopt(meta, ARENA, SLAB)
    kept = j2.kept()
    assert kept.clean and kept.torn == 0 and len(kept.records) == 8
    j2.reset()
    assert j2.incarnation == 2
    ix2 = make(j2, kept)
    done, entries = adopt(ix2, kept, lambda es, s: None, 15.0, now=1e12)  # (no fences)
    assert (done.pages, done.dropped) == (8, {})
    assert done.bytes == 6 * PB + 2 * 5000
    assert {(e.table, e.key): e.offset for e in ix2.entries()} == old
    assert [(e.table, e.key) for e in ix2.lru_order(PB)] == order  # exact recency (a0 last)
    assert ix2.chain("ns-a", "a3") == ("a2", 3)
    assert ix2.trailing("ns-a") == ix2.pool_bit(T2)
    assert ix2.ns_bytes == {"ns-a": 6 * PB, "ns-b": 2 * 5056}
    # tags above every tag the old daemon issued, GEN_GAP above the newest it kept
    assert min(e.gen for e in entries) == int(kept.records["gen"].max()) + GEN_GAP + 1
    assert min(e.gen for e in entries) > ix.records.gen

    # the adopted pages are journaled again: a third daemon finds them
    assert len(kept_at_crash(j2, meta).records) == 8
    j2.close(keep=False)


def test_a_slot_is_cleared_before_it_is_freed_and_a_torn_record_is_dropped(meta):
    j = Journal.create(meta, ARENA, SLAB, incarnation=1)
    ix = make(j)
    es = put(ix, T1, ["x0", "x1", "x2", "x3"])
    freed = []

    def free_and_look(offset, free=ix.alloc.free):  # the instant of the free: a crash here
        freed.append(len(kept_at_crash(j, meta).records))
        free(offset)

    ix.alloc.free = free_and_look
    ix.evict(es[1])
    assert freed == [3]  # x1's record was gone before its slot was freed
    # a record torn by a crash (its body half written): its check no longer matches
    at = es[2].offset // GRAIN
    j.words[at, 3] ^= np.uint64(1)
    kept = kept_at_crash(j, meta)
    assert kept.torn == 1 and sorted(kept.records["key"].tolist()) == [b"x0", b"x3"]
    # a commit cut off between its body and its check: check 0, not valid
    j.words[es[3].offset // GRAIN, 15] = 0
    assert kept_at_crash(j, meta).records["key"].tolist() == [b"x0"]
    j.close(keep=False)


def test_pending_pages_are_not_journaled_and_the_slabs_they_were_handed_from_are_fenced(meta):
    j = Journal.create(meta, ARENA, SLAB, incarnation=1)
    ix = make(j)
    put(ix, T1, ["c0", "c1"])
    pend = [ix.reserve(T1, k, PB, PB) for k in ("p0", "p1")]  # a set under way: killed now
    unbound = ix.reserve_unbound("ns-a", 5056)  # a set-ahead slot, in another class's slab
    kept = kept_at_crash(j, meta)
    assert not kept.clean and len(kept.records) == 2
    assert np.count_nonzero(kept.stamps) == 2  # the two slabs slots were handed out from
    j2 = crash_copy(j, meta)
    j2.reset()
    ix2 = make(j2)
    fenced = []
    done, _ = adopt(ix2, kept, lambda es, s: fenced.append((es, s)), 15.0,
                    now=float(kept.stamps.max()) + 1)
    assert done.pages == 2 and done.fenced_slots == 6 + 1  # 8 slots less 2 adopted; 1 slab
    (es, seconds), = fenced
    assert seconds == 15.0
    assert {e.offset for e in es} >= {p.offset for p in pend} | {unbound.offset}
    # per class: free + used + fenced = the class's slots
    slab = ix2.alloc.slab_of(pend[0].offset)
    assert len(slab.free) == 0 and slab.num_slots == 8
    assert ix2.alloc.slab_of(unbound.offset).stride == SLAB  # fenced whole
    # long after the hand-outs, nothing is fenced
    j3 = crash_copy(j, meta)
    j3.reset()
    done, _ = adopt(make(j3), kept, lambda es, s: fenced.append(es), 15.0,
                    now=float(kept.stamps.max()) + 16)
    assert done.fenced_slots == 0 and len(fenced) == 1
    for journal in (j, j2, j3):
        journal.close(keep=False)


def test_a_journal_of_another_geometry_is_not_adopted(meta):
    Journal.create(meta, ARENA, SLAB, incarnation=3).close(keep=True)
    assert Journal.mismatch(meta, ARENA, SLAB) is None
    assert Journal.mismatch(meta, 2 * ARENA, SLAB) == (
        f"l2_size changed: the kept arena has {ARENA} bytes, this daemon asks for {2 * ARENA}")
    assert "slab_size changed" in Journal.mismatch(meta, ARENA, 2 * SLAB)
    assert "no journal" in Journal.mismatch(meta + ".none", ARENA, SLAB)
    assert Journal.incarnation_at(meta) == 3 and Journal.incarnation_at(meta + ".none") == 0
    with open(meta, "r+b") as f:
        f.write(b"NOTAJRNL")
    assert "layout" in Journal.mismatch(meta, ARENA, SLAB)
    assert os.path.getsize(meta) == file_bytes(ARENA, SLAB)
    os.unlink(meta)


def test_a_slot_is_claimed_exactly_or_refused_with_its_numbers():
    a = SlabAllocator(ARENA, SLAB)
    a.claim(3 * SLAB + 2 * 4096, 4096)
    assert a.alloc(4096) == 3 * SLAB + 2 * 4096
    a.claim(3 * SLAB + 7 * 4096, 4096)
    assert a.alloc(4096) == 3 * SLAB + 7 * 4096
    with pytest.raises(ArenaError, match=f"slot {3 * SLAB + 7 * 4096} of class 4096 is taken"):
        a.claim(3 * SLAB + 7 * 4096, 4096)
    with pytest.raises(ArenaError, match="is not a slot of class 8192 \\(slab 3 has class 4096"):
        a.claim(3 * SLAB, 8192)
    assert a.alloc(8192) == 0  # the lowest free slab still comes first


def test_a_crash_point_is_checked_and_off_unless_set():
    from hicached.daemon.journal import CrashPoint
    from hicached.errors import ConfigError

    for bad in ("nowhere", "commit:0", "free:x"):
        with pytest.raises(ConfigError, match=f"HICACHED_TEST_CRASH_AT='{bad}': expected POINT"):
            CrashPoint(bad)
    point = CrashPoint("free:3")
    point.reach("commit")
    point.reach("free")
    assert (point.name, point.left) == ("free", 2)  # (the third free would kill this process)


def test_a_batch_commit_journals_the_same_records_as_one_by_one(meta):
    """Three ways to journal a commit write the same bytes: a run of reservations that wrote
    their records' fixed part (``journal_reserved``) then a batch commit (``write_rest``); a
    batch commit of pages reserved one by one (``journal_pages``' numpy pass); one commit per
    page (``journal_each``, Python ints). Chains and depths, a long key, a page of a stride
    not journaled, two tables, the in-L3 flag; and the checks ``kept`` reads are the Python
    ``check_of``'s."""
    from hicached.daemon.entry import JOURNALED
    from hicached.daemon.journal import check_of
    from hicached.daemon.reserving import BATCH_MIN

    keys = [f"k{i:03d}" for i in range(BATCH_MIN + 3)]
    words = []
    for way in ("run", "batch", "each"):
        j = Journal.create(f"{meta}.{way}", ARENA, SLAB, incarnation=1)
        try:
            ix = PageIndex(SlabAllocator(ARENA, SLAB, handed_out=j.handed_out), journal=j,
                           first_gen=1 << 20)
            if way == "run":
                chain = ix.reserve_many(T1, keys, PB, PB)
                assert all(ix.records.p_flags[e.rec] & JOURNALED for e in chain)
            else:
                chain = [ix.reserve(T1, k, PB, PB) for k in keys]
                assert not any(ix.records.p_flags[e.rec] & JOURNALED for e in chain)
            rest = [ix.reserve(T1, "x" * 80, PB, PB),  # (longer than KEY_BYTES)
                    ix.reserve(T3, "b0", PB, PB), ix.reserve(T3, "small", 100, 128)]
            ix.link(T1[0], keys[:20], "root", 4)
            ix.link(T1[0], keys[20:], None, -1)
            ix.records.p_flags[chain[3].rec] |= 4  # (IN_L3: the flag the journal keeps)
            if way == "each":
                for e in chain + rest:
                    ix.commit(e)
            else:
                ix.commit_many(chain)
                ix.commit_many(rest)
            used = np.flatnonzero(j.words[:, 15])
            words.append((used, j.words[used].copy()))
        finally:
            j.close(keep=False)
    (at, a), *others = words
    assert len(at) == len(keys) + 2  # (not the small page)
    for at_b, b in others:
        assert at.tolist() == at_b.tolist()
        assert (a == b).all()
    assert [check_of(w[:15].tolist()) for w in a] == a[:, 15].tolist()


def test_a_reservation_run_is_not_journaled_valid_before_its_commit(meta):
    """A run's fixed part is written at reservation with its check 0: a daemon killed then
    leaves nothing a successor adopts; its commit makes the records valid."""
    from hicached.daemon.reserving import BATCH_MIN

    j = Journal.create(meta, ARENA, SLAB, incarnation=1)
    ix = make(j)
    es = ix.reserve_many(T1, [f"k{i:03d}" for i in range(BATCH_MIN)], PB, PB)
    assert j.words[:, :15].any() and not j.words[:, 15].any()
    assert len(kept_at_crash(j, meta).records) == 0
    ix.commit_many(es)
    assert len(kept_at_crash(j, meta).records) == BATCH_MIN
    j.close(keep=False)


def test_an_eviction_in_one_pass_clears_its_records_before_a_slot_is_freed(meta):
    """A victim set evicted in one pass (``Evictor._unpublish_many``) clears every record of
    it before the first of its slots is freed, and leaves the journal's bytes of one by one."""
    from hicached.daemon.evict import BATCH_MIN
    from hicached.daemon.eviction.registry import make_policy

    keys = [f"c{i:02d}" for i in range(BATCH_MIN + 4)]
    words = []
    for way in ("pass", "each"):
        j = Journal.create(f"{meta}.{way}", ARENA, SLAB, incarnation=1)
        try:
            ix = PageIndex(SlabAllocator(ARENA, SLAB, handed_out=j.handed_out), journal=j,
                           policy=make_policy("hybrid"), first_gen=1 << 20)
            if way == "each":
                ix.evictor.batch_min = 1 << 30
            chain = put(ix, T1, keys, depth=0)
            put(ix, T3, ["b0", "b1"])  # (another namespace: kept)
            seen = []
            if way == "pass":
                real = ix.alloc.free_many

                def free_and_look(offsets):  # the instant of the first free: a crash here
                    seen.append(sorted(kept_at_crash(j, meta).records["key"].tolist()))
                    real(offsets)

                ix.alloc.free_many = free_and_look
            assert ix.evict(chain[0]) == len(keys)  # the head takes its chain, deepest first
            if way == "pass":
                assert seen == [[b"b0", b"b1"]]
            used = np.flatnonzero(j.words[:, 15])
            words.append((used.tolist(), j.words.copy()))
        finally:
            j.close(keep=False)
    (at, a), (at_b, b) = words
    assert len(at) == 2 and at == at_b and (a == b).all()
