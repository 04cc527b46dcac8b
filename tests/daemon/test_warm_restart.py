"""Warm restart (issue 49) with real daemons and real clients: a daemon adopts the arena its
predecessor of the same state dir left (``on_stop = "keep"`` and SIGTERM, or SIGKILL at chosen
points), its committed pages are L2 hits again with their exact bytes, nothing uncommitted is
served, slots an old client may still write are fenced, and /dev/shm holds only the current
arena, its presence table and its journal. (Crashes inside a commit or an eviction, at the
instant of a store: ``test_journal.py``.)"""

import os
import signal
import struct
import time

import pytest
import torch
from inproc_daemon import inproc_daemon

from hicached import Client, HostPool, PoolTransfer
from hicached import protocol as P
from hicached.arena import Arena
from hicached.errors import HicachedError

KEEP = ("--on-stop", "keep", "--l3-backend", "none")
FREE = ("--l3-backend", "none")
PAGE = 4  # tokens per KV page


def kv_pool(seed, num_pages=64, head_dim=16):
    """A KV pool of 8 KiB pages (head_dim 16; 16 KiB with 32): journaled (>= 4 KiB)."""
    pool = HostPool.allocate_mha(num_pages, PAGE, layers=4, heads=4, head_dim=head_dim,
                                 layout="page_first", dtype=torch.float32)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape,
                                     generator=torch.Generator().manual_seed(seed)))
    return pool


def state_pool(seed, num_slots=8):
    """A Mamba state pool of 5 KiB states."""
    pool = HostPool.allocate_mamba(num_slots, 2, (16, 32), [(16, 16)])
    g = torch.Generator().manual_seed(seed)
    for b in pool.buffers:
        b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
    return pool


def tokens(start, n):
    return torch.arange(start * PAGE, (start + n) * PAGE)


def shm_files(d):
    """The files of ``d``'s arena in /dev/shm."""
    base = os.path.basename(d.cfg.arena_path)
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(base))


def fill(d):
    """Two namespaces, three pools of three page sizes, a hybrid chain with a state; returns
    what was stored: (namespace, pool, keys, source pool, token indices or state slots)."""
    stored = []
    with d.client("model-a") as c:
        kv, st = kv_pool(1), state_pool(2)
        c.register_mem_host_pool_v2(kv, "kv")
        c.register_mem_host_pool_v2(st, "mamba")
        chain = [f"a{i}" for i in range(12)]
        assert all(c.batch_set_v2([PoolTransfer("kv", tokens(0, 12), keys=chain),
                                   PoolTransfer("mamba", [3], keys=["a11"],
                                                hit_policy="trailing_pages")],
                                  anchor_pool="kv", depth=0)["mamba"])
        more = [f"a{i}" for i in range(12, 20)]  # the chain goes on
        assert all(c.batch_set_v2([PoolTransfer("kv", tokens(12, 8), keys=more)],
                                  parent="a11", depth=12)["kv"])
        assert c.batch_exists(chain + more) == 20  # (through the daemon: the commits are in)
        stored += [("model-a", "kv", chain + more, kv, tokens(0, 20)),
                   ("model-a", "mamba", ["a11"], st, [3])]
    with d.client("model-b") as c:
        kv = kv_pool(3, head_dim=32)
        c.register_mem_host_pool_v2(kv, "kv")
        keys = [f"b{i}" for i in range(16)]
        assert all(c.batch_set_v2([PoolTransfer("kv", tokens(0, 16), keys=keys)])["kv"])
        assert c.batch_exists(keys) == 16
        stored.append(("model-b", "kv", keys, kv, tokens(0, 16)))
    return stored


