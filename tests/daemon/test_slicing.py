"""Huge calls in slices of the control loop (``slicing.py``; issue 45, item 6): the slicer's
rules; calls worked in slices answer and leave exactly what the same calls worked at once do
(a commit in slices: the same pages, published from the deep end of its chain); and in a real
daemon, a client's small calls are answered while another's huge call is under way, the huge
caller's own later requests wait for it, and a reader never sees part of a key's pages."""

import random
import threading

import pytest
import torch
from conftest import wait_until
from inproc_daemon import inproc_daemon
from pools import indexer_pool, kv_pool, mamba_pool, pages

from hicached import Client, PoolTransfer
from hicached import protocol as P
from hicached.daemon import slicing
from hicached.daemon.controller import Controller
from hicached.daemon.eviction.registry import make_policy
from hicached.daemon.index import PageIndex
from hicached.daemon.l3.tier import L3Tier
from hicached.daemon.l3.workers import IOWorkers
from hicached.daemon.leases import LeaseTable
from hicached.daemon.sessions import Session, namespace_digest
from hicached.daemon.slabs import SlabAllocator
from hicached.daemon.slicing import Slicer, drive, fit_chunk, key_chunks
from hicached.errors import InvalidTransfer
from hicached.presence import PresenceTable
from tests.daemon.test_index_batch import snapshot

NS = "model-a"


# ---------------------------------------------------------------- the slicer


def test_key_chunks_keep_a_keys_positions_of_every_transfer_together():
    def plain(chunks):
        return [[(p, list(at)) for p, at in parts] for parts in chunks]

    assert plain(key_chunks([list("abcde")], 2)) == [[(0, [0, 1])], [(0, [2, 3])], [(0, [4])]]
    assert plain(key_chunks([list("abc"), list("abc")], 2)) == [
        [(0, [0, 1]), (1, [0, 1])], [(0, [2]), (1, [2])]]
    # a trailing pool's key (d, the chain's last) comes with d's KV page; x only in the third
    assert plain(key_chunks([list("abcd"), ["d"], ["x", "a"]], 2)) == [
        [(0, [0, 1]), (2, [1])], [(0, [2, 3]), (1, [0])], [(2, [0])]]
    assert key_chunks([[], []], 4) == []


def test_fit_chunk_takes_as_many_keys_as_fit_in_a_chunks_time():
    assert fit_chunk(128, 128, slicing.CHUNK_S / 10) == 128  # cheap keys: the whole chunk
    assert fit_chunk(128, 128, slicing.CHUNK_S * 4) == 32  # 4x too slow: a quarter
    assert fit_chunk(128, 64, slicing.CHUNK_S * 64) == slicing.MIN_CHUNK_KEYS
    assert fit_chunk(128, 0, 0.0) == 128
    assert fit_chunk(4, 4, slicing.CHUNK_S * 64) == 4  # never past the chunk asked for


def test_a_call_is_sliced_past_slice_keys_and_the_sizes_are_checked():
    s = Slicer(slice_keys=1024, chunk_keys=128)
    assert s.chunk(1024) is None and s.chunk(1025) == 128
    with pytest.raises(ValueError, match="chunk_keys 2048 must be >= 1 and <= slice_keys 1024"):
        Slicer(slice_keys=1024, chunk_keys=2048)


def steps(log, name, n, fail=None):
    for i in range(n):
        log.append((name, i))
        yield
    if fail is not None:
        raise fail
    return name.upper()


def test_calls_take_turns_a_slice_each_and_a_clients_requests_wait_for_its_call(caplog):
    log, done = [], []
    s = Slicer(slice_s=0.0)  # one chunk a slice
    s.start(steps(log, "a", 3), done.append, b"client-a", "A")
    s.start(steps(log, "b", 1), done.append, None, "B")
    assert s.active and s.holds(b"client-a") and not s.holds(b"client-b")
    assert s.hold(b"client-a", "req1") and s.hold(b"client-a", "req2")
    s.step()
    assert s.next_held(b"client-a") is None  # its call is under way
    while s.active:
        s.step()
    assert log == [("a", 0), ("b", 0), ("a", 1), ("a", 2)]
    assert done == ["B", "A"]
    assert [s.next_held(b"client-a") for _ in range(3)] == ["req1", "req2", None]
    st = s.status()
    assert st["calls"] == [] and st["held"] == 0
    assert (st["sliced_calls"], st["slices"], st["held_requests"]) == (2, 6, 2)
    # errors are the callers' answers; a bug is logged, and the other calls go on
    s.start(steps(log, "c", 2, InvalidTransfer("bad key 7")), done.append, b"c")
    s.start(steps(log, "d", 2, KeyError("x")), done.append, None, "D")
    s.start(steps(log, "e", 5), done.append)
    s.finish_now()
    assert [type(x).__name__ for x in done[2:]] == ["InvalidTransfer", "KeyError", "str"]
    assert "internal error in a sliced D" in caplog.text and "bad key 7" not in caplog.text
    assert not s.holds(b"c")


