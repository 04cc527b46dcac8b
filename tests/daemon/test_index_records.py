"""The index's packed records (issue 24): batch lookups agree with one-by-one ones, handles of
pages that are gone read as gone, batch touches leave the state of single ones, and what a page
costs in the records."""

import random

import numpy as np

from hicached.daemon.index import KEY_BYTES, PageIndex
from hicached.daemon.slabs import SlabAllocator

KV, MAMBA = ("ns", "kv"), ("ns", "mamba")


def make(arena=1 << 20, slab=1 << 14):
    return PageIndex(SlabAllocator(arena, slab))


def keys_of_all_kinds(rng, n):
    """64-hex keys, short ones, ones longer than a record holds inline, non-ASCII ones."""
    out = []
    for i in range(n):
        kind = rng.randrange(4)
        if kind == 0:
            out.append(f"{rng.getrandbits(256):064x}")
        elif kind == 1:
            out.append(f"k{i}")
        elif kind == 2:
            out.append("long-" + "x" * (KEY_BYTES + rng.randrange(40)) + str(i))
        else:
            out.append(f"clé-{i}-ü")
    return out


def test_batch_lookups_agree_with_single_ones_for_every_kind_of_key():
    rng = random.Random(3)
    ix = make()
    keys = keys_of_all_kinds(rng, 300)
    held = keys[::2]
    ix.commit_many([ix.reserve(KV, k, 256, 256) for k in held])
    ix.commit_many([ix.reserve(MAMBA, k, 512, 512) for k in held[::3]])  # a second pool
    pending = ix.reserve(KV, keys[1], 256, 256)  # pending: no hit
    for n in (5, 31, 32, 120, 300):  # below and above the vectorised path's threshold
        ask = rng.sample(keys, n) + ["never-stored"]
        for table in (KV, MAMBA):
            single = [ix.get(table, k) for k in ask]
            assert ix.get_many(table, ask) == single
            assert ix.contains(table, ask).tolist() == [e is not None for e in single]
        masks = ix.presence("ns", ask).tolist()
        assert masks == ix.presence("ns", ask, verify=True).tolist()
        assert masks == [(ix.pool_bit(KV) if ix.get(KV, k) else 0)
                         | (ix.pool_bit(MAMBA) if ix.get(MAMBA, k) else 0) for k in ask]
    assert ix.get(KV, keys[1]) is None and ix.get_pending(KV, keys[1]) == pending
    assert ix.get_many(("other", "kv"), keys[:40]) == [None] * 40
    found = ix.get(KV, held[7])
    assert (found.key, found.table, found.page_bytes, found.stride) == (held[7], KV, 256, 256)


def test_a_handle_of_a_page_that_is_gone_reads_as_gone_even_when_its_record_is_reused():
    ix = make()
    a = ix.reserve(KV, "a", 256, 256)
    ix.commit(a)
    twin = ix.get(KV, "a")
    assert twin == a and hash(twin) == hash(a) and twin is not a
    ix.pin(twin)
    assert a.pins == 1  # the state is the record's, whichever handle changed it
    ix.unpin(a)
    a.in_l3 = True
    assert twin.in_l3 and not twin.writing
    ix.evict(a)
    b = ix.reserve(KV, "b", 256, 256)  # takes a's record and slot again
    ix.commit(b)
    assert b.rec == a.rec and b != a
    assert not a.committed and a.pins == 0 and a.offset == -1 and not a.in_l3
    a.in_l3 = True  # writes through a stale handle change nothing
    a.hits = 5
    assert not b.in_l3 and b.hits == 0 and ix.get(KV, "a") is None


def test_touch_many_leaves_the_state_of_single_touches():
    states = []
    for many in (False, True):
        ix = make(arena=1 << 16, slab=1 << 12)
        entries = [ix.reserve(KV, f"k{i}", 256, 256) for i in range(200)]
        ix.commit_many(entries)
        order = random.Random(9).choices(entries, k=150)
        if many:
            ix.touch_many(order)
        else:
            for e in order:
                ix.touch(e)
        states.append(([e.key for e in ix.lru_order(256)],
                       [(s.index, s.last_used) for s in ix.alloc.slabs],
                       [[x.index for x in o] for o in ix.alloc._by_age.values()]))
    assert states[0] == states[1]


def test_a_page_costs_about_200_bytes_of_records():
    """Columns, key table and slot map per page of a single-pool index of 64-hex keys (the
    daemon's heap per page, RssAnon, is ``tools/bench_index.py``'s figure)."""
    n = 20000
    ix = make(arena=(n * 4096 // (1 << 20) + 1) << 20, slab=1 << 20)
    rng = random.Random(1)
    for i in range(0, n, 500):
        ix.commit_many([ix.reserve(KV, f"{rng.getrandbits(256):064x}", 4096, 4096)
                        for _ in range(500)])
    assert len(ix) == n
    used = sum(a.nbytes for a in ix.records.np.values())
    used += sum(len(s) * s.itemsize for s in ix.records.slot_recs.values())
    used += ix.records.key_tables[0].table.nbytes + 2 * 4 * len(ix.policy.lru)
    assert used / n < 250, used / n
    assert not any(np.asarray(ix.records.np["p_flags"][n:]))  # records past the pages: never used


def test_past_the_tables_a_record_can_name_a_new_one_is_refused_clearly(monkeypatch):
    import pytest

    from hicached.daemon import records as records_module

    monkeypatch.setattr(records_module, "MAX_TABLES", 3)
    ix = make()
    for pool in ("a", "b", "c"):
        ix.commit(ix.reserve(("ns", pool), "k", 256, 256))
    with pytest.raises(ValueError, match="3 .namespace, pool. pairs"):
        ix.table_id(("ns", "d"))
    assert ix.get(("ns", "a"), "k") is not None and len(ix) == 3  # nothing else changed


def test_forget_in_l3_clears_every_committed_pages_mark_at_once():
    """An L3 detached (or cleared, or that lost its pages): every committed page's "in L3" mark
    goes in one numpy pass (a walk of handles held the loop 1.7 s at 200k pages); the handles
    of those that had it, in record order, when asked; pending pages are not the walk's."""
    ix = make()
    pages = [ix.reserve(KV, f"k{i}", 256, 256) for i in range(40)]
    ix.commit_many(pages[:30])
    marked = pages[:30:3]
    for e in [*marked, pages[33]]:
        e.in_l3 = True
    assert ix.forget_in_l3() == []
    assert not any(e.in_l3 for e in pages[:30]) and pages[33].in_l3  # (a load under way's)
    for e in marked:
        e.in_l3 = True
    assert [e.key for e in ix.forget_in_l3(handles=True)] == [e.key for e in marked]
    assert not any(e.in_l3 for e in pages[:30])
    # one namespace's (a flush of its L3 pages): the other's keep their marks
    other = [ix.reserve(("other", "kv"), f"k{i}", 256, 256) for i in range(5)]
    ix.commit_many(other)
    for e in [*marked, *other]:
        e.in_l3 = True
    assert ix.forget_in_l3(ns="nowhere") == []
    assert [e.key for e in ix.forget_in_l3(handles=True, ns="other")] == [e.key for e in other]
    assert all(e.in_l3 for e in marked) and not any(e.in_l3 for e in other)