def read_back(d, stored):
    """Every stored page read by a new client into a fresh pool: all hits, identical bytes."""
    for ns, pool, keys, src, where in stored:
        with Client(d.endpoint, ns) as c:
            if pool == "mamba":
                dst = state_pool(99)
                c.register_mem_host_pool_v2(kv_pool(98), "kv")
                c.register_mem_host_pool_v2(dst, "mamba")
                got = c.batch_get_v2([PoolTransfer("mamba", where, keys=keys)])["mamba"]
                assert got == [True] * len(keys)
                for a, b in zip(src.buffers, dst.buffers):
                    assert torch.equal(a[3], b[3])
                continue
            dst = kv_pool(97, head_dim=src.kv_buffer.shape[-1])
            c.register_mem_host_pool_v2(dst, pool)
            got = c.batch_get_v2([PoolTransfer(pool, where, keys=keys)])[pool]
            assert got == [True] * len(keys), (ns, pool)
            n = len(keys) * PAGE
            assert torch.equal(src.kv_buffer[:, :n], dst.kv_buffer[:, :n]), (ns, pool)


def stats(d):
    with Client(d.endpoint, "probe") as c:
        return c.stats()


def test_sigterm_with_on_stop_keep_brings_every_committed_page_back(make_daemon):
    d = make_daemon(extra=KEEP)
    stored = fill(d)
    pages = sum(len(keys) for _, _, keys, _, _ in stored)
    assert stats(d)["adoption"]["kept_on_stop"] is True
    assert d.stop(signal.SIGTERM) == 0
    assert shm_files(d) == [os.path.basename(d.cfg.arena_path),
                            os.path.basename(d.cfg.arena_path) + ".meta"]
    out = d.output()
    assert "arena kept for the next daemon" in out and "hicached arena free --state-dir" in out
    d2 = make_daemon(extra=FREE)  # same state dir; this one frees at its stop
    adoption = stats(d2)["adoption"]
    assert (adoption["pages"], adoption["dropped"], adoption["cold_reason"]) == (pages, {}, None)
    assert adoption["bytes"] == 20 * 8192 + 5120 + 16 * 16384
    assert "adopted the kept arena (clean stop): 37 pages" in d2.output()
    read_back(d2, stored)
    with d2.client("model-a") as c:  # the chain and its state: a hit of the whole prefix
        c.register_mem_host_pool_v2(kv_pool(5), "kv")
        c.register_mem_host_pool_v2(state_pool(6), "mamba")
        chain = [f"a{i}" for i in range(12)]
        res = c.batch_exists_v2(chain, [PoolTransfer("mamba", keys=chain[-1:],
                                                     hit_policy="trailing_pages")])
        assert res.kv_hit_pages == 12
    assert d2.stop() == 0
    assert shm_files(d2) == []  # on_stop = "free": today's behaviour


def test_on_stop_free_is_todays_behaviour_and_the_next_start_is_cold(make_daemon):
    d = make_daemon(extra=FREE)
    fill(d)
    assert d.stop() == 0 and shm_files(d) == []
    d2 = make_daemon(extra=FREE)
    assert stats(d2)["adoption"] == {"pages": 0, "bytes": 0, "dropped": {}, "seconds": 0.0,
                                     "cold_reason": "no arena kept", "kept_on_stop": False,
                                         "held_pages": 0, "held_s": 0.0}
    assert "starting cold: no arena kept" in d2.output()


def test_a_geometry_change_or_cold_starts_cold_and_says_why(make_daemon):
    d = make_daemon(extra=KEEP)
    fill(d)
    d.stop()
    d2 = make_daemon(extra=(*KEEP, "--cold"))
    reason = stats(d2)["adoption"]["cold_reason"]
    assert reason.startswith("cold = true (--cold): the kept arena")
    assert stats(d2)["l2_pages"] == 0
    d2.stop()  # kept again (empty)
    d3 = make_daemon(extra=KEEP, l2_size="32MiB")
    assert stats(d3)["adoption"]["cold_reason"] == (
        f"l2_size changed: the kept arena has {16 << 20} bytes, this daemon asks for {32 << 20}")
    d3.stop()
    d4 = make_daemon(extra=FREE, l2_size="32MiB", slab_size="2MiB")
    assert stats(d4)["adoption"]["cold_reason"].startswith(
        "slab_size changed: the kept arena has slabs of 1048576 bytes")
    assert "starting cold: slab_size changed" in d4.output()


