"""The L3 tier policies on real daemons: prefetch, bounded get waits, write policies, and runtime
attach / detach while clients run."""

import json
import threading
import time

import pytest
import torch
from conftest import wait_until
from pools import kv_pool, kv_tokens, mamba_pool, pages

from hicached import HostPool, PoolTransfer
from hicached.errors import BackendConflict, BackendError, ConfigError, ProtocolError

SLOW = "l3_doubles:SlowFileBackend"


def _set_kv(c, keys, pool, start=0):
    c.register_mem_host_pool_v2(pool, "kv")
    assert c.batch_set_v1(keys, pages(start, len(keys))) == [True] * len(keys)


def _l3_backend(tmp_path, backend=SLOW, **options):
    return ["--l3-backend", backend, "--l3-options",
            json.dumps({"root": str(tmp_path / "l3"), **options})]


# ---------------------------------------------------------------- prefetch


def test_exists_prefetches_l3_pages_and_get_uses_them(daemon):
    keys = [f"p{i}" for i in range(8)]
    src, dst = kv_pool(seed=51), kv_pool()
    with daemon.client() as c:
        _set_kv(c, keys, src)
        assert wait_until(lambda: c.stats()["l3_writes"] == 8)
        c.flush("l2")
        assert c.batch_exists(keys) == 8
        # nobody asked for the bytes yet: the pages come into L2 on their own
        assert wait_until(lambda: c.stats()["l2_pages"] == 8)
        st = c.stats()
        assert st["prefetched_pages"] == 8 and st["l3_loads"] == 8
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v1(keys, pages(10, 8)) == [True] * 8
        assert torch.equal(kv_tokens(dst, 10, 8), kv_tokens(src, 0, 8))
        assert c.stats()["l3_loads"] == 8  # served from the prefetched pages, no second load


def test_prefetch_pulls_only_the_states_the_prefix_needs(daemon):
    keys = [f"m{i}" for i in range(8)]
    with daemon.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=52), "kv")
        c.register_mem_host_pool_v2(mamba_pool(seed=53), "mamba")
        c.batch_set_v2([PoolTransfer("kv", pages(0, 8), keys=keys),
                        PoolTransfer("mamba", torch.tensor([1, 2]), keys=[keys[3], keys[7]])])
        assert wait_until(lambda: c.stats()["l3_writes"] == 10)
        c.flush("l2")
        res = c.batch_exists_v2(keys, [PoolTransfer("mamba", keys=keys[:1],  # window 1
                                                    hit_policy="trailing_pages")])
        assert res.kv_hit_pages == 8 and res.restorable_prefix_pages == [4, 8]
        assert wait_until(lambda: c.stats()["l2_pages"] == 9)
        # the state at page 7 restores the prefix; the one at page 3 is not pulled
        assert c.stats()["l2_pages_by_pool"] == {"kv": 8, "mamba": 1}


def test_no_prefetch_option(make_daemon):
    d = make_daemon(extra=["--no-prefetch"])
    keys = [f"n{i}" for i in range(4)]
    with d.client() as c:
        _set_kv(c, keys, kv_pool(seed=54))
        assert wait_until(lambda: c.stats()["l3_writes"] == 4)
        c.flush("l2")
        assert c.batch_exists(keys) == 4
        time.sleep(0.3)
        st = c.stats()
        assert st["l2_pages"] == 0 and st["prefetched_pages"] == 0
        assert c.batch_get_v1(keys, pages(0, 4)) == [True] * 4  # a get still loads


# ---------------------------------------------------------------- bounded waits