def test_a_slice_ends_after_its_chunk_once_a_request_waits():
    log, waits = [], []
    s = Slicer(slice_s=60.0, waiting=lambda: bool(waits))
    s.start(steps(log, "a", 5), lambda _: None)
    waits.append(1)  # a request in the socket: one chunk, then the loop reads it
    s.step()
    assert log == [("a", 0)]
    waits.clear()  # none: chunks until the slice's time is over (here: to the end)
    s.step()
    assert len(log) == 5 and not s.active


def test_requests_past_the_bound_are_refused(monkeypatch):
    monkeypatch.setattr(slicing, "MAX_HELD", 2)
    s = Slicer()
    s.start(steps([], "a", 1), lambda _: None, b"a")
    assert [s.hold(b"a", i) for i in range(3)] == [True, True, False]
    assert s.status()["refused_requests"] == 1


# ---------------------------------------------------------------- one path, sliced or not


class Recorder:
    """KV events of the index: the keys each ``stored`` told, in order."""

    def __init__(self, tids):
        self.told, self.tids = [], tids

    def stored(self, entries, chain, medium="L2"):
        self.told.append([e.key for e in entries])

    def removed_l2(self, pool, key):
        pass


def sliced_run(tmp_path, chunk, policy, commits_sliced=False, capacity=48):
    """A seeded run through ``Controller``, every call driven to its end (``drive``) with
    ``chunk`` (None: at once): sets (chains, present keys, set-ahead slots, evictions, a
    trailing pool), gets (and their releases) of stored and missing keys over two pools,
    exists over them. The answers, and the state after each call."""
    shared = PresenceTable(str(tmp_path / f"s{chunk}{policy}{commits_sliced}"), 2048, 1)
    events = Recorder({})  # the kv pool's pages told (``declare``'s, as the test registers it)
    ix = PageIndex(SlabAllocator(capacity * 4096, 4096), policy=make_policy(policy),
                   presence=shared, events=events)
    ix.records.gen = 0
    workers = IOWorkers()
    ctl = Controller(ix, LeaseTable(ix, 60.0, 60.0), L3Tier(ix, workers), lambda: 0.0,
                     ahead_session_bytes=8 * 256, ahead_total_bytes=1 << 20)
    s = Session(1, "a", namespace_digest("a"), 1, "a")
    ctl.sessions[s.id] = s
    ctl.register_pool(s, "kv", 256)
    ctl.register_pool(s, "mamba", 512)
    events.tids[ix.table_id((s.ns, "kv"))] = None
    rng = random.Random(7)
    stored: list[str] = []
    answers, states, recency = [], [], []

    def done(answer):
        answers.append(answer)
        states.append(snapshot(ix, shared))

    for step in range(60):
        if stored and rng.random() < 0.3:
            keys = rng.sample(stored, min(len(stored), rng.choice([3, 16]))) + ["never"]
            got = drive(ctl.lease_steps(s, P.Lease(step, s.id, [
                P.PoolKeys("kv", keys), P.PoolKeys("mamba", keys[-2:])]), None, chunk))
            done((got.lease_id, got.offsets, got.tags))
            q = [P.PoolQuery("mamba", "trailing_pages", 1)]
            ex = drive(ctl.exists_steps(s, P.Exists(step, s.id, keys, q), None, chunk))
            done((ex.kv_hit_pages, ex.pool_hits, ex.restorable))
            if got.lease_id:
                drive(ctl.release_steps(s, [got.lease_id], chunk))
                done(got.lease_id)
            continue
        n = rng.choice([3, 16, 40])
        keys = [f"{rng.getrandbits(64):016x}" for _ in range(n)]
        if stored and rng.random() < 0.3:
            keys[1:1] = rng.sample(stored, min(4, len(stored)))  # present
        transfers = [P.PoolKeys("kv", keys)]
        if rng.random() < 0.5:
            transfers.append(P.PoolKeys("mamba", keys[-1:]))
        parent = rng.choice(stored) if stored and rng.random() < 0.5 else ""
        msg = P.Reserve(step, s.id, transfers, want_ahead=rng.choice([[], [2]]),
                        trailing=["mamba"], parent=parent,
                        depth=rng.randrange(1, 9) if parent else -1)
        r = drive(ctl.sets.reserve_steps(s, msg, chunk))
        done((r.reservation_id, r.offsets, r.tags, r.ahead))
        ok = [[off >= 0 for off in row] for row in r.offsets]
        c = drive(ctl.sets.commit_steps(s, P.Commit(0, s.id, r.reservation_id, ok),
                                        chunk if commits_sliced else None))
        done(c.stored)
        fresh = [k for k, off in zip(keys, r.offsets[0]) if off >= 0]  # the call's new pages
        recency.append([ix.get((s.ns, "kv"), k).last_used for k in fresh])
        stored += keys
    workers.close()
    shared.close()
    return answers, states, events.told, ix, recency


