"""Mooncake L3: a real ``mooncake_master`` on loopback, real arenas, real daemons.

Covers the backend contract (zero-copy round trip, exists, skip of stored keys, size mismatch,
namespaces), options and errors, degradation (killed / hung master answers misses within the
deadline), recovery (master restarted on the same port, master started after the backend) and
two daemons sharing pages through one master.
"""

import itertools
import json
import os
import sys
import threading
import time
import uuid

import pytest
import torch
from conftest import wait_until
from mooncake_master import Master, require_mooncake
from pools import kv_pool, kv_tokens, pages

require_mooncake()  # skips the module: the extra (or its libibverbs / libnuma) is missing

from hicached import PoolTransfer
from hicached.arena import Arena
from hicached.backends import create_backend
from hicached.backends.mooncake.backend import MooncakeBackend
from hicached.backends.mooncake.options import MooncakeOptions, redact
from hicached.backends.mooncake.transfers import key_part, object_key
from hicached.errors import BackendUnavailable, ConfigError

PAGE = 64 * 1024


@pytest.fixture
def master(tmp_path):
    m = Master(tmp_path / "master.log").start()
    yield m
    m.stop()


@pytest.fixture
def make_arena():
    made = []

    def make(size=8 << 20):
        a = Arena.create(f"/dev/shm/hicached-test-mc-{os.getpid()}-{uuid.uuid4().hex[:8]}", size)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


@pytest.fixture
def make_backend(make_arena):
    made = []

    def make(address, arena=None, **opts):
        opts = {"master_server_address": address, "protocol": "tcp",
                "global_segment_size": "32MiB", "local_buffer_size": "4MiB", "local_hostname": "127.0.0.1", "backoff_s": 0.2,
                "max_backoff_s": 1.0, "close_timeout_s": 2.0, **opts}
        b = create_backend("mooncake", env={}, **opts)
        b.open(arena or make_arena())
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def fill_random(arena, offset, n, seed):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    arena.tensor[offset:offset + n] = data
    return data


def timed(fn):
    t = time.monotonic()
    out = fn()
    return out, time.monotonic() - t


# ---------------------------------------------------------------- options and keys


def test_options_env_fallback_and_errors():
    env = {"MOONCAKE_MASTER": "10.0.0.1:50051", "MOONCAKE_PROTOCOL": "rdma",
           "MOONCAKE_DEVICE": "mlx5_0", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1GiB",
           "LOCAL_HOSTNAME": "node-7", "SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE": "33554432"}
    o = MooncakeOptions.resolve({"protocol": "tcp"}, env)
    assert (o.master_server_address, o.protocol, o.device_name) == ("10.0.0.1:50051", "tcp",
                                                                    "mlx5_0")
    assert (o.global_segment_size, o.local_buffer_size) == (1 << 30, 32 << 20)
    assert (o.local_hostname, o.metadata_server, o.timeout_s) == ("node-7", "P2PHANDSHAKE", 2.0)
    assert MooncakeOptions.resolve({"global_segment_size": 0}, env).global_segment_size == 0
    # an SGLang operator's JSON works unchanged, its engine-only keys are ignored
    sglang = {"master_server_address": "m:1", "metadata_server": "P2PHANDSHAKE",
              "global_segment_size": "64MiB", "protocol": "tcp", "device_name": "",
              "master_metrics_port": 9003, "check_server": False, "standalone_storage": False}
    assert MooncakeOptions.resolve(sglang, {}).global_segment_size == 64 << 20
    with pytest.raises(ConfigError, match="'timeout'"):
        MooncakeOptions.resolve({"master_server_address": "m:1", "timeout": 3}, {})
    with pytest.raises(ConfigError, match="master_server_address is required"):
        MooncakeOptions.resolve({}, {})
    with pytest.raises(ConfigError, match="protocol"):
        MooncakeOptions.resolve({"master_server_address": "m:1", "protocol": "udp"}, {})
    with pytest.raises(ConfigError, match="global_segment_size"):
        MooncakeOptions.resolve({"master_server_address": "m:1", "global_segment_size": "lots"},
                                {})
    with pytest.raises(ConfigError, match="standalone_storage"):
        MooncakeOptions.resolve({"master_server_address": "m:1", "standalone_storage": True}, {})
    with pytest.raises(ConfigError, match="'bogus'"):
        create_backend("mooncake", env={}, master_server_address="m:1", bogus=1)
    assert redact("etcd://admin:s3cret@10.0.0.2:2379") == "etcd://***@10.0.0.2:2379"
    o = MooncakeOptions.resolve({"metadata_server": "http://u:pw@meta:8080/metadata"}, env)
    assert "pw" not in o.describe() and "meta:8080" in o.describe()


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import now raises ImportError
    # the hint is the install that works: the extra from this clone (or, out of a clone, the
    # extra's own packages), naming the package either way (hicached/extras.py)
    with pytest.raises(ConfigError, match=r"pip install .*\[mooncake\].*"
                                          r"mooncake-transfer-engine-non-cuda"):
        MooncakeBackend(env={}, master_server_address="m:1")