def test_get_waits_for_slow_l3_at_most_get_wait_s(make_daemon, tmp_path):
    d = make_daemon(extra=[*_l3_backend(tmp_path, get_delay_s=3.0), "--get-wait-s", "0.5",
                           "--no-prefetch"])
    keys = [f"s{i}" for i in range(4)]
    src, dst = kv_pool(seed=55), kv_pool()
    with d.client() as c:
        _set_kv(c, keys, src)
        assert wait_until(lambda: c.stats()["l3_writes"] == 4)
        c.flush("l2")
        c.register_mem_host_pool_v2(dst, "kv")
        t0 = time.monotonic()
        assert c.batch_get_v1(keys, pages(8, 4)) == [False] * 4
        assert time.monotonic() - t0 < 2.5  # the load takes 3 s; the get gave up at 0.5 s
        assert c.stats()["get_wait_timeouts"] == 1
        # the load finishes in the background and the pages are hits afterwards
        assert wait_until(lambda: c.stats()["l2_pages"] == 4, timeout_s=10)
        assert c.batch_get_v1(keys, pages(8, 4)) == [True] * 4
        assert torch.equal(kv_tokens(dst, 8, 4), kv_tokens(src, 0, 4))


def _timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def test_a_slow_l3_lookup_never_holds_up_other_clients(make_daemon, tmp_path):
    # every store lookup takes 1 s; it runs on the prober thread while the control loop serves
    d = make_daemon(extra=[*_l3_backend(tmp_path, exists_delay_s=1.0), "--get-wait-s", "5"])
    keys = [f"q{i}" for i in range(4)]
    with d.client() as a, d.client() as b:
        _set_kv(b, keys, kv_pool(seed=56))
        a.register_mem_host_pool_v2(kv_pool(), "kv")
        assert wait_until(lambda: b.stats()["l3_writes"] == 4, timeout_s=15)
        box = {}
        t = threading.Thread(target=lambda: box.update(r=_timed(
            lambda: a.batch_exists([*keys, "unknown0", "unknown1"]))))
        t.start()
        assert wait_until(lambda: b.stats()["parked_exists"] == 1, timeout_s=5)
        # meanwhile: an exists of pages in L2, a get and a ping answer at once
        assert _timed(lambda: b.batch_exists(keys))[1] < 0.5
        assert _timed(lambda: b.batch_get_v1(keys, pages(0, 4)))[0] == [True] * 4
        assert _timed(b.ping)[1] < 0.5
        t.join(10)
        hits, took = box["r"]
        assert hits == 4 and took >= 0.9
        assert b.stats()["parked_exists"] == 0


def test_exists_waits_at_most_get_wait_s_for_a_lookup(make_daemon, tmp_path):
    d = make_daemon(extra=[*_l3_backend(tmp_path, exists_delay_s=3.0), "--get-wait-s", "0.5"])
    keys = [f"w{i}" for i in range(3)]
    with d.client() as c:
        _set_kv(c, keys, kv_pool(seed=57))
        hits, took = _timed(lambda: c.batch_exists([*keys, "elsewhere"]))
        assert hits == 3 and took < 2.5  # L2 answered; the store's lookup was not waited for
        assert c.stats()["exists_wait_timeouts"] == 1


def test_pages_another_daemon_stored_are_found_off_the_loop(make_daemon, tmp_path):
    """A restarted daemon does not know which pages L3 holds: its exists and gets ask the
    store on the prober thread, and serve the right bytes."""
    l3 = _l3_backend(tmp_path, exists_delay_s=0.3)
    d = make_daemon(extra=[*l3, "--no-prefetch"])
    keys = [f"r{i}" for i in range(6)]
    src, dst = kv_pool(seed=58), kv_pool()
    with d.client() as c:
        _set_kv(c, keys, src)
        assert wait_until(lambda: c.stats()["l3_writes"] == 6, timeout_s=15)
    d.stop()
    d.start()
    with d.client() as c:
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_exists([*keys, "nope"]) == 6
        # the get loads what the exists found without asking the store again
        assert c.batch_get_v1(keys[:3], pages(0, 3)) == [True] * 3
        assert torch.equal(kv_tokens(dst, 0, 3), kv_tokens(src, 0, 3))
    d.stop()
    d.start()
    with d.client() as c:
        c.register_mem_host_pool_v2(dst, "kv")
        got, took = _timed(lambda: c.batch_get_v1([keys[5], "nope"], pages(10, 2)))
        assert got == [True, False] and took >= 0.25  # the lookup, then the load
        assert torch.equal(kv_tokens(dst, 10, 1), kv_tokens(src, 5, 1))
        st = c.stats()
        assert st["l3_loads"] == 1 and st["misses"] == 1


