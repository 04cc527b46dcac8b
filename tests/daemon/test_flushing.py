"""Flushing L2 in slices of the control loop (flushing.py): unit tests over a real index and
tier, and a real daemon that answers other clients while it flushes a large L2."""

import json
import re
import threading

import pytest
import torch

from hicached import HostPool, PoolTransfer
from hicached.daemon.flushing import CHECK_EVERY, L2Flush
from hicached.daemon.index import PageIndex
from hicached.daemon.l3.tier import L3Tier
from hicached.daemon.l3.workers import IOWorkers
from hicached.daemon.slabs import SlabAllocator

PAGE = 4096
TABLE = ("ns", "kv")


@pytest.fixture
def tier():
    index = PageIndex(SlabAllocator(64 * 2**20, 2**20))  # 256 pages of 4 KiB a slab
    workers = IOWorkers()
    yield L3Tier(index, workers)
    workers.close()


def commit(index, keys):
    out = []
    for key in keys:
        e = index.reserve(TABLE, key, PAGE, PAGE)
        index.commit(e)
        out.append(e)
    return out


def walk(flush):
    """Step until the walk ends; how many steps it took."""
    steps = 0
    while flush.active:
        flush.step()
        steps += 1
        assert steps < 10_000
    return steps


def test_a_flush_walks_the_arena_in_slices_and_answers_at_the_end(tier):
    commit(tier.index, [f"k{i}" for i in range(3000)])
    flush = L2Flush(tier, slice_s=0)  # every slice stops after CHECK_EVERY slots
    got = []
    flush.request(got.append)
    flush.step()
    assert got == [] and flush.active
    status = flush.status()
    assert status["dropped"] == CHECK_EVERY and status["waiting"] == 1
    assert 0 < len(tier.index) < 3000  # requests are served between slices, half-flushed
    steps = walk(flush)
    assert got == [3000] and len(tier.index) == 0
    assert steps + 1 >= 3000 // CHECK_EVERY
    assert flush.status() is None and not flush.active


def test_pinned_pages_stay_and_pages_being_written_are_dropped_once_written(tier):
    leased, writing, _ = commit(tier.index, ["leased", "writing", "plain"])
    tier.index.pin(leased)
    writing.writing = True
    tier.index.pin(writing)  # as an L3 write pins it
    flush = L2Flush(tier)
    got = []
    flush.request(got.append)
    walk(flush)
    assert got == []  # answered once the page being written is written and dropped
    assert tier.index.get(TABLE, "leased") == leased
    assert tier.writes.drop_when_written == {writing}
    assert tier.index.get(TABLE, "plain") is None
    assert flush.status()["writing"] == 1 and not flush.active
    flush.settle()
    assert got == []
    writing.writing = False  # the write ends, as ``L3Writes.done`` ends it
    tier.index.unpin(writing)
    tier.writes._maybe_drop(writing)
    flush.settle()
    assert got == [2]  # plain dropped then, writing counted: both gone now
    assert tier.index.get(TABLE, "writing") is None and flush.status() is None


def test_finish_now_answers_a_flush_waiting_for_writes(tier):
    (writing,) = commit(tier.index, ["writing"])
    writing.writing = True
    tier.index.pin(writing)
    flush = L2Flush(tier)
    got = []
    flush.request(got.append)
    flush.finish_now()  # shutdown: every waiter answered, written or not
    assert got == [1] and not flush.settling


def test_a_flush_answers_after_the_write_through_writes_it_waited_for(make_daemon, tmp_path):
    """Write-through pages still being written when the walk reaches them are dropped once
    written, and the flush is answered then: a flushed L2 holds none of them, however slow the
    store (here each put takes 1 s)."""
    opts = json.dumps({"root": str(tmp_path / "l3"), "put_delay_s": 1.0})
    d = make_daemon(extra=("--l3-backend", "l3_doubles:SlowFileBackend", "--l3-options", opts))
    pool = HostPool.allocate_mla(8, 1, 1, 512, dtype=torch.bfloat16)
    with d.client() as c:
        c.register_mem_host_pool_v2(pool, "kv")
        keys = [f"w{i}" for i in range(4)]
        assert all(c.batch_set_v2([PoolTransfer("kv", torch.arange(4), keys=keys)])["kv"])
        assert c.stats()["l2_pages"] == 4
        c.flush("l2")
        st = c.stats()
        assert st["l2_pages"] == 0 and st["l2_flush"] is None
        assert c.stats()["l3_writes"] == 4  # written first, then dropped