@pytest.mark.parametrize("policy", ["lru", "hybrid"])
def test_calls_in_slices_answer_and_leave_what_calls_at_once_do(tmp_path, policy):
    """Reserve (evicting), Lease, Exists and Release, worked 3 keys a chunk, against the same
    calls at once: the same answers, and after each call exactly the same index, allocator,
    policy and presence table."""
    once = sliced_run(tmp_path, None, policy)
    sliced = sliced_run(tmp_path, 3, policy)
    assert once[3].evictions and once[0] == sliced[0]
    for i, (a, b) in enumerate(zip(once[1], sliced[1], strict=True)):
        diff = [k for k in a if a[k] != b[k]]
        assert not diff, (i, diff)


def test_a_commit_in_slices_publishes_the_same_pages_from_the_deep_end(tmp_path):
    """With room for every page (no eviction: recency decides nothing), commits in slices
    give the same answers and the same pages per key and pool as commits at once; a sliced
    call's pages are recent from its deep end to its first key (published in that order), and
    its KV events are told once, in the call's order."""
    once = sliced_run(tmp_path, None, "hybrid", capacity=4096)
    sliced = sliced_run(tmp_path, 3, "hybrid", commits_sliced=True, capacity=4096)
    assert once[0] == sliced[0] and not once[3].evictions
    assert once[2] == sliced[2]  # KV events: the same batches, keys in the same order
    for a, b in zip(once[1], sliced[1], strict=True):
        assert (a["k_mask"], a["p_off"], a["p_flags"]) == (b["k_mask"], b["p_off"], b["p_flags"])
    assert all(used == sorted(used) for used in once[4])  # at once: in the call's order
    calls = [used for used in sliced[4] if len(used) > 3]
    assert calls
    for used in calls:  # in slices: chunk by chunk from the deep end
        firsts = used[::3]
        assert firsts == sorted(firsts, reverse=True), used


# ---------------------------------------------------------------- in a real daemon

N = 16384  # keys of a huge call (1 KiB pages: 16 MiB a pool)


def fine_slices(d, chunk_keys=16):
    """The daemon's slicer at its finest (one chunk of ``chunk_keys`` keys a turn of the
    loop): a huge call spans thousands of turns, whatever the machine's speed."""
    def fine():
        slicer = d.daemon.controller.slicer
        slicer.slice_s, slicer.chunk_keys = 0.0, chunk_keys
    d.daemon.call(fine)


def under_way(d):
    return d.daemon.call(lambda: [c.what for c in d.daemon.controller.slicer.calls])


def socket_client(d, **kw):
    return Client(d.endpoint, NS, shared_exists=False, shared_gets=False, remember_pages=0,
                  timeout_s=60.0, **kw)


def test_small_calls_are_answered_while_a_huge_set_and_get_are_under_way(tmp_path):
    with inproc_daemon(tmp_path, l2_size=64 << 20, l3_backend="none") as d, \
            socket_client(d) as big, socket_client(d) as small:
        fine_slices(d, chunk_keys=4)
        big.register_mem_host_pool_v2(kv_pool(num_pages=N, seed=1), "kv")
        small.register_mem_host_pool_v2(kv_pool(num_pages=16, seed=2), "kv")
        mine = [f"s{i}" for i in range(4)]
        assert small.batch_set_v2([PoolTransfer("kv", pages(0, 4), keys=mine)])["kv"] == [
            True] * 4
        keys = [f"big{i}" for i in range(N)]
        for call in ("Reserve", "Lease"):
            out = {}
            if call == "Reserve":
                work = lambda: out.update(big.batch_set_v2(  # noqa: E731
                    [PoolTransfer("kv", pages(0, N), keys=keys)]))
            else:
                work = lambda: out.update(big.batch_get_v2(  # noqa: E731
                    [PoolTransfer("kv", pages(0, N), keys=keys)]))
            th = threading.Thread(target=work)
            th.start()
            assert wait_until(lambda: call in under_way(d), timeout_s=60), call
            # the small client's calls, each answered between two slices of the huge one
            assert small.batch_exists_v2(mine + ["nowhere"]).kv_hit_pages == 4
            assert small.batch_get_v2([PoolTransfer("kv", pages(8, 4), keys=mine)])["kv"] == [
                True] * 4
            new = [f"{call}-{i}" for i in range(4)]
            assert small.batch_set_v2([PoolTransfer("kv", pages(4, 4), keys=new)])["kv"] == [
                True] * 4
            assert call in under_way(d), call  # the huge call still under way
            th.join(60)
            assert out == {"kv": [True] * N}
        assert d.daemon.call(lambda: d.daemon.controller.slicer.counters["sliced_calls"]) >= 3


