"""The 3FS backend behind real daemons: two daemons share pages through one root, and a
detached backend finds its pages again when attached."""

import json

import torch
from conftest import wait_until
from pools import kv_pool, kv_tokens, pages

from hicached import PoolTransfer


def test_two_daemons_share_pages_through_one_root(make_daemon, tmp_path):
    root = tmp_path / "mnt"

    def extra(node):
        opts = {"root": str(root), "node": node, "io": "posix", "lookup_budget_ms": 2000}
        return ["--l3-backend", "hf3fs", "--l3-options", json.dumps(opts)]

    d1 = make_daemon(name="n1", extra=extra("n1"))
    d2 = make_daemon(name="n2", extra=extra("n2"))
    keys = [f"shared-{i}" for i in range(6)]
    src = kv_pool(seed=61)
    with d1.client() as c:
        c.register_mem_host_pool_v2(src, "kv")
        assert c.batch_set_v1(keys, pages(0, 6)) == [True] * 6
        assert wait_until(lambda: c.stats()["l3_writes"] == 6)
    with d2.client() as c:
        dst = kv_pool()
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.stats()["l2_pages"] == 0
        assert c.batch_exists_v2(keys).kv_hit_pages == 6
        got = c.batch_get_v2([PoolTransfer("kv", pages(10, 6), keys=keys)])
        assert got == {"kv": [True] * 6}
        assert torch.equal(kv_tokens(dst, 10, 6), kv_tokens(src, 0, 6))
        st = c.stats()
        assert st["l3_loads"] == 6 and st["l3"]["remote_hits"] == 6
        assert st["l3_backend"] == "hf3fs" and st["l3"]["io"] == "posix"


def test_detach_and_attach_again_finds_the_pages(make_daemon, tmp_path):
    opts = {"root": str(tmp_path / "mnt"), "node": "n1", "io": "posix"}
    d = make_daemon(extra=["--l3-backend", "hf3fs", "--l3-options", json.dumps(opts)])
    keys = [f"re-{i}" for i in range(3)]
    src, dst = kv_pool(seed=71), kv_pool()
    with d.client() as c:
        c.register_mem_host_pool_v2(src, "kv")
        assert c.batch_set_v1(keys, pages(0, 3)) == [True] * 3
        assert wait_until(lambda: c.stats()["l3_writes"] == 3)
        c.detach_backend()
        c.flush("l2")
        assert c.batch_exists(keys) == 0
        c.attach_backend("hf3fs", opts)  # same node: the closed instance's lock is free again
        assert c.batch_exists(keys) == 3
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v1(keys, pages(4, 3)) == [True] * 3
        assert torch.equal(kv_tokens(dst, 4, 3), kv_tokens(src, 0, 3))