def test_a_flush_asked_mid_walk_gets_a_walk_of_its_own(tier):
    commit(tier.index, [f"k{i}" for i in range(1024)])  # 4 full slabs
    flush = L2Flush(tier, slice_s=0)
    first, second = [], []
    flush.request(first.append)
    flush.step()  # the first slab is behind the walk now, and free again
    late = commit(tier.index, ["late"])[0]  # lands in the slab the walk already passed
    assert late.offset < tier.index.alloc.slab_bytes
    flush.request(second.append)
    walk(flush)
    assert first == [1024] and second == [1]  # the second walk dropped what the first passed
    assert len(tier.index) == 0


def test_flushes_asked_together_share_one_walk_and_finish_now_answers_all(tier):
    commit(tier.index, [f"k{i}" for i in range(600)])
    flush = L2Flush(tier, slice_s=0)
    got = []
    flush.request(lambda n: got.append(("a", n)))
    flush.request(lambda n: got.append(("b", n)))  # before the first step: joins
    flush.step()
    flush.request(lambda n: got.append(("c", n)))  # mid-walk: queued
    flush.finish_now()
    assert got == [("a", 600), ("b", 600), ("c", 0)]
    assert not flush.active and flush.slice_s == 0


def test_a_namespace_flush_drops_that_namespace_only_and_walks_share_by_namespace(tier):
    index = tier.index
    mine = commit(index, [f"m{i}" for i in range(300)])  # namespace "ns" (TABLE)
    others = [index.reserve(("other", "kv"), f"m{i}", PAGE, PAGE) for i in range(200)]
    for e in others:  # the same keys in another namespace
        index.commit(e)
    flush = L2Flush(tier, slice_s=0)
    got = []
    flush.request(lambda n: got.append(("ns", n)), "ns")
    flush.request(lambda n: got.append(("nobody", n)), "nobody")  # joins: the walk drops both
    flush.step()
    flush.request(lambda n: got.append(("other", n)), "other")  # mid-walk: a walk of its own
    flush.request(lambda n: got.append(("ns-again", n)), "ns")  # (shares that one)
    walk(flush)
    assert got == [("ns", 300), ("nobody", 0), ("other", 200), ("ns-again", 0)]
    assert not any(e.alive for e in mine + others)
    for e in commit(index, ["x", "y"]):
        assert e.committed
    kept = index.reserve(("other", "kv"), "z", PAGE, PAGE)
    index.commit(kept)
    flush.request(lambda n: got.append(("ns", n)), "ns")
    flush.request(lambda n: got.append(("node", n)))  # a node's flush joins: every page goes
    walk(flush)
    assert got[-2:] == [("ns", 2), ("node", 3)]
    assert len(index) == 0


def test_a_waiter_that_raises_does_not_cost_the_others_their_answer(tier):
    commit(tier.index, ["k"])
    flush = L2Flush(tier)
    got = []
    flush.request(lambda n: 1 / 0)
    flush.request(got.append)
    walk(flush)
    assert got == [1]


def test_a_daemon_answers_other_clients_while_it_flushes_a_large_l2(make_daemon):
    d = make_daemon(l2_size="96MiB", slab_size="1MiB", extra=("--l3-backend", "none"))
    n = 64 * 1024  # pages of 1 KiB: tens of ms of index work to drop
    pool = HostPool.allocate_mla(n, 1, 1, 512, dtype=torch.bfloat16)
    # spin_s=0: both wait in poll without the GIL, so the watcher's requests keep coming
    with d.client(spin_s=0) as writer, d.client(spin_s=0) as watcher:
        writer.register_mem_host_pool_v2(pool, "kv")
        for start in range(0, n, 8192):
            keys = [f"p{i}" for i in range(start, start + 8192)]
            assert all(writer.batch_set_v2(
                [PoolTransfer("kv", torch.arange(start, start + 8192), keys=keys)])["kv"])
        assert writer.stats()["l2_pages"] == n  # after its commits (the same socket)
        seen, done = [], threading.Event()

        def watch():
            while not done.is_set():
                seen.append(watcher.stats()["l2_flush"])

        t = threading.Thread(target=watch)
        t.start()
        try:
            writer.flush("l2")
        finally:
            done.set()
            t.join()
        assert writer.stats()["l2_pages"] == 0
        progress = [s for s in seen if s]
        assert progress, "no request was answered while the flush ran"
        assert all(0 <= s["slab"] < s["slabs"] and s["waiting"] == 1 for s in progress)
    slices = re.findall(r"flushed (\d+) pages from L2 in [\d.]+ s \((\d+) slices", d.output())
    assert slices and int(slices[-1][0]) == n and int(slices[-1][1]) > 1


def test_a_walk_that_fails_answers_its_waiters_and_ends(tier):
    commit(tier.index, [f"k{i}" for i in range(10)])
    flush = L2Flush(tier)
    flush.index = None  # a bug: the walk cannot read the index
    got = []
    flush.request(got.append)
    flush.step()
    assert got == [0] and not flush.active