def test_sigkill_while_idle_brings_back_what_was_committed_and_an_old_client_reads_it(
        make_daemon):
    d = make_daemon(extra=FREE)  # a crash leaves the arena whatever on_stop says
    stored = fill(d)
    old = d.client("model-b")
    src = stored[-1][3]
    old.register_mem_host_pool_v2(dst := kv_pool(50, head_dim=32), "kv")
    d.stop(signal.SIGKILL)
    assert len(shm_files(d)) == 3  # arena, presence, meta: left by the crash
    d2 = make_daemon(extra=FREE)
    adoption = stats(d2)["adoption"]
    assert adoption["pages"] == 37 and adoption["cold_reason"] is None
    base = os.path.basename(d.cfg.arena_path)  # only the current arena's files
    assert shm_files(d2) == [base, base + ".meta", base + ".presence"]
    assert "adopted the kept arena (after a crash): 37 pages" in d2.output()
    read_back(d2, stored)
    # a client that lived through the kill joins the new daemon and reads the right bytes
    keys = [f"b{i}" for i in range(16)]
    got = old.batch_get_v2([PoolTransfer("kv", tokens(0, 16), keys=keys)])["kv"]
    n = 16 * PAGE
    assert all(got) and torch.equal(src.kv_buffer[:, :n], dst.kv_buffer[:, :n])
    old.close()
    assert d2.stop() == 0 and shm_files(d2) == []


def test_a_flush_that_was_answered_is_never_undone_by_a_crash(make_daemon):
    d = make_daemon(extra=KEEP)
    stored = fill(d)
    with d.client("model-b") as c:
        c.flush("l2", namespace="model-b")
    d.stop(signal.SIGKILL)
    d2 = make_daemon(extra=FREE)
    assert stats(d2)["adoption"]["pages"] == 21  # model-a's only
    read_back(d2, stored[:2])
    with d2.client("model-b") as c:
        c.register_mem_host_pool_v2(kv_pool(1, head_dim=32), "kv")
        assert c.batch_exists([f"b{i}" for i in range(16)]) == 0


def test_slots_reserved_and_not_committed_when_killed_are_dropped_and_fenced(
        make_daemon, tmp_path):
    d = make_daemon(extra=FREE)
    stored = fill(d)
    c = d.client("model-a")
    c.register_mem_host_pool_v2(kv_pool(7), "kv")
    res = c._conn.call(lambda s, r: P.Reserve(r, s, [P.PoolKeys("kv", ["r0", "r1", "r2"])]))
    reserved = [off for off in res.offsets[0]]
    assert all(off >= 0 for off in reserved)
    d.stop(signal.SIGKILL)
    # the old client goes on copying into its reserved slots after its daemon died
    arena = Arena.attach(d.cfg.arena_path, 16 << 20)
    for off in reserved:
        arena.view(off, 8192)[:] = b"\xee" * 8192
    cfg = d.cfg
    with inproc_daemon(tmp_path, state_dir=cfg.state_dir, l3_backend="none") as d2:
        daemon = d2.daemon
        assert daemon.adopted.pages == 37 and daemon.adopted.fenced_slots > 0

        def look():
            fenced = {e.slot_offset for f in daemon.leases.fences.values() for e in f.entries}
            classes = {}
            for slab in daemon.allocator.slabs:
                if slab.stride:
                    n = classes.setdefault(slab.stride, [0, 0])
                    n[0] += slab.num_slots
                    n[1] += len(slab.free)
            used = {}
            for e in daemon.index.entries():
                used[e.stride] = used.get(e.stride, 0) + 1
            return fenced, classes, used

        fenced, classes, used = daemon.call(look)
        assert set(reserved) <= fenced
        for stride, (slots, free) in classes.items():  # free + used + fenced = slots
            assert free + used.get(stride, 0) + sum(
                1 for f in daemon.leases.fences.values() for e in f.entries
                if e.stride == stride) == slots, stride
        with Client(d2.endpoint, "model-a") as c2:
            c2.register_mem_host_pool_v2(kv_pool(8), "kv")
            assert c2.batch_exists(["r0", "r1", "r2"]) == 0  # never served
        read_back(d2, stored)
    arena.close()
    c.close()