def test_the_huge_callers_later_requests_wait_for_its_call(tmp_path):
    """A set's Commit goes without waiting for an answer; the client's next request, read while
    the Commit is worked in slices, waits for it: an exists of the call's first keys (the last
    a commit in slices publishes) finds them all."""
    with inproc_daemon(tmp_path, l2_size=64 << 20, l3_backend="none") as d, \
            socket_client(d) as big:
        fine_slices(d)
        big.register_mem_host_pool_v2(kv_pool(num_pages=N, seed=1), "kv")
        keys = [f"big{i}" for i in range(N)]
        assert big.batch_set_v2([PoolTransfer("kv", pages(0, N), keys=keys)]) == {
            "kv": [True] * N}
        assert big.batch_exists_v2(keys[:8]).kv_hit_pages == 8
        counters = d.daemon.call(lambda: dict(d.daemon.controller.slicer.counters))
        assert counters["held_requests"] >= 1 and counters["refused_requests"] == 0
        assert big.batch_exists_v2(keys + ["nowhere"]).kv_hit_pages == N


def test_a_reader_never_sees_part_of_a_keys_pages_of_a_commit_in_slices(tmp_path):
    """KV and indexer pages of 16k keys and the chain's Mamba state, committed in slices while
    another client reads samples of the keys in both pools and asks for the chain's head: each
    key's two pages come together, the head's hit appears only with the whole call, and the
    pages do appear a part at a time (the deep end first)."""
    with inproc_daemon(tmp_path, l2_size=128 << 20, l3_backend="none") as d, \
            socket_client(d) as big, socket_client(d) as reader:
        fine_slices(d)
        for c, n, seed in ((big, N, 1), (reader, 64, 2)):
            c.register_mem_host_pool_v2(kv_pool(num_pages=n, seed=seed), "kv")
            c.register_mem_host_pool_v2(indexer_pool(num_pages=n, seed=seed), "indexer")
            c.register_mem_host_pool_v2(mamba_pool(seed=seed), "mamba")
        keys = [f"big{i}" for i in range(N)]
        sample = keys[::N // 32]
        assert big.batch_set_v2([
            PoolTransfer("kv", pages(0, N), keys=keys),
            PoolTransfer("indexer", pages(0, N), keys=keys),
            PoolTransfer("mamba", torch.tensor([1]), keys=keys[-1:], hit_policy="trailing_pages"),
        ], anchor_pool="kv", depth=0) == {"kv": [True] * N, "indexer": [True] * N,
                                          "mamba": [True]}
        # the Commit went without an answer: the daemon reads it a moment later
        assert wait_until(lambda: "Commit" in under_way(d), timeout_s=60)
        seen = []  # (kv hits, indexer hits, head's hit) read while the Commit was under way
        while "Commit" in under_way(d):
            got = reader.batch_get_v2([PoolTransfer("kv", pages(0, 32), keys=sample),
                                       PoolTransfer("indexer", pages(0, 32), keys=sample)])
            head = reader.batch_exists_v2(keys[:16], [PoolTransfer("indexer", keys=keys[:16])])
            if "Commit" in under_way(d):
                seen.append((got["kv"], got["indexer"], head.kv_hit_pages))
        assert seen, "the commit ended before the reader looked"
        assert all(kv == ix for kv, ix, _ in seen)  # a key's pages together
        assert all(h == 0 for _, _, h in seen)  # the head: not before the whole call
        assert any(0 < sum(kv) < len(sample) for kv, _, _ in seen)  # a part at a time
        assert all(kv == sorted(kv) for kv, _, _ in seen)  # from the deep end
        head = reader.batch_exists_v2(keys[:16], [PoolTransfer("indexer", keys=keys[:16])])
        assert head.kv_hit_pages == 16
