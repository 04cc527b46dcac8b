"""L3 follows the hybrid cache controller's rules (issue 25): write-back writes a chain from its
root side, a selective write does not spend L3 bandwidth on a state whose KV prefix is not
stored, the audit asks the policy which pages go next. The store is the real file backend."""

import pytest
from l3_doubles import PAGE, RecordingBackend, wait_jobs

from hicached.daemon.eviction.registry import make_policy
from hicached.daemon.index import PageIndex
from hicached.daemon.l3.tier import L3Tier
from hicached.daemon.l3.workers import IOWorkers
from hicached.daemon.slabs import SlabAllocator


@pytest.fixture
def tier(tmp_path, arena):
    workers = IOWorkers()
    index = PageIndex(SlabAllocator(arena.size_bytes, 64 * PAGE), policy=make_policy("hybrid"))
    backend = RecordingBackend(str(tmp_path / "l3"), min_free=0)
    backend.open(arena)
    t = L3Tier(index, workers, backend)
    yield index, workers, backend, t
    workers.close()
    backend.close()


def store(index, arena, keys, parent=None, states=()):
    entries = []
    for i, key in enumerate(keys):
        e = index.reserve(("ns", "kv"), key, PAGE, PAGE)
        arena.tensor[e.offset:e.offset + PAGE].fill_(i + 1)
        entries.append(e)
    for key in states:
        index.mark_trailing(("ns", "mamba"))
        entries.append(index.reserve(("ns", "mamba"), key, PAGE, PAGE))
    index.link("ns", keys, parent, -1)
    index.commit_many(entries)
    return entries


def test_write_back_writes_a_chain_root_side_first_with_the_dirty_heads_of_a_pick(tier, arena):
    index, workers, backend, t = tier
    t.write_policy = "write_back"
    first = store(index, arena, ["a0", "a1", "a2"])
    second = store(index, arena, ["a3", "a4"], parent="a2")
    t.writes.on_commit(first)
    t.writes.on_commit(second)
    index.touch_many(first)  # the head is now the most recently used: LRU picks the tail
    tail = index.get(("ns", "kv"), "a4")
    assert t.writes.write(t.writes._heads_first([tail])) == 5
    wait_jobs(workers, t)
    assert backend.sent == ["a0", "a1", "a2", "a3", "a4"]  # never a tail before its head
    assert not t.writes.dirty


def test_a_selective_write_waits_for_the_states_kv_prefix(tier, arena):
    index, workers, backend, t = tier
    t.write_policy, t.threshold = "write_through_selective", 1
    _, kv1, state = store(index, arena, ["k0", "k1"], states=["k1"])
    state.hits = kv1.hits = 1
    t.writes.on_hit(state)  # k1's KV page is not stored: the state would restore nothing
    assert backend.sent == [] and not state.writing
    t.writes.on_hit(kv1)
    t.writes.on_hit(state)  # now its KV page is being written: the state goes too
    wait_jobs(workers, t)
    assert backend.sent == ["k1", "k1"] and state.in_l3


def test_the_audit_asks_about_the_next_leaf_segments_not_the_lru_heads(tier, arena):
    index = tier[0]
    store(index, arena, ["c0", "c1", "c2", "c3"])
    # LRU's next victims would be c0, c1 (the oldest); the policy's are the chain's deep end
    assert [index.handle(p).key for p in index.policy.upcoming(PAGE, 4)] == [
        "c3", "c2", "c1", "c0"]
    lru = PageIndex(SlabAllocator(arena.size_bytes, 64 * PAGE))
    store(lru, arena, ["c0", "c1", "c2", "c3"])
    assert [lru.handle(p).key for p in lru.policy.upcoming(PAGE, 4)] == ["c0", "c1", "c2", "c3"]