def test_large_l3_get_streams_chunks_while_the_rest_loads(make_daemon, tmp_path):
    # 40 pages of 512 KiB load as 3 jobs of <= 8 MiB; the client copies the first while the
    # others load (each job takes >= 0.2 s here), then asks again for the rest
    d = make_daemon(l2_size="32MiB", extra=[*_l3_backend(tmp_path, get_delay_s=0.2),
                                            "--no-prefetch", "--l3-load-chunk", "8MiB"])
    src, dst = big_pool(40, seed=61), big_pool(40, seed=0)
    keys = [f"c{i}" for i in range(40)]
    with d.client() as c:
        c.register_mem_host_pool_v2(src, "kv")
        assert c.batch_set_v1(keys, big_pages(0, 40)) == [True] * 40
        assert wait_until(lambda: c.stats()["l3_writes"] == 40)
        c.flush("l2")
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v1(keys, big_pages(0, 40)) == [True] * 40
        assert torch.equal(dst.kv_buffer, src.kv_buffer)
        st = c.stats()
        assert st["l3_loads"] == 40 and st["partial_answers"] >= 1
        assert st["hits"] == 40 and st["misses"] == 0


# ---------------------------------------------------------------- write policies


def test_write_through_selective_writes_after_threshold_hits(make_daemon):
    d = make_daemon(extra=["--write-policy", "write_through_selective",
                           "--write-through-threshold", "2"])
    keys = [f"h{i}" for i in range(4)]
    with d.client() as c:
        _set_kv(c, keys, kv_pool(seed=56))
        assert c.batch_get_v1(keys[:2], pages(10, 2)) == [True] * 2
        time.sleep(0.3)
        assert c.stats()["l3_writes"] == 0  # one hit each: not yet
        assert c.batch_get_v1(keys[:2], pages(10, 2)) == [True] * 2
        assert wait_until(lambda: c.stats()["l3_writes"] == 2)
        assert c.batch_get_v1(keys[:2], pages(10, 2)) == [True] * 2
        time.sleep(0.3)
        assert c.stats()["l3_writes"] == 2  # written once, never again


def big_pool(num_pages, seed):
    """512 KiB pages: a 4 MiB arena of 1 MiB slabs holds 8 of them."""
    pool = HostPool.allocate_mha(num_pages, 64, layers=4, heads=4, head_dim=64,
                                 layout="page_first", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g))
    return pool


def big_pages(start, n):
    return torch.arange(start * 64, (start + n) * 64)


def test_write_back_writes_only_when_l2_needs_room(make_daemon):
    d = make_daemon(l2_size="4MiB", extra=["--write-policy", "write_back"])
    src, dst = big_pool(24, seed=57), big_pool(24, seed=0)
    keys = [f"b{i}" for i in range(24)]
    stored = []
    with d.client() as c:
        c.register_mem_host_pool_v2(src, "kv")
        assert c.batch_set_v1(keys[:4], big_pages(0, 4)) == [True] * 4
        time.sleep(0.3)
        assert c.stats()["l3_writes"] == 0  # room left: nothing written yet
        stored += keys[:4]
        for i in range(4, 24, 2):
            # dirty pages cannot be evicted until written: a set may find no room for a moment
            for _ in range(100):
                if c.batch_set_v1(keys[i:i + 2], big_pages(i, 2)) == [True, True]:
                    break
                time.sleep(0.05)
            else:
                pytest.fail(f"pages {i}, {i + 1} never found room")
            stored += keys[i:i + 2]
        st = c.stats()
        assert st["write_backs"] > 0 and st["evictions"] > 0
        assert st["l3_writes"] < 24  # the pages still in L2 were never written
        c.flush("l2")  # write_back: dirty pages are written first, then dropped
        assert wait_until(lambda: c.stats()["l2_pages"] == 0)
        assert c.stats()["l3_writes"] == 24
        c.register_mem_host_pool_v2(dst, "kv")
        for i in range(0, 24, 4):  # 4 at a time: what fits in the arena
            assert c.batch_get_v1(keys[i:i + 4], big_pages(i, 4)) == [True] * 4
        assert torch.equal(dst.kv_buffer, src.kv_buffer)