def test_object_keys_are_stable_and_separated():
    assert object_key("hicached", "ab12", "kv", "k-0") == "hicached/ab12/kv/k-0"
    odd = "tenant a/../x\n" + "y" * 300
    assert key_part(odd) == key_part(odd) and key_part(odd).startswith("h-")
    assert len(key_part(odd)) == 66 and "/" not in key_part(odd)
    assert key_part("h-abc") != "h-abc"  # a plain key cannot pose as a digest
    assert object_key("hicached", "ns1", "kv", "k") != object_key("hicached", "ns2", "kv", "k")
    assert object_key("hicached", "n", "a/b", "c") != object_key("hicached", "n", "a", "b/c")


# ---------------------------------------------------------------- contract, real master


def test_roundtrip_exists_skip_sizes_namespaces_clear(master, make_backend, make_arena):
    arena = make_arena()
    b = make_backend(master.address, arena)
    src = [fill_random(arena, i * PAGE, PAGE, seed=i) for i in range(4)]
    keys = ["p0", "p1", "p2", "odd key/ü"]
    assert b.batch_put("nsA", "kv", keys, [i * PAGE for i in range(4)], PAGE) == [True] * 4
    assert b.exists("nsA", "kv", keys + ["absent"]) == [True] * 4 + [False]
    assert b.exists("nsA", "mamba", keys[:1]) == [False]
    assert b.exists("nsB", "kv", keys[:1]) == [False]

    # get into other slots: byte-equal, in the order asked
    dst = [1 << 20, 2 << 20, 3 << 20, 4 << 20]
    arena.tensor[1 << 20:5 << 20] = 0
    got = b.batch_get("nsA", "kv", [keys[3], keys[0], "absent", keys[2]], dst, PAGE)
    assert got == [True, True, False, True]
    assert torch.equal(arena.tensor[dst[0]:dst[0] + PAGE], src[3])
    assert torch.equal(arena.tensor[dst[1]:dst[1] + PAGE], src[0])
    assert torch.equal(arena.tensor[dst[3]:dst[3] + PAGE], src[2])
    assert arena.tensor[dst[2]:dst[2] + PAGE].eq(0).all()

    # a stored key is skipped (success) and keeps its first bytes
    fill_random(arena, 5 << 20, PAGE, seed=99)
    assert b.batch_put("nsA", "kv", ["p1"], [5 << 20], PAGE) == [True]
    assert b.batch_get("nsA", "kv", ["p1"], [6 << 20], PAGE) == [True]
    assert torch.equal(arena.tensor[6 << 20:(6 << 20) + PAGE], src[1])

    # a page of another size is a miss, never a short or overlong page
    before = b.stats()["size_mismatches"]
    assert b.batch_get("nsA", "kv", ["p0"], [7 << 20], PAGE // 2) == [False]
    assert b.batch_get("nsA", "kv", ["p0"], [7 << 20], PAGE * 2) == [False]
    assert b.stats()["size_mismatches"] == before + 2

    # the same key in another namespace is another page
    other = fill_random(arena, 5 << 20, PAGE, seed=7)
    assert b.batch_put("nsB", "kv", ["p0"], [5 << 20], PAGE) == [True]
    assert b.batch_get("nsB", "kv", ["p0"], [6 << 20], PAGE) == [True]
    assert torch.equal(arena.tensor[6 << 20:(6 << 20) + PAGE], other)
    assert b.batch_get("nsA", "kv", ["p0"], [6 << 20], PAGE) == [True]
    assert torch.equal(arena.tensor[6 << 20:(6 << 20) + PAGE], src[0])

    # clear removes our pages only: an object of another user of the master stays
    store = b._store
    assert store.batch_put_from(["someone-else/key"], [b._base], [PAGE]) == [0]
    assert b.clear() == 5
    assert b.exists("nsA", "kv", keys) == [False] * 4
    assert store.batch_is_exist(["someone-else/key"]) == [1]
    st = b.stats()
    assert st["connected"] and not st["degraded"] and st["errors"] == 0
    assert st["puts"] == 6  # the skipped put answers success too


def test_clear_namespace_removes_that_namespaces_objects_only(master, make_backend, make_arena):
    arena = make_arena()
    b = make_backend(master.address, arena)
    for i in range(4):
        fill_random(arena, i * PAGE, PAGE, seed=i)
    ns_a, ns_b = "0f" * 16, "a1" * 16  # namespace digests, as the daemon names them
    assert b.batch_put(ns_a, "kv", ["p0", "p1"], [0, PAGE], PAGE) == [True] * 2
    assert b.batch_put(ns_a, "mamba", ["p1"], [2 * PAGE], PAGE) == [True]
    assert b.batch_put(ns_b, "kv", ["p0", "p1"], [0, PAGE], PAGE) == [True] * 2
    store = b._store
    # an object of the format before trailers in A (removed too), one of another user, and
    # one whose key only starts like A's digest (kept: the digest is a whole key part)
    kept = [f"someone-else/c1/{ns_a}/kv/p0", f"hicached/c1/{ns_a}x/kv/p0"]
    old = f"hicached/{ns_a}/kv/p9"
    assert store.batch_put_from([old, *kept], [b._base] * 3, [PAGE] * 3) == [0] * 3
    assert b.clears_namespaces
    assert b.clear_namespace(ns_a) == 4
    assert b.exists(ns_a, "kv", ["p0", "p1"]) == [False] * 2
    assert b.exists(ns_a, "mamba", ["p1"]) == [False]
    assert b.exists(ns_b, "kv", ["p0", "p1"]) == [True] * 2
    assert store.batch_is_exist([old, *kept]) == [0, 1, 1]
    assert b.batch_get(ns_b, "kv", ["p1"], [5 << 20], PAGE) == [True]
    assert torch.equal(arena.tensor[5 << 20:(5 << 20) + PAGE], arena.tensor[PAGE:2 * PAGE])
    assert b.stats()["errors"] == 0


def test_killed_master_misses_within_deadline_then_recovers(master, make_backend, make_arena):
    arena = make_arena()
    b = make_backend(master.address, arena, timeout_s=1.0, exists_timeout_s=0.3)
    other = make_backend(master.address, global_segment_size=0)
    fill_random(arena, 0, PAGE, seed=1)
    assert b.batch_put("ns", "kv", ["a"], [0], PAGE) == [True]
    master.kill()
    # close is bounded (Mooncake's close would block ~16 s on a dead master) and idempotent
    _, dt = timed(other.close)
    assert dt < 2.0 + 1.0 and other.stats()["connected"] is False
    other.close()
    # each call answers within its deadline (+ slack for a busy VM), as a miss
    for _ in range(3):
        got, dt = timed(lambda: b.exists("ns", "kv", ["a"]))
        assert got == [False] and dt < 0.3 + 1.0
        got, dt = timed(lambda: b.batch_get("ns", "kv", ["a"], [PAGE], PAGE))
        assert got == [False] and dt < 1.0 + 1.0
        got, dt = timed(lambda: b.batch_put("ns", "kv", ["b"], [0], PAGE))
        assert got == [False] and dt < 1.0 + 1.0
    st = b.stats()
    assert st["degraded"] and st["degraded_episodes"] == 1 and st["failures"] >= 1
    assert st["fast_misses"] >= 1 and st["last_error"]
    # while degraded, misses are fast: no deadline paid per call
    got, dt = timed(lambda: b.exists("ns", "kv", ["a"]))
    assert got == [False] and dt < 0.25

    master.start()  # same port: the client reconnects and remounts its segment by itself

    def put_and_get():
        return (b.batch_put("ns", "kv", ["after"], [0], PAGE) == [True]
                and b.batch_get("ns", "kv", ["after"], [2 * PAGE], PAGE) == [True])

    assert wait_until(put_and_get, timeout_s=40)
    assert torch.equal(arena.tensor[2 * PAGE:3 * PAGE], arena.tensor[0:PAGE])
    st = b.stats()
    assert not st["degraded"] and st["degraded_episodes"] == 1 and st["setups"] == 1
    # the store came back (empty, here): the daemon is told once to count on nothing it knew
    assert b.take_evicted() is None and b.take_evicted() == []


def test_hung_master_exists_answers_within_deadline_transfer_is_never_abandoned(
        master, make_backend):
    b = make_backend(master.address, timeout_s=0.5, exists_timeout_s=0.3, backoff_s=0.1,
                     close_timeout_s=0.5)
    assert b.batch_put("ns", "kv", ["a"], [0], PAGE) == [True]
    master.pause()  # the master accepts nothing: Mooncake's own RPC timeout is 30 s
    result = {}
    started = time.monotonic()

    def get():
        result["got"] = b.batch_get("ns", "kv", ["a"], [PAGE], PAGE)
        result["took"] = time.monotonic() - started

    t = threading.Thread(target=get)
    try:
        t.start()  # as the daemon's I/O worker would
        time.sleep(0.1)
        got, dt = timed(lambda: b.exists("ns", "kv", ["zz"]))
        assert got == [False] and dt < 0.3 + 1.0  # the control loop never waits for the master
        time.sleep(0.2)  # past the backoff: the probe runs on a fresh helper thread
        got, dt = timed(lambda: b.exists("ns", "kv", ["zz"]))
        assert got == [False] and dt < 0.3 + 1.0  # not queued behind the stuck call
        st = b.stats()
        assert st["degraded"] and st["timeouts"] >= 1
        # the transfer is not abandoned at the deadline (0.5 s): its arena slot stays owned
        # until Mooncake returns (under load, Mooncake may give up on its own by now)
        assert t.is_alive() or result["took"] > 2 * 0.5, result
        with pytest.raises(BackendUnavailable):  # unreachable or timed out: HTTP 502, not 400
            b.clear()
    finally:
        master.pause(False)
    t.join(60)
    assert not t.is_alive() and len(result["got"]) == 1
    assert wait_until(lambda: b.exists("ns", "kv", ["a"]) == [True], timeout_s=20)
    assert not b.stats()["degraded"]


def test_master_started_after_the_backend(tmp_path, make_backend):
    m = Master(tmp_path / "late-master.log")
    try:
        b, dt = timed(lambda: make_backend(m.address, backoff_s=0.2, max_backoff_s=0.5))
        assert dt < 5  # open() does not wait for a master that is not there
        assert b.stats()["connected"] is False and b.stats()["degraded"]
        assert b.exists("ns", "kv", ["a"]) == [False]
        m.start()
        assert wait_until(lambda: b.stats()["connected"], timeout_s=20)
        assert b.batch_put("ns", "kv", ["a"], [0], PAGE) == [True]
        assert b.exists("ns", "kv", ["a"]) == [True]
        b.close()  # while the master runs: a client of a dead master is left for process exit
    finally:
        m.stop()


# ---------------------------------------------------------------- two daemons, one master


def test_two_daemons_share_pages_through_one_master(master, make_daemon):
    opts = {"master_server_address": master.address, "protocol": "tcp",
            "global_segment_size": "32MiB",
            "local_buffer_size": "4MiB", "local_hostname": "127.0.0.1"}
    extra = ["--l3-backend", "mooncake", "--l3-options", json.dumps(opts)]
    d1 = make_daemon(name="one", extra=extra)
    d2 = make_daemon(name="two", extra=extra)
    keys = [f"shared-{i}" for i in range(8)]
    src = kv_pool(seed=61)
    with d1.client() as c:
        c.register_mem_host_pool_v2(src, "kv")
        assert c.batch_set_v2([PoolTransfer("kv", pages(0, 8), keys=keys)]) == {"kv": [True] * 8}
        assert wait_until(lambda: c.stats()["l3_writes"] == 8)
        assert c.stats()["l3"]["puts"] == 8
    with d2.client() as c:
        dst = kv_pool()
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.stats()["l2_pages"] == 0
        assert c.batch_exists_v2(keys).kv_hit_pages == 8
        got = c.batch_get_v2([PoolTransfer("kv", pages(4, 8), keys=keys)])
        assert got == {"kv": [True] * 8}
        assert torch.equal(kv_tokens(dst, 4, 8), kv_tokens(src, 0, 8))
        st = c.stats()
        assert st["l3_loads"] == 8 and st["l3_backend"] == "mooncake"
        assert st["l3"]["gets"] == 8 and not st["l3"]["degraded"]
    with d2.client("another-model") as c:
        c.register_mem_host_pool_v2(kv_pool(), "kv")
        assert c.batch_exists(keys) == 0


def test_daemon_serves_l2_while_master_is_down_and_recovers(master, make_daemon):
    opts = {"master_server_address": master.address, "protocol": "tcp",
            "global_segment_size": "32MiB",
            "local_buffer_size": "4MiB", "local_hostname": "127.0.0.1", "timeout_s": 1.0,
            "exists_timeout_s": 0.3, "max_backoff_s": 1.0}
    d = make_daemon(extra=["--l3-backend", "mooncake", "--l3-options", json.dumps(opts)])
    keys = [f"k{i}" for i in range(4)]
    with d.client() as c:
        src, dst = kv_pool(seed=71), kv_pool()
        c.register_mem_host_pool_v2(src, "kv")
        assert c.batch_set_v1(keys, pages(0, 4)) == [True] * 4
        assert wait_until(lambda: c.stats()["l3_writes"] == 4)
        master.kill()
        # L2 keeps answering; L3 lookups cost at most their deadline, then nothing
        t = time.monotonic()
        assert c.batch_exists(keys + ["not-anywhere"]) == 4
        assert c.batch_get_v1(keys, pages(8, 4)) == [True] * 4
        assert torch.equal(kv_tokens(src, 8, 4), kv_tokens(src, 0, 4))
        assert c.batch_exists(["nowhere-1", "nowhere-2"]) == 0
        assert c.batch_set_v1(["late"], pages(12, 1)) == [True]
        assert time.monotonic() - t < 0.3 + 1.0 + 3.0
        assert wait_until(lambda: c.stats()["l3"]["degraded"])
        assert wait_until(lambda: c.stats()["l3_write_failures"] >= 1)

        master.start()  # same port, empty: new writes reach L3 again without a daemon restart
        fresh = itertools.count()

        def written_through():  # a fresh key each time: a key L2 holds is not set again
            c.batch_set_v1([f"m{next(fresh)}"], pages(16, 1))
            return c.stats()["l3_writes"] > 4

        assert wait_until(written_through, timeout_s=40)
        # the daemon no longer counts on what the old master had: pages L2 holds are written
        # again when set again (hot prefixes are shared again, not only new ones)
        written = c.stats()["l3_writes"]
        assert c.batch_set_v1(keys, pages(0, 4)) == [True] * 4  # present in L2
        assert wait_until(lambda: c.stats()["l3_writes"] >= written + 4)  # (+ others L2 held)
        c.flush("l2")
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.stats()["l3"]["degraded"] is False
        assert c.batch_get_v1(["late"], pages(0, 1)) == [False]  # lost with the old master
        assert c.batch_get_v1(keys, pages(4, 4)) == [True] * 4  # written to the new one
        assert torch.equal(kv_tokens(dst, 4, 4), kv_tokens(src, 0, 4))


def test_attach_detach_attach_at_runtime(master, make_daemon):
    """The backend can be attached, detached and attached again. A detached Mooncake client is
    not closed while the daemon serves (its close holds the GIL ~1 s, joining its heartbeat
    thread): it stays open, idle, and an attach with the same options takes it back (one
    ``setup`` in all, its pages still there); other options set up a second client."""
    opts = {"master_server_address": master.address, "protocol": "tcp",
            "global_segment_size": "32MiB",
            "local_buffer_size": "4MiB", "local_hostname": "127.0.0.1"}
    d = make_daemon(extra=["--l3-backend", "none"])
    with d.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=81), "kv")
        for round_ in range(2):
            c.attach_backend("mooncake", opts)
            assert c.stats()["l3"]["setups"] == 1  # the first round's client, both rounds
            keys = [f"r{round_}-{i}" for i in range(3)]
            assert c.batch_set_v1(keys, pages(0, 3)) == [True] * 3
            assert wait_until(lambda: c.stats()["l3"].get("puts") == 3 * (round_ + 1))
            c.flush("l2")
            assert c.batch_exists(keys) == 3
            c.detach_backend()
            assert c.stats()["l3_backend"] == "none"
            # parked once its I/O in flight (the exists' lookups) is collected
            assert wait_until(lambda: c.stats()["l3_tier"]["parked"] == ["mooncake"])
        c.attach_backend("mooncake", {**opts, "local_buffer_size": "8MiB"})
        st = c.stats()
        assert st["l3"]["setups"] == 1 and st["l3"]["puts"] == 0  # a new client
        assert st["l3_tier"]["parked"] == ["mooncake"]  # the other one, still idle
        assert c.batch_exists(["r0-0", "r1-2"]) == 2  # what the first one wrote is in the store
    assert d.stop() == 0
    assert "kept open, idle, until the daemon exits" in d.output()