def test_write_back_pages_not_yet_written_are_dirty_again_after_a_crash(make_daemon):
    """Write-back pages that were dirty when the daemon was killed are written by the daemon
    that adopts them (here: at its drain), not forgotten: a cold daemon reads them from L3."""
    wb = ("--l3-backend", "file", "--write-policy", "write_back")
    d = make_daemon(extra=wb)
    kv = kv_pool(11)
    keys = [f"w{i}" for i in range(8)]
    with d.client("model-a") as c:
        c.register_mem_host_pool_v2(kv, "kv")
        assert all(c.batch_set_v2([PoolTransfer("kv", tokens(0, 8), keys=keys)])["kv"])
        c.wait_committed()
    assert stats(d)["l3_tier"]["dirty_pages"] == 8  # (nothing written yet)
    d.stop(signal.SIGKILL)
    d2 = make_daemon(extra=wb)
    assert stats(d2)["adoption"]["pages"] == 8
    assert stats(d2)["l3_tier"]["dirty_pages"] == 8
    assert d2.stop() == 0  # the drain writes dirty pages
    d3 = make_daemon(extra=wb)  # (d2 freed the arena: a cold start, L3 only)
    with d3.client("model-a") as c:
        dst = kv_pool(12)
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v2([PoolTransfer("kv", tokens(0, 8), keys=keys)])["kv"] == [True] * 8
        assert torch.equal(kv.kv_buffer[:, :32], dst.kv_buffer[:, :32])
    assert stats(d3)["adoption"]["cold_reason"] == "no arena kept"


def crash_at(point):
    return {"HICACHED_TEST_CRASH_AT": point}


def wait_killed(d, timeout_s=30.0):
    """The daemon killed itself at its crash point (SIGKILL)."""
    assert d.proc.wait(timeout_s) == -signal.SIGKILL, d.output()


def test_sigkill_mid_commit_serves_nothing_of_that_commit_and_keeps_the_ones_before(
        make_daemon):
    d = make_daemon(extra=FREE, env=crash_at("commit:3"))  # the third commit call
    kv = kv_pool(21)
    calls = [[f"m{c}-{i}" for i in range(16)] for c in range(3)]
    with d.client("model-a") as c:
        c.register_mem_host_pool_v2(kv, "kv")
        for n, keys in enumerate(calls):
            c.batch_set_v2([PoolTransfer("kv", tokens(16 * n, 16), keys=keys)])
        wait_killed(d)  # its records written, their checks not: never valid
    d2 = make_daemon(extra=FREE)
    adoption = stats(d2)["adoption"]
    assert (adoption["pages"], adoption["dropped"]) == (32, {})
    read_back(d2, [("model-a", "kv", calls[0] + calls[1], kv, tokens(0, 32))])
    with d2.client("model-a") as c:
        c.register_mem_host_pool_v2(kv_pool(22), "kv")
        assert c.batch_exists(calls[2]) == 0
        assert c.batch_get_v2([PoolTransfer("kv", tokens(0, 16), keys=calls[2])])["kv"] == [
            False] * 16
    assert stats(d2)["fenced_bytes"] >= 16 * 8192  # its slots: an old client may still copy


def test_sigkill_mid_flush_keeps_the_pages_the_walk_had_not_reached(make_daemon):
    d = make_daemon(extra=FREE, env=crash_at("free:10"))  # the flush's tenth page
    stored = fill(d)
    with d.client("model-b") as c:
        with pytest.raises(HicachedError):  # never answered
            c.flush("l2", timeout_s=5.0)
    wait_killed(d)
    d2 = make_daemon(extra=FREE)
    held = stats(d2)["adoption"]["pages"]
    assert held == 37 - 10  # nine freed, the tenth's record cleared before its free
    hits = 0
    for ns, pool, keys, src, where in stored:  # what is held is exact; the rest is a miss
        with Client(d2.endpoint, ns) as c:
            dst = state_pool(31) if pool == "mamba" else kv_pool(
                32, head_dim=src.kv_buffer.shape[-1])
            if pool == "mamba":
                c.register_mem_host_pool_v2(kv_pool(33), "kv")
            c.register_mem_host_pool_v2(dst, pool)
            got = c.batch_get_v2([PoolTransfer(pool, where, keys=keys)])[pool]
            for i, ok in enumerate(got):
                if not ok:
                    continue
                hits += 1
                if pool == "mamba":
                    assert all(torch.equal(a[3], b[3]) for a, b in zip(src.buffers, dst.buffers))
                else:
                    t = slice(i * PAGE, (i + 1) * PAGE)
                    assert torch.equal(src.kv_buffer[:, t], dst.kv_buffer[:, t]), (ns, i)
    assert hits == held