def test_failing_l3_under_write_back_never_pins_the_arena(make_daemon, tmp_path):
    d = make_daemon(l2_size="4MiB", extra=[*_l3_backend(tmp_path, fail_puts=True),
                                           "--write-policy", "write_back"])
    src = big_pool(24, seed=58)
    with d.client() as c:
        c.register_mem_host_pool_v2(src, "kv")
        ok = 0
        for i in range(0, 24, 2):
            for _ in range(100):
                got = c.batch_set_v1([f"f{i}", f"f{i + 1}"], big_pages(i, 2))
                if all(got):
                    ok += 2
                    break
                time.sleep(0.05)
        assert ok == 24  # failed writes made the pages evictable again
        st = c.stats()
        assert st["l3_write_failures"] > 0 and st["l3_writes"] == 0
        assert st["l3_tier"]["dirty_pages"] <= 8


def test_l3_slower_than_sets_never_pins_the_arena_under_write_through(make_daemon, tmp_path):
    """Pages waiting for their L3 write are pinned: past half the arena, write-through drops
    new writes (counted) instead, so every set still finds room by evicting."""
    d = make_daemon(l2_size="4MiB", extra=[*_l3_backend(tmp_path, put_delay_s=2.0),
                                           "--write-policy", "write_through",
                                           "--set-ahead-bytes", "0"])
    src, dst = big_pool(24, seed=59), big_pool(24, seed=0)
    with d.client() as c:
        c.register_mem_host_pool_v2(src, "kv")
        for i in range(0, 24, 2):  # 3 arenas' worth while the first write still sleeps
            assert c.batch_set_v1([f"w{i}", f"w{i + 1}"], big_pages(i, 2)) == [True, True], i
        st = c.stats()
        assert st["no_space"] == 0 and st["l3_writes_dropped"] >= 16
        assert 0 < st["l3_tier"]["writing_bytes"] <= 2 * 1024 * 1024
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v1(["w22", "w23"], big_pages(22, 2)) == [True, True]
        assert torch.equal(dst.kv_buffer[22 * 64:], src.kv_buffer[22 * 64:])
        assert wait_until(lambda: c.stats()["l3_tier"]["writing_bytes"] == 0, 10)
        assert c.stats()["l3_writes"] == 24 - c.stats()["l3_writes_dropped"]


def test_l3_flush_leaves_no_page_written_before_it(make_daemon, tmp_path):
    d = make_daemon(extra=_l3_backend(tmp_path, put_delay_s=0.3))
    with d.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=62), "kv")
        for i in range(4):  # four write-through jobs queued behind each other
            assert c.batch_set_v1([f"q{i}"], pages(i, 1)) == [True]
        assert c.stats()["l3_writes"] < 4
        c.flush("all")  # the L3 clear runs behind the queued writes
        assert c.stats()["l3_writes"] == 4
        assert c.batch_exists([f"q{i}" for i in range(4)]) == 0
        assert c.batch_set_v1(["q0"], pages(0, 1)) == [True]  # a new write is stored again
        assert wait_until(lambda: c.stats()["l3_writes"] == 5)


# ---------------------------------------------------------------- attach / detach


