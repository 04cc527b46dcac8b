"""The 3FS backend tells the daemon which pages it evicted (``take_evicted``), as the file L3
does: pages hot in L2 are never read from L3, so L3's LRU ages their copies out; a daemon that
went on counting on those copies would neither write them again nor keep them (write_back)
when L2 evicts them, and they would be gone for every engine and restart."""

import pytest
from l3_doubles import commit_pages, wait_jobs
from test_hf3fs import capacity_for, fill, make

from hicached.daemon.index import PageIndex
from hicached.daemon.l3.tier import L3Tier
from hicached.daemon.l3.workers import IOWorkers
from hicached.daemon.slabs import SlabAllocator

P = 4096


def keys(*names):
    return [("ns", "kv", n) for n in names]


def test_evictions_are_told_once_with_their_keys(arena, tmp_path, backends):
    b = make(tmp_path, arena, capacity=capacity_for(4), grace_s=0)
    backends.append(b)
    for i in range(6):
        fill(arena, i * P, P, i + 1)
    assert b.batch_put("ns", "kv", ["k0", "k1", "k2", "k3"], [0, P, 2 * P, 3 * P], P) == [True] * 4
    assert b.take_evicted() == []
    assert b.batch_get("ns", "kv", ["k0"], [8 * P], P) == [True]  # k0 is now the newest
    assert b.batch_put("ns", "kv", ["k4", "k5"], [4 * P, 5 * P], P) == [True, True]
    assert b.take_evicted() == keys("k1", "k2")
    assert b.take_evicted() == []  # told once
    # a page of another size retires the whole segment: its pages are told too
    assert b.batch_put("ns", "kv", ["big"], [0], 2 * P) == [True]
    assert sorted(b.take_evicted()) == sorted(keys("k0", "k3", "k4", "k5"))


def test_after_a_restart_pages_are_told_once_this_daemon_put_or_read_them(arena, tmp_path,
                                                                          backends):
    b = make(tmp_path, arena, node="n1", capacity=capacity_for(4), grace_s=0)
    assert b.batch_put("ns", "kv", ["k0", "k1", "k2", "k3"], [0, P, 2 * P, 3 * P], P) == [True] * 4
    b.close()
    b = make(tmp_path, arena, node="n1", capacity=capacity_for(4), grace_s=0)
    backends.append(b)
    assert b.take_evicted() == []
    assert b.batch_get("ns", "kv", ["k1"], [8 * P], P) == [True]  # read: k1's key is known
    assert b.batch_put("ns", "kv", ["k2"], [2 * P], P) == [True]  # stored already: known too
    # four new pages evict all four old ones; only the two this daemon knows are told (the
    # daemon cannot count on the others: it never heard of them)
    assert b.batch_put("ns", "kv", ["n0", "n1", "n2", "n3"], [0, P, 2 * P, 3 * P], P) == [True] * 4
    assert b.stats()["evictions"] == 4
    assert sorted(b.take_evicted()) == keys("k1", "k2")


def test_another_nodes_clear_loses_track_and_an_own_clear_does_not(arena, tmp_path, backends):
    b1, b2 = make(tmp_path, arena, node="n1"), make(tmp_path, arena, node="n2")
    backends += [b1, b2]
    assert b1.batch_put("ns", "kv", ["a"], [0], P) == [True]
    assert b2.batch_put("ns", "kv", ["c"], [0], P) == [True]
    assert b1.clear() == 2
    assert b1.take_evicted() == []  # the daemon that cleared forgets what it knew by itself
    b2.wipe_check_s = 0
    assert b2.batch_get("ns", "kv", ["c"], [4 * P], P) == [False]  # b2 notices and resets
    assert b2.take_evicted() is None  # c went without a word: forget everything
    assert b2.take_evicted() == []


