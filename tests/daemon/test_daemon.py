"""Integration: real daemons on ipc:// sockets, real clients, several processes."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import run_client_proc, wait_until
from pools import PAGE, indexer_pool, kv_pool, kv_tokens, mamba_pool, pages  # noqa: F401

from hicached import HostPool, PoolHitPolicy, PoolName, PoolTransfer
from hicached import protocol as P
from hicached.daemon.index import MAX_POOLS
from hicached.errors import (
    ProtocolError,
)


def test_set_get_roundtrip_three_pools(daemon):
    keys = [f"k{i}" for i in range(6)]
    with daemon.client() as w, daemon.client() as r:
        src = {"kv": kv_pool(seed=1), "mamba": mamba_pool(seed=2), "indexer": indexer_pool(seed=3)}
        dst = {"kv": kv_pool(), "mamba": mamba_pool(), "indexer": indexer_pool()}
        for name in src:
            w.register_mem_host_pool_v2(src[name], name)
            r.register_mem_host_pool_v2(dst[name], name)
        res = w.batch_set_v2([
            PoolTransfer(PoolName.KV, pages(0, 6), keys=keys),
            PoolTransfer(PoolName.MAMBA, torch.tensor([5]), keys=keys[5:],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES),
            PoolTransfer(PoolName.INDEXER, pages(0, 6), keys=keys),
        ])
        assert res == {"kv": [True] * 6, "mamba": [True], "indexer": [True] * 6}
        w.wait_committed()  # r's get may otherwise reach the daemon before w's commit
        # read into other host slots: KV pages 10..15, mamba slot 2
        got = r.batch_get_v2([
            PoolTransfer(PoolName.KV, pages(10, 6), keys=keys),
            PoolTransfer(PoolName.MAMBA, torch.tensor([2]), keys=keys[5:]),
            PoolTransfer(PoolName.INDEXER, pages(10, 6), keys=keys),
        ])
        assert got == {"kv": [True] * 6, "mamba": [True], "indexer": [True] * 6}
        assert torch.equal(kv_tokens(dst["kv"], 10, 6), kv_tokens(src["kv"], 0, 6))
        for a, b in zip(dst["mamba"].buffers, src["mamba"].buffers):
            assert torch.equal(a[2], b[5])
        assert torch.equal(dst["indexer"].buffers[0][10:16], src["indexer"].buffers[0][0:6])
        # second set of the same keys: present, nothing copied
        assert w.batch_set_v1(keys, pages(0, 6)) == [True] * 6
        st = w.stats()
        assert st["l2_pages_by_pool"] == {"kv": 6, "mamba": 1, "indexer": 6}
        assert st["leases"] == 0 or st["leases"] == 1  # release is asynchronous


def test_v1_calls_and_partial_miss(daemon):
    with daemon.client() as c:
        src, dst = kv_pool(seed=4), kv_pool()
        c.register_mem_pool_host(src)
        assert c.batch_set_v1(["a", "b"], pages(0, 2)) == [True, True]
        assert c.batch_exists(["a", "b", "c"]) == 2
        c.register_mem_pool_host(dst)  # the same pool name, re-registered: same geometry
        assert c.batch_get_v1(["a", "x", "b"], pages(3, 3)) == [True, False, True]
        assert torch.equal(kv_tokens(dst, 3, 1), kv_tokens(src, 0, 1))
        assert torch.equal(kv_tokens(dst, 5, 1), kv_tokens(src, 1, 1))
        assert kv_tokens(dst, 4, 1).abs().sum() == 0


def test_exists_v2_trailing_holes_through_daemon(daemon):
    keys = [f"p{i}" for i in range(5)]
    with daemon.client() as c:
        kv, mb, ix = kv_pool(seed=5), mamba_pool(seed=6), indexer_pool(seed=7)
        c.register_mem_host_pool_v2(kv, "kv")
        c.register_mem_host_pool_v2(mb, "mamba")
        c.register_mem_host_pool_v2(ix, "indexer")
        c.batch_set_v2([PoolTransfer("kv", pages(0, 5), keys=keys),
                        PoolTransfer("indexer", pages(0, 4), keys=keys[:4])])
        # Mamba states only at pages 1 and 3 (a tombstone at 2, nothing at 4)
        c.batch_set_v2([PoolTransfer("mamba", torch.tensor([0, 1]), keys=[keys[1], keys[3]])])
        res = c.batch_exists_v2(keys, [
            PoolTransfer("mamba", keys=keys[:1], hit_policy="trailing_pages"),
            PoolTransfer("indexer", keys=keys, hit_policy="all_pages"),
        ])
        assert res.kv_hit_pages == 4
        assert res.restorable_prefix_pages == [2, 4]
        assert res.extra_pool_hit_pages == {"kv": 5, "mamba": 4, "indexer": 4}
        # trailing window 2 for mamba: needs pages L-2, L-1
        res2 = c.batch_exists_v2(keys, [PoolTransfer("mamba", keys=keys[:2],
                                                     hit_policy="trailing_pages")])
        assert res2.kv_hit_pages == 0 and res2.restorable_prefix_pages == []


def test_exists_packed_keys_and_pool_limit(daemon):
    keys = [f"q{i}" for i in range(5)]
    with daemon.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=8), "kv")
        c.batch_set_v2([PoolTransfer("kv", pages(0, 3), keys=keys[:3])])
        # a client sending the keys NUL-joined in ``packed`` is answered the same
        packed = c._conn.call(lambda s, r: P.Exists(r, s, [], packed=P.pack_keys(keys)))
        assert packed.kv_hit_pages == c.batch_exists(keys) == 3
        for name in [f"p{i}" for i in range(MAX_POOLS - 1)]:  # "kv" has this namespace's bit 0
            c._conn.call(lambda s, r, name=name: P.RegisterPool(r, s, name, 4096))
        with pytest.raises(ProtocolError, match="at most 63 pools"):
            c._conn.call(lambda s, r: P.RegisterPool(r, s, "one-too-many", 4096))
        assert c.batch_exists(keys) == 3


def _proc_script(body):
    return (
        "import sys, json, torch\n"
        "sys.path[:0] = [%r, %r]\n"
        "from test_daemon import *\n"
        "from hicached import Client\n" % (os.path.dirname(__file__),
                                            os.path.dirname(os.path.dirname(__file__)))
    ) + body


WRITER = _proc_script("""
c = Client(sys.argv[1], sys.argv[2])
kv = kv_pool(seed=11)
c.register_mem_host_pool_v2(kv, 'kv')
keys = [f'shared{i}' for i in range(8)]
print(json.dumps(c.batch_set_v2([PoolTransfer('kv', pages(0, 8), keys=keys)])['kv']))
c.close()
""")

READER = _proc_script("""
c = Client(sys.argv[1], sys.argv[2])
kv = kv_pool()
c.register_mem_host_pool_v2(kv, 'kv')
keys = [f'shared{i}' for i in range(8)]
n = c.batch_exists(keys)
got = c.batch_get_v2([PoolTransfer('kv', pages(0, 8), keys=keys)])['kv']
same = torch.equal(kv.kv_buffer[:, :32], kv_pool(seed=11).kv_buffer[:, :32])
print(json.dumps({'exists': n, 'got': got, 'same': same}))
c.close()
""")


def test_processes_share_l2_within_a_namespace_only(daemon):
    assert json.loads(run_client_proc(WRITER, daemon.endpoint, "model-a")) == [True] * 8
    same_ns = json.loads(run_client_proc(READER, daemon.endpoint, "model-a"))
    assert same_ns == {"exists": 8, "got": [True] * 8, "same": True}
    other_ns = json.loads(run_client_proc(READER, daemon.endpoint, "model-b"))
    assert other_ns == {"exists": 0, "got": [False] * 8, "same": False}


HOLD_RESERVATION = _proc_script("""
from hicached import protocol as P
c = Client(sys.argv[1], 'model-a')
c.register_mem_host_pool_v2(kv_pool(), 'kv')
c.register_mem_host_pool_v2(mamba_pool(), 'mamba')
res = c._conn.call(lambda s, r: P.Reserve(r, s, [P.PoolKeys('kv', ['h0', 'h1']),
                                             P.PoolKeys('mamba', ['h1'])]))