def test_sigkill_mid_eviction_leaks_no_slot_and_serves_exact_bytes(make_daemon, tmp_path):
    # 16 MiB of 8 KiB pages (2048 slots): the third call of 1024 evicts; killed at its 5th free
    d = make_daemon(extra=FREE, env=crash_at("free:5"))
    kv = kv_pool(41, num_pages=1024)
    calls = [[f"e{c}-{i}" for i in range(1024)] for c in range(3)]
    with d.client("model-a") as c:
        c.register_mem_host_pool_v2(kv, "kv")
        for keys in calls:
            try:
                c.batch_set_v2([PoolTransfer("kv", tokens(0, 1024), keys=keys)])
            except HicachedError:
                break
    wait_killed(d)
    with inproc_daemon(tmp_path, state_dir=d.cfg.state_dir, l3_backend="none") as d2:
        daemon = d2.daemon
        held = daemon.adopted.pages
        assert 0 < held < 2048

        def classes():
            fenced = {}
            for f in daemon.leases.fences.values():
                for e in f.entries:
                    fenced[e.stride] = fenced.get(e.stride, 0) + 1
            used = {}
            for e in daemon.index.entries():
                used[e.stride] = used.get(e.stride, 0) + 1
            out = {}
            for slab in daemon.allocator.slabs:
                if slab.stride:
                    n = out.setdefault(slab.stride, [0, 0])
                    n[0] += slab.num_slots
                    n[1] += len(slab.free)
            return {s: (slots, free + used.get(s, 0) + fenced.get(s, 0))
                    for s, (slots, free) in out.items()}

        for stride, (slots, accounted) in daemon.call(classes).items():
            assert slots == accounted, stride  # free + used + fenced = slots
        with Client(d2.endpoint, "model-a") as c:
            dst = kv_pool(42, num_pages=1024)
            c.register_mem_host_pool_v2(dst, "kv")
            hits = 0
            for keys in calls[:2]:
                got = c.batch_get_v2([PoolTransfer("kv", tokens(0, 1024), keys=keys)])["kv"]
                for i, ok in enumerate(got):
                    if ok:
                        hits += 1
                        t = slice(i * PAGE, (i + 1) * PAGE)
                        assert torch.equal(kv.kv_buffer[:, t], dst.kv_buffer[:, t])
            assert hits == held