def test_sglang_precedence_rdma_default_and_segment_minimum():
    """As in SGLang: the node's own MOONCAKE_LOCAL_HOSTNAME beats the shared config's, and the
    protocol is rdma unless said; a global segment under Mooncake's 16 MiB minimum is refused
    at once (Mooncake's setup would fail with -600 at every retry)."""
    o = MooncakeOptions.resolve({"master_server_address": "m:1", "local_hostname": "shared"},
                                {"MOONCAKE_LOCAL_HOSTNAME": "node-3"})
    assert (o.local_hostname, o.protocol) == ("node-3", "rdma")
    o = MooncakeOptions.resolve({"master_server_address": "m:1", "local_hostname": "shared"},
                                {"MOONCAKE_PROTOCOL": "tcp"})
    assert (o.local_hostname, o.protocol) == ("shared", "tcp")
    with pytest.raises(ConfigError, match="at least 16MiB"):
        MooncakeOptions.resolve({"master_server_address": "m:1", "global_segment_size": "2MiB"},
                                {})
    with pytest.raises(ConfigError, match="probe_timeout_s"):
        MooncakeOptions.resolve({"master_server_address": "m:1", "probe_timeout_s": 0}, {})


def test_a_port_that_is_no_master_never_freezes_the_process(make_backend):
    """A port that accepts connections but never answers Mooncake's RPC (a typo naming
    another service, a hung master): Mooncake's own setup would hold the GIL for minutes. The
    trial setup runs in a child process: open() returns after probe_timeout_s, degraded, and
    other threads ran all along."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    ticks, stop = [], threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.05)

    th = threading.Thread(target=ticker)
    th.start()
    try:
        t = time.monotonic()
        b = make_backend(f"127.0.0.1:{srv.getsockname()[1]}", probe_timeout_s=2.0)
        took = time.monotonic() - t
        st = b.stats()
        assert took < 2.0 + 8.0 and not st["connected"] and st["degraded"]
        assert "trial setup" in st["last_error"]
        assert b.exists("ns", "kv", ["a"]) == [False]
        with pytest.raises(BackendUnavailable, match="unavailable"):  # HTTP 502, not 400
            b.clear()  # a flush of L3 cannot say it cleared what it never reached
    finally:
        stop.set()
        th.join()
        srv.close()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert max(gaps) < 1.0, max(gaps)  # the GIL was never held for long