print(json.dumps(res.offsets), flush=True)
import time; time.sleep(600)
""")


@pytest.fixture
def spawn():
    """Start a client process that prints one JSON line, then keeps running."""
    procs = []

    def start(script, *args):
        p = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        procs.append(p)
        line = p.stdout.readline()
        if not line:
            raise AssertionError(p.stderr.read())
        return p, json.loads(line)

    yield start
    for p in procs:
        p.kill()
        p.wait()
        p.stdout.close()
        p.stderr.close()



def test_sigkill_between_reserve_and_commit_leaves_nothing(daemon, spawn):
    p, offsets = spawn(HOLD_RESERVATION, daemon.endpoint)
    assert all(o >= 0 for row in offsets for o in row)
    with daemon.client() as c:
        c.register_mem_host_pool_v2(kv_pool(), "kv")
        assert c.stats()["reservations"] == 1
        assert c.batch_exists(["h0", "h1"]) == 0  # pending pages are invisible
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert wait_until(lambda: c.stats()["reservations"] == 0)
        st = c.stats()
        assert st["l2_pages"] == 0 and st["l2_used_bytes"] == 0
        assert c.batch_exists(["h0", "h1"]) == 0


def test_stalled_client_reservation_expires_after_ttl(make_daemon, spawn):
    """Its keys are free for others at once; its slots, which the stalled client may still be
    writing, come back one TTL later (the fence), or as soon as the client is gone."""
    d = make_daemon(extra=["--reservation-ttl-s", "2"])
    spawn(HOLD_RESERVATION, d.endpoint)  # alive, never commits
    with d.client() as c:
        assert c.stats()["reservations"] == 1
        used = c.stats()["l2_used_bytes"]
        assert wait_until(lambda: c.stats()["expired_reservations"] == 1, 6)
        st = c.stats()
        assert st["reservations"] == 0 and st["fenced_bytes"] == used > 0
        c.register_mem_host_pool_v2(kv_pool(seed=4), "kv")
        assert c.batch_set_v1(["h0"], pages(0, 1)) == [True]  # the key is free
        assert wait_until(lambda: c.stats()["fenced_bytes"] == 0, 5)
        c.flush("l2")
        assert c.stats()["l2_used_bytes"] == 0
    p2, _ = spawn(HOLD_RESERVATION, d.endpoint)
    with d.client() as c:
        assert wait_until(lambda: c.stats()["fenced_bytes"] > 0, 6)
        p2.kill()
        p2.wait()
        assert wait_until(lambda: c.stats()["fenced_bytes"] == 0, 1.2)  # before its 2 s fence
        c.flush("l2")
        assert c.stats()["l2_used_bytes"] == 0


HOLD_LEASE = _proc_script("""
from hicached import protocol as P
c = Client(sys.argv[1], 'model-a')
c.register_mem_host_pool_v2(kv_pool(seed=1), 'kv')
c.batch_set_v1(['l0'], pages(0, 1))
res = c._conn.call(lambda s, r: P.Lease(r, s, [P.PoolKeys('kv', ['l0'])]))
print(json.dumps(res.lease_id), flush=True)
import time; time.sleep(600)
""")


def test_sigkill_while_holding_lease_makes_page_evictable(make_daemon, spawn):
    d = make_daemon(l2_size="1MiB", slab_size="1MiB", extra=["--l3-backend", "none"])
    p, lease_id = spawn(HOLD_LEASE, d.endpoint)
    assert lease_id > 0
    with d.client() as c:
        kv = kv_pool(num_pages=512, seed=3)
        c.register_mem_host_pool_v2(kv, "kv")
        assert c.stats()["leases"] == 1
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert wait_until(lambda: c.stats()["leases"] == 0)
        # the arena holds 1MiB / 256B = 4096 slots; fill it: the formerly leased page must go
        keys = [f"fill{i}" for i in range(4096)]
        assert all(c.batch_set_v1(keys[:512], pages(0, 512)))
        for start in range(512, 4096, 512):
            c.batch_set_v1(keys[start:start + 512], pages(0, 512))
        assert c.batch_exists(["l0"]) == 0
        assert c.stats()["evictions"] >= 1


def test_full_arena_answers_no_space_and_corrupts_nothing(make_daemon):
    d = make_daemon(l2_size="64KiB", slab_size="64KiB", extra=["--l3-backend", "none"])
    with d.client() as c:
        src = kv_pool(num_pages=300, seed=9)
        c.register_mem_host_pool_v2(src, "kv")  # page = 2*4*2*2*8*4 = 1 KiB -> 64 slots
        from hicached import protocol as P
        keys = [f"f{i}" for i in range(64)]
        assert c.batch_set_v1(keys, pages(0, 64)) == [True] * 64
        lease = c._conn.call(lambda s, r: P.Lease(r, s, [P.PoolKeys("kv", keys)]))  # pin them all
        assert c.batch_set_v1(["more0", "more1"], pages(100, 2)) == [False, False]
        assert c.stats()["no_space"] == 2
        c._conn.send_only(P.Release(0, c.session, [lease.lease_id]))
        dst = kv_pool(num_pages=300)
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v1(keys, pages(0, 64)) == [True] * 64
        assert torch.equal(kv_tokens(dst, 0, 64), kv_tokens(src, 0, 64))
        # unpinned now: new pages evict the oldest
        assert c.batch_set_v1(["more0"], pages(100, 1)) == [True]


def test_namespaces_with_different_page_sizes_share_the_arena(make_daemon):
    d = make_daemon(l2_size="256KiB", slab_size="64KiB",  # only the sets evict: exact counts
                    extra=["--l3-backend", "none", "--evict-ahead", "0"])
    with d.client("small") as a, d.client("big") as b:
        small = kv_pool(num_pages=600, seed=1)  # 1 KiB pages
        big = HostPool.allocate_mha(64, 16, layers=2, heads=2, head_dim=8, layout="page_first",
                                    dtype=torch.float32)  # 4 KiB pages
        a.register_mem_host_pool_v2(small, "kv")
        b.register_mem_host_pool_v2(big, "kv")
        assert all(a.batch_set_v1([f"s{i}" for i in range(256)], pages(0, 256)))  # fills it all
        a.ping()  # a's commit is fire-and-forget: make sure it landed before b's reserve
        assert all(b.batch_set_v1([f"b{i}" for i in range(16)], torch.arange(0, 256)))
        b.ping()  # likewise b's commit, before a's stats on another socket
        st = a.stats()
        assert st["l2_pages_by_pool"]["kv"] == 256 - 64 + 16  # one 64 KiB slab reclaimed
        # the slab of the chain's deep end went (``--eviction lru``: the oldest, s0..s63, which
        # leaves 192 pages no hit reaches): the first 192 pages still hit
        assert a.batch_exists([f"s{i}" for i in range(256)]) == 192
        assert b.batch_exists([f"b{i}" for i in range(16)]) == 16
        assert st["l2_orphan_bytes"] == 0


def test_threads_share_one_client(daemon):
    with daemon.client() as c:
        src, dst = kv_pool(num_pages=64, seed=21), kv_pool(num_pages=64)
        c.register_mem_host_pool_v2(src, "kv")
        errors = []

        def work(t):
            try:
                for rnd in range(10):
                    keys = [f"t{t}-{rnd}-{i}" for i in range(4)]
                    assert c.batch_set_v1(keys, pages(t * 8, 4)) == [True] * 4
                    assert c.batch_exists(keys) == 4
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v1([f"t2-9-{i}" for i in range(4)], pages(0, 4)) == [True] * 4
        assert torch.equal(kv_tokens(dst, 0, 4), kv_tokens(src, 16, 4))


def test_close_lets_other_threads_finish_their_sets(daemon):
    """close() while another thread copies into its reservation: that set's commit still goes
    out before the Bye, so what it reports True is stored; calls after close() raise."""
    from hicached.errors import DaemonUnavailable
    c = daemon.client()
    src = kv_pool(seed=31)
    c.register_mem_host_pool_v2(src, "kv")
    io = c._pools.io("kv")
    copying, real = threading.Event(), io.to_arena

    def slow_to_arena(*args):
        copying.set()
        time.sleep(0.5)  # close() is called meanwhile
        return real(*args)

    io.to_arena = slow_to_arena
    keys = [f"late{i}" for i in range(4)]
    result = {}
    writer = threading.Thread(target=lambda: result.update(ok=c.batch_set_v1(keys, pages(0, 4))))
    writer.start()
    assert copying.wait(10)
    c.close()  # returns once the writer's commit went out
    writer.join()
    assert result["ok"] == [True] * 4
    with pytest.raises(DaemonUnavailable):
        c.batch_set_v1(["after"], pages(0, 1))
    with pytest.raises(DaemonUnavailable):
        c.batch_get_v1(keys, pages(0, 4))
    with daemon.client() as other:
        dst = kv_pool()
        other.register_mem_host_pool_v2(dst, "kv")
        assert other.batch_get_v1(keys, pages(4, 4)) == [True] * 4
        assert torch.equal(kv_tokens(dst, 4, 4), kv_tokens(src, 0, 4))


def test_commit_answers_and_expired_reservation(daemon):
    from hicached import protocol as P
    with daemon.client() as c:
        c.register_mem_host_pool_v2(kv_pool(), "kv")
        c.register_mem_host_pool_v2(mamba_pool(), "mamba")
        res = c._conn.call(lambda s, r: P.Reserve(r, s, [P.PoolKeys("kv", ["c0", "c1"]),
                                                     P.PoolKeys("mamba", ["c1"])]))
        assert c.batch_exists(["c0"]) == 0
        ok = [[True, False], [True]]  # the copy of kv page c1 "failed": only it is aborted
        done = c._conn.call(lambda s, r: P.Commit(r, s, res.reservation_id, ok))
        assert done.stored == ok
        assert c.batch_exists(["c0", "c1"]) == 1
        st = c.stats()
        assert st["reservations"] == 0 and st["l2_pages_by_pool"] == {"kv": 1, "mamba": 1}
        again = c._conn.call(lambda s, r: P.Commit(r, s, res.reservation_id, ok))
        assert again.stored == [[False, False], [False]]  # gone: nothing published twice


def test_set_then_exists_reads_own_writes(daemon):
    with daemon.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=2), "kv")
        for rnd in range(20):  # the commit is not awaited; the next request is ordered after it
            keys = [f"ryw{rnd}-{i}" for i in range(8)]
            assert c.batch_set_v1(keys, pages(0, 8)) == [True] * 8
            assert c.batch_exists(keys) == 8


def test_stale_client_of_a_restarted_daemon_never_acts_in_another_session(make_daemon):
    """Session ids are random: after a restart, a client that still holds its old id must not
    land in a session the new daemon gave to someone else (another namespace)."""
    d = make_daemon(extra=["--l3-backend", "none"])
    stale = d.client(namespace="tenant-a")
    try:
        old_session = stale.session
        d.stop()
        d.start()
        with d.client(namespace="tenant-b") as other:
            assert other.session != old_session
            host = HostPool.allocate_mla(2, 1, 1, 32, dtype=torch.bfloat16)
            other.register_mem_host_pool_v2(host, "kv")
            stale.register_mem_host_pool_v2(host, "kv")  # joins again
            assert stale.batch_set_v1(["k0", "k1"], torch.arange(2)) == [True, True]
            assert stale.session != old_session
            stale.ping()
            assert other.batch_exists(["k0", "k1"]) == 0  # nothing leaked into tenant-b
            assert stale.batch_exists(["k0", "k1"]) == 2
    finally:
        stale.close()