def test_on_stop_and_cold_are_checked_keys(tmp_path):
    from hicached.daemon.config import load_config
    from hicached.errors import ConfigError

    with pytest.raises(ConfigError, match="on_stop: unknown 'later'; valid: \\['free', 'keep'\\]"):
        load_config(None, {}, {"on_stop": "later", "state_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="cold: expected bool, got 'maybe'"):
        load_config(None, {"HICACHED_COLD": "maybe"}, {"state_dir": str(tmp_path)})
    cfg = load_config(None, {"HICACHED_ON_STOP": "keep", "HICACHED_COLD": "1"},
                      {"state_dir": str(tmp_path)})
    assert (cfg.on_stop, cfg.cold) == ("keep", True)


def test_adopted_slots_an_old_client_may_still_read_are_not_reused_before_half_a_lease_ttl(
        make_daemon, tmp_path):
    """A client of the dead daemon may copy from slots it was leased for half a lease TTL: the
    adopted pages stay pinned that long (``adoption.py`` step 5), so a writer that needs room
    right after the restart is never handed one of their slots; after it, they are evicted."""
    d = make_daemon(extra=FREE)
    kv = kv_pool(61, num_pages=1024)
    full = [[f"f{c}-{i}" for i in range(1024)] for c in range(2)]  # 2048 slots of 8 KiB
    with d.client("model-a") as c:
        c.register_mem_host_pool_v2(kv, "kv")
        for keys in full:
            assert all(c.batch_set_v2([PoolTransfer("kv", tokens(0, 1024), keys=keys)])["kv"])
    d.stop(signal.SIGKILL)
    with inproc_daemon(tmp_path, state_dir=d.cfg.state_dir, l3_backend="none",
                       lease_ttl_s=10.0) as d2:
        daemon = d2.daemon

        def look():
            offsets = {e.key: e.slot_offset for e in daemon.index.entries()}
            classes = {}
            for slab in daemon.allocator.slabs:
                if slab.stride:
                    n = classes.setdefault(slab.stride, [0, 0])
                    n[0] += slab.num_slots
                    n[1] += len(slab.free)
            used = {}
            for e in daemon.index.entries():
                used[e.stride] = used.get(e.stride, 0) + 1
            fenced = {}
            for f in daemon.leases.fences.values():
                for e in f.entries:
                    fenced[e.stride] = fenced.get(e.stride, 0) + 1
            for a in daemon.leases.ahead.values():  # a client's set-ahead slots: handed out
                for slots in a.pools.values():
                    for e in slots.values():
                        used[e.stride] = used.get(e.stride, 0) + 1
            for stride, (slots, free) in classes.items():  # free + used + fenced = slots
                assert free + used.get(stride, 0) + fenced.get(stride, 0) == slots, (
                    stride, slots, free, used, fenced, len(daemon.index),
                    len(daemon.leases.reservations), daemon.leases.ahead_bytes)
            return offsets

        adopted = daemon.call(look)
        held = daemon.adopted.pages
        assert len(adopted) == held >= 1024  # (evicting ahead may have made a little room)
        st = stats(d2)
        assert st["adoption"]["held_pages"] == held and 0 < st["adoption"]["held_s"] <= 5.0
        assert st["leases"] == 1
        src = kv_pool(62, num_pages=1024)
        with Client(d2.endpoint, "model-a") as c:
            c.register_mem_host_pool_v2(src, "kv")
            stored = 0
            for n in range(2):  # 2048 new pages: more than the room beside the adopted ones
                got = c.batch_set_v2([PoolTransfer("kv", tokens(0, 1024),
                                                   keys=[f"n{n}-{i}" for i in range(1024)])])
                stored += sum(got["kv"])
            c.batch_exists(["n1-0"])  # (through the daemon: the last commit is in)
            now = daemon.call(look)
            assert stats(d2)["leases"] == 1  # still inside the window: no adopted slot reused
            assert stored < 2048  # the pressure reached the adopted pages, which stay
            assert {k: now[k] for k in adopted} == adopted  # every adopted page, its slot
            assert not {v for k, v in now.items() if k not in adopted} & set(adopted.values())
            deadline = time.monotonic() + 30
            while stats(d2)["leases"]:  # the window ends (the sweep releases the hold)
                assert time.monotonic() < deadline, "adopted pages still pinned after 30 s"
                time.sleep(0.05)
            for n in range(2):
                keys = [f"m{n}-{i}" for i in range(1024)]
                got = c.batch_set_v2([PoolTransfer("kv", tokens(0, 1024), keys=keys)])["kv"]
                assert all(got)
            assert c.batch_exists(keys) == 1024  # (through the daemon: the commits are in)
            now = daemon.call(look)
            assert not set(adopted) & set(now)  # all evicted: the oldest pages
            assert set(now[k] for k in keys) & set(adopted.values())  # their slots reused
            dst = kv_pool(63, num_pages=1024)
            c.register_mem_host_pool_v2(dst, "kv")
            assert all(c.batch_get_v2([PoolTransfer("kv", tokens(0, 1024), keys=keys)])["kv"])
            assert torch.equal(src.kv_buffer, dst.kv_buffer)


def corrupt_tables_used(meta):
    """A header whose magic, layout and geometry are right but whose table count is nonsense."""
    with open(meta, "r+b") as f:
        f.seek(8 * 8)  # H_TABLES
        f.write(struct.pack("<Q", 1 << 40))


def corrupt_table_name(meta):
    """A table of names that does not parse (not UTF-8), its length in range."""
    with open(meta, "r+b") as f:
        f.seek(4096 + 8)  # the first table's ns
        f.write(b"\xff\xfe\xfd")


@pytest.mark.parametrize("corrupt", [corrupt_tables_used, corrupt_table_name])
def test_a_journal_that_does_not_parse_starts_cold_and_serves(make_daemon, corrupt):
    """Adoption never stops the daemon from starting: the kept arena is discarded, the start
    goes on cold and says why, and /dev/shm holds only the new arena's files."""
    d = make_daemon(extra=FREE)
    fill(d)
    arena = d.cfg.arena_path
    old_inode = os.stat(arena).st_ino
    d.stop(signal.SIGKILL)
    corrupt(arena + ".meta")
    d2 = make_daemon(extra=FREE)
    adoption = stats(d2)["adoption"]
    assert adoption["pages"] == 0
    assert adoption["cold_reason"].startswith("adoption failed (")
    assert adoption["cold_reason"].endswith("the kept arena is discarded")
    assert "starting cold: adoption failed" in d2.output()
    assert os.stat(arena).st_ino != old_inode  # a new file: old clients re-map
    base = os.path.basename(arena)
    assert shm_files(d2) == [base, base + ".meta", base + ".presence"]
    stored = fill(d2)  # it serves
    read_back(d2, stored)
    assert d2.stop() == 0 and shm_files(d2) == []


def test_adoption_failing_part_way_starts_cold(make_daemon, tmp_path, monkeypatch):
    """A bug in adoption after the index was half rebuilt (injected: the real adoption runs,
    then raises): the half-built index and the kept arena are dropped, the start goes on cold."""
    from hicached.daemon import server

    d = make_daemon(extra=FREE)
    fill(d)
    arena = d.cfg.arena_path
    old_inode = os.stat(arena).st_ino
    d.stop(signal.SIGKILL)
    real = server.adopt

    def adopt_then_fail(*args, **kwargs):
        out, entries = real(*args, **kwargs)
        assert out.pages == 37  # the index was rebuilt before the failure
        raise RuntimeError("injected: a bug after 37 pages")

    monkeypatch.setattr(server, "adopt", adopt_then_fail)
    with inproc_daemon(tmp_path, state_dir=d.cfg.state_dir, l3_backend="none") as d2:
        adoption = stats(d2)["adoption"]
        assert adoption["pages"] == 0 and adoption["cold_reason"] == (
            "adoption failed (RuntimeError('injected: a bug after 37 pages')): the kept arena "
            "is discarded")
        assert os.stat(arena).st_ino != old_inode
        base = os.path.basename(arena)
        assert shm_files(d) == [base, base + ".meta", base + ".presence"]  # (same state dir)
        assert stats(d2)["l2_pages"] == 0 and stats(d2)["leases"] == 0
        d2.client = lambda ns: Client(d2.endpoint, ns)  # (as ``make_daemon``'s, no token)
        stored = fill(d2)
        read_back(d2, stored)


def test_the_read_window_of_old_clients_after_a_clean_stop_and_a_crash():
    """Half a lease TTL from the clean stop's recorded time; from now after a crash (its
    instant is not known); never negative, never longer than half a TTL."""
    from hicached.daemon.adoption import read_window

    now = 1_000_000.0
    assert read_window(True, now - 20.0, 15.0, now) == 0.0  # stopped long ago: nothing held
    assert read_window(True, now - 5.0, 15.0, now) == 10.0
    assert read_window(True, now + 60.0, 15.0, now) == 15.0  # a clock stepped back: capped
    assert read_window(False, 0.0, 15.0, now) == 15.0