def test_the_evicted_list_is_bounded(arena, tmp_path, backends, monkeypatch):
    import hicached.backends.hf3fs.space as space
    monkeypatch.setattr(space, "EVICTED_MAX", 2)
    b = make(tmp_path, arena, capacity=capacity_for(1), grace_s=0)
    backends.append(b)
    for i in range(4):  # each put evicts the previous page
        assert b.batch_put("ns", "kv", [f"k{i}"], [0], P) == [True]
    assert b.take_evicted() is None  # more than it keeps: lost track
    assert b.batch_put("ns", "kv", ["k9"], [0], P) == [True]
    assert b.take_evicted() == keys("k3")


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_the_tier_stops_counting_on_pages_3fs_evicted(arena, tmp_path, backends, policy):
    """A 3FS L3 with room for 2 pages: writing a third evicts the oldest, and the tier forgets
    it was stored (write_back: its L2 copy is dirty again, the only one left)."""
    index = PageIndex(SlabAllocator(arena.size_bytes, 64 * P))
    workers = IOWorkers()
    b = make(tmp_path / "l3", arena, capacity=capacity_for(2), grace_s=0)
    backends.append(b)
    tier = L3Tier(index, workers, b)
    tier.write_policy = policy
    try:
        first = commit_pages(index, arena, ["a", "b"], fill=1)
        assert tier.writes.write(first) == 2
        wait_jobs(workers, tier)
        assert all(e.in_l3 for e in first) and tier.is_known(("ns", "kv"), "a")
        third = commit_pages(index, arena, ["c"], fill=5)
        assert tier.writes.write(third) == 1
        wait_jobs(workers, tier)
        assert b.exists("ns", "kv", ["a", "b", "c"]) == [False, True, True]
        a = index.get(("ns", "kv"), "a")
        assert not a.in_l3 and not tier.is_known(("ns", "kv"), "a")
        assert index.get(("ns", "kv"), "b").in_l3
        assert (a in tier.writes.dirty) == (policy == "write_back")
        if policy == "write_through":  # set again: written again, so L3 has it once more
            assert tier.writes.write([a]) == 1
            wait_jobs(workers, tier)
            assert a.in_l3 and b.exists("ns", "kv", ["a"]) == [True]
    finally:
        workers.close()


def test_after_a_restart_a_page_the_tier_finds_stored_is_told_when_evicted(arena, tmp_path,
                                                                            backends):
    """The tier's writes ask ``exists`` first and send only what the store lacks, so a page
    stored before a restart is counted on without ``batch_put`` ever seeing it: ``exists``
    must learn its key too, or its eviction goes untold and the tier keeps counting on it."""
    b = make(tmp_path / "l3", arena, node="n1", capacity=capacity_for(2), grace_s=0)
    for i in range(2):
        fill(arena, i * P, P, i + 1)
    assert b.batch_put("ns", "kv", ["a", "b"], [0, P], P) == [True, True]
    b.close()
    b = make(tmp_path / "l3", arena, node="n1", capacity=capacity_for(2), grace_s=0)
    backends.append(b)
    index = PageIndex(SlabAllocator(arena.size_bytes, 64 * P))
    workers = IOWorkers()
    tier = L3Tier(index, workers, b, "write_back")
    try:
        a = commit_pages(index, arena, ["a"], fill=1)[0]
        tier.writes.on_commit([a])  # dirty ...
        assert tier.writes.write_back_all() == 1
        wait_jobs(workers, tier)
        # ... stored
        assert a.in_l3 and a not in tier.writes.dirty and tier.counters["l3_writes"] == 0
        new = commit_pages(index, arena, ["c", "d"], fill=7)
        tier.writes.on_commit(new)
        assert tier.writes.write_back_all() == 2  # evicts a and b from the store
        wait_jobs(workers, tier)
        assert b.exists("ns", "kv", ["a", "c", "d"]) == [False, True, True]
        assert not a.in_l3 and a in tier.writes.dirty  # told: L2 holds the only copy again
    finally:
        workers.close()