def test_attach_detach_at_runtime(make_daemon, tmp_path):
    d = make_daemon(extra=["--l3-backend", "none"])
    keys = [f"a{i}" for i in range(6)]
    src, dst = kv_pool(seed=59), kv_pool()
    with d.client() as c:
        assert c.backend_status()["backend"] == "none"
        _set_kv(c, keys[:3], src)
        st = c.attach_backend("file", {"root": str(tmp_path / "l3")})
        assert st["attached"] and st["backend"] == "file"
        assert st["write_policy"] == "write_through"
        c.register_mem_host_pool_v2(src, "kv")
        assert c.batch_set_v1(keys[3:], pages(3, 3)) == [True] * 3
        assert wait_until(lambda: c.stats()["l3_writes"] == 3)
        # the same backend again: only the policies change
        st = c.attach_backend("file", write_policy="write_through_selective", prefetch=False)
        assert st["write_policy"] == "write_through_selective" and st["prefetch"] is False
        with pytest.raises(BackendConflict, match="detach"):
            c.attach_backend(SLOW, {"root": str(tmp_path / "other")})
        st = c.detach_backend()
        assert not st["attached"] and st["backend"] == "none"
        assert c.detach_backend()["backend"] == "none"  # idempotent
        # L2 kept its pages
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v1(keys, pages(10, 6)) == [True] * 6
        assert torch.equal(kv_tokens(dst, 10, 6), kv_tokens(src, 0, 6))
        c.flush("l2")
        assert c.batch_exists(keys) == 0  # no L3 any more
        c.attach_backend("file", {"root": str(tmp_path / "l3")})
        assert c.batch_exists(keys) == 0  # keys 0..2 were never written
        assert c.batch_exists(keys[3:]) == 3  # the directory's pages are found again


def test_detach_writes_the_write_back_pages_first(make_daemon, tmp_path):
    """Under write_back L2 holds the only copy of dirty pages: a detach writes them to the
    store before letting go (a slow store: for drain_timeout_s, then those left are counted as
    dropped and stay in L2)."""
    d = make_daemon(extra=["--l3-backend", "none", "--drain-timeout-s", "1"])
    keys = [f"wb{i}" for i in range(4)]
    src, dst = kv_pool(seed=61), kv_pool()
    root = str(tmp_path / "l3")
    with d.client() as c:
        c.attach_backend("file", {"root": root}, write_policy="write_back")
        _set_kv(c, keys, src)
        assert c.backend_status()["dirty_pages"] == 4
        st = c.detach_backend()
        assert st["detached"] and st["dirty_dropped"] == 0 and st["dirty_pages"] == 0
        c.flush("l2")
        c.attach_backend("file", {"root": root})
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v1(keys, pages(0, 4)) == [True] * 4  # from L3
        assert torch.equal(kv_tokens(dst, 0, 4), kv_tokens(src, 0, 4))
        c.detach_backend()
        c.attach_backend(SLOW, {"root": str(tmp_path / "slow"), "put_delay_s": 3},
                         write_policy="write_back")
        more = [f"wb{i}" for i in range(4, 7)]
        c.register_mem_host_pool_v2(src, "kv")
        assert c.batch_set_v1(more, pages(4, 3)) == [True] * 3
        st = c.detach_backend()  # the store takes longer than drain_timeout_s
        assert st["dirty_dropped"] == 3 and c.stats()["l3_dirty_dropped"] == 3
        assert c.batch_exists(more) == 3  # L2 still has them
    assert "3 write-back pages it never got" in d.output()


def test_attach_errors_are_typed_and_leave_the_tier_usable(make_daemon, tmp_path):
    d = make_daemon(extra=["--l3-backend", "none"])
    with d.client() as c:
        with pytest.raises(BackendError, match="unknown L3 backend"):
            c.attach_backend("tape")
        with pytest.raises(ConfigError, match="unknown option 'color'"):  # as mooncake, hf3fs
            c.attach_backend("file", {"root": str(tmp_path), "color": "red"})
        with pytest.raises(BackendError, match="cannot be loaded"):
            c.attach_backend("no_such_module:Backend")
        with pytest.raises(ProtocolError, match="write policy"):
            c.attach_backend("file", {"root": str(tmp_path)}, write_policy="sometimes")
        assert c.backend_status()["backend"] == "none"
        assert c.attach_backend("file", {"root": str(tmp_path)})["attached"]


