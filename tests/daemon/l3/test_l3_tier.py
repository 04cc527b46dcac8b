"""L2 -> L3 write-through, L3 loads on L2 miss, and a restarted daemon finding its pages."""

import os

import torch
from conftest import wait_until
from pools import kv_pool, kv_tokens, mamba_pool, pages
from test_tiering import _set_kv

from hicached import PoolTransfer


def _page_files(state_dir):
    return [f for _, _, fs in os.walk(os.path.join(state_dir, "l3")) for f in fs]


def test_write_through_then_l3_hit_after_l2_flush(daemon):
    keys = [f"w{i}" for i in range(8)]
    with daemon.client() as c:
        src, dst = kv_pool(seed=31), kv_pool()
        msrc, mdst = mamba_pool(seed=32), mamba_pool()
        c.register_mem_host_pool_v2(src, "kv")
        c.register_mem_host_pool_v2(msrc, "mamba")
        c.batch_set_v2([PoolTransfer("kv", pages(0, 8), keys=keys),
                        PoolTransfer("mamba", torch.tensor([4]), keys=keys[7:])])
        assert wait_until(lambda: c.stats()["l3_writes"] == 9)
        assert sorted(_page_files(daemon.state_dir)) == sorted(keys + keys[7:])
        c.flush("l2")
        assert c.stats()["l2_pages"] == 0
        # exists consults L3 after L2
        assert c.batch_exists_v2(keys, [PoolTransfer("mamba", keys=keys[:1],
                                                     hit_policy="trailing_pages")]
                                 ).kv_hit_pages == 8
        c.register_mem_host_pool_v2(dst, "kv")
        c.register_mem_host_pool_v2(mdst, "mamba")
        got = c.batch_get_v2([PoolTransfer("kv", pages(20, 8), keys=keys),
                              PoolTransfer("mamba", torch.tensor([1]), keys=keys[7:])])
        assert got == {"kv": [True] * 8, "mamba": [True]}
        assert torch.equal(kv_tokens(dst, 20, 8), kv_tokens(src, 0, 8))
        for a, b in zip(mdst.buffers, msrc.buffers):
            assert torch.equal(a[1], b[4])
        st = c.stats()
        assert st["l2_pages"] == 9  # loaded pages are L2 pages again
        assert st["l3_loads"] == 9 and st["hits"] == 9
        assert st["l3_writes"] == 9  # and were not written back a second time


def test_restarted_daemon_finds_its_pages(make_daemon, tmp_path):
    d1 = make_daemon(name="first")
    keys = [f"r{i}" for i in range(4)]
    src = kv_pool(seed=41)
    with d1.client() as c:
        c.register_mem_host_pool_v2(src, "kv")
        assert c.batch_set_v1(keys, pages(0, 4)) == [True] * 4
        assert wait_until(lambda: c.stats()["l3_writes"] == 4)
    assert d1.stop() == 0
    d2 = make_daemon(name="second", state=d1.state_dir)
    with d2.client() as c:
        dst = kv_pool()
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.stats()["l2_pages"] == 0
        assert c.batch_exists(keys) == 4
        assert c.batch_get_v1(keys, pages(8, 4)) == [True] * 4
        assert torch.equal(kv_tokens(dst, 8, 4), kv_tokens(src, 0, 4))
    with d2.client("another-model") as c:
        c.register_mem_host_pool_v2(kv_pool(), "kv")
        assert c.batch_exists(keys) == 0


def test_client_rejoins_a_restarted_daemon(make_daemon):
    d = make_daemon()
    c = d.client()
    src = kv_pool(seed=51)
    c.register_mem_host_pool_v2(src, "kv")
    assert c.batch_set_v1(["x0", "x1"], pages(0, 2)) == [True, True]
    assert wait_until(lambda: c.stats()["l3_writes"] == 2)
    assert d.stop() == 0
    d.start()
    # the old session is gone: the client handshakes again, maps the new arena, re-registers
    assert c.batch_exists(["x0", "x1"]) == 2
    dst = kv_pool()
    c.register_mem_host_pool_v2(dst, "kv")
    assert c.batch_get_v1(["x0", "x1"], pages(4, 2)) == [True, True]
    assert torch.equal(kv_tokens(dst, 4, 2), kv_tokens(src, 0, 2))
    c.close()


def test_a_key_named_twice_in_one_call_is_loaded_from_l3_once(daemon):
    """A get (or an exists that prefetches) naming an L3 page twice reserved two slots for it
    and failed applying the load: the key stayed "in flight" for good (never loaded, never
    stored again) and both slots leaked."""
    keys = ["d0", "d1", "e0"]
    src, dst = kv_pool(seed=61), kv_pool()
    with daemon.client() as c:
        _set_kv(c, keys, src)
        assert wait_until(lambda: c.stats()["l3_writes"] == 3)
        c.flush("l2")
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v1(["d0", "d0", "d1"], pages(10, 3)) == [True] * 3
        for i, page in enumerate((0, 0, 1)):
            assert torch.equal(kv_tokens(dst, 10 + i, 1), kv_tokens(src, page, 1))
        assert c.batch_exists(["e0", "e0"]) == 2  # prefetches e0 (once)
        assert wait_until(lambda: c.stats()["l2_pages"] == 3)
        st = c.stats()
        assert (st["l3_loads"], st["l3_tier"]["loading_pages"]) == (3, 0), st
        c.flush("l2")
        assert c.stats()["l2_used_bytes"] == 0  # no slot left behind
        assert c.batch_get_v1(["d0"], pages(20, 1)) == [True]  # loads again
        assert c.batch_set_v1(["d0"], pages(0, 1)) == [True]
    assert "internal error" not in daemon.output()