def test_attach_detach_while_clients_read_and_write(make_daemon, tmp_path):
    d = make_daemon(extra=["--l3-backend", "none"])
    src = kv_pool(seed=60)
    errors, rounds = [], []
    stop = threading.Event()

    def worker(n):
        dst = kv_pool()
        try:
            with d.client() as c:
                c.register_mem_host_pool_v2(src, "kv")
                i = 0
                while not stop.is_set():
                    keys = [f"t{n}-{i}-{j}" for j in range(4)]
                    c.register_mem_host_pool_v2(src, "kv")
                    assert c.batch_set_v1(keys, pages(4 * n, 4)) == [True] * 4
                    c.register_mem_host_pool_v2(dst, "kv")
                    got = c.batch_get_v1(keys, pages(0, 4))
                    for j, ok in enumerate(got):
                        if ok:
                            assert torch.equal(kv_tokens(dst, j, 1), kv_tokens(src, 4 * n + j, 1))
                    i += 1
                rounds.append(i)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    try:
        with d.client() as admin:
            for k in range(4):
                admin.attach_backend("file", {"root": str(tmp_path / f"l3-{k}")})
                time.sleep(0.2)
                admin.detach_backend()
                time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert len(rounds) == 2 and all(r > 0 for r in rounds)


def test_get_waits_for_a_page_another_client_is_writing(daemon):
    from hicached import protocol as P

    src, dst = kv_pool(seed=63), kv_pool()
    with daemon.client() as w, daemon.client() as r:
        w.register_mem_host_pool_v2(src, "kv")
        r.register_mem_host_pool_v2(dst, "kv")
        res = w._conn.call(lambda s, q: P.Reserve(q, s, [P.PoolKeys("kv", ["x"])]))
        off = res.offsets[0][0]
        page = kv_tokens(src, 0, 1).contiguous().view(torch.uint8).reshape(-1)
        w.arena.tensor[off:off + page.numel()].copy_(page)  # page_first: one contiguous page
        got = {}
        t = threading.Thread(target=lambda: got.update(ok=r.batch_get_v1(["x"], pages(5, 1)),
                                                       t=time.monotonic()))
        t.start()
        time.sleep(0.3)  # the reader is parked on the uncommitted page
        assert t.is_alive()
        committed_at = time.monotonic()
        w._conn.call(lambda s, q: P.Commit(q, s, res.reservation_id, [[True]]))
        t.join(10)
        assert got["ok"] == [True] and got["t"] >= committed_at
        assert torch.equal(kv_tokens(dst, 5, 1), kv_tokens(src, 0, 1))
        # an uncommitted page that is never committed: the get answers a miss at get_wait_s
        res = w._conn.call(lambda s, q: P.Reserve(q, s, [P.PoolKeys("kv", ["y"])]))
        t0 = time.monotonic()
        assert r.batch_get_v1(["y"], pages(6, 1)) == [False]
        assert 1.5 < time.monotonic() - t0 < 4.5  # get_wait_s = 2 s


def test_a_client_never_waits_for_its_own_uncommitted_page(daemon):
    # one Client shared by threads: a set's commit goes out after its copy, unlocked; a get of
    # the same key from another thread in between must not wait for a commit queued behind it
    from hicached import protocol as P

    with daemon.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=64), "kv")
        res = c._conn.call(lambda s, q: P.Reserve(q, s, [P.PoolKeys("kv", ["own"])]))
        t0 = time.monotonic()
        assert c.batch_get_v1(["own"], pages(3, 1)) == [False]
        assert time.monotonic() - t0 < 1.0  # a miss at once, not after get_wait_s
        c._conn.call(lambda s, q: P.Commit(q, s, res.reservation_id, [[True]]))
        assert c.batch_get_v1(["own"], pages(3, 1)) == [True]
