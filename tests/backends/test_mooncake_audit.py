"""The audit of L3 copies (``daemon/l3/audit.py``) with a real daemon on a real ``mooncake_master``:
Mooncake evicts without telling anyone; here another client of the store removes the pages."""

import json

import torch
from conftest import wait_until
from pools import kv_pool, kv_tokens, pages
from test_mooncake import make_arena, make_backend, master  # noqa: F401 - fixtures (and the skip)

from hicached import PoolTransfer
from hicached.daemon.sessions import namespace_digest


def test_a_daemon_writes_again_what_the_store_lost_behind_its_back(master, make_daemon,
                                                                   make_backend):
    """Mooncake evicts without telling anyone, first the copies of pages L2 serves (never read
    there). The daemon's audit (``daemon/l3/audit.py``) finds them gone and writes them again, so
    they survive L2 letting them go. Here another client of the store removes them."""
    opts = {"master_server_address": master.address, "protocol": "tcp",
            "global_segment_size": "32MiB", "local_buffer_size": "4MiB",
            "local_hostname": "127.0.0.1"}
    d = make_daemon(extra=["--l3-backend", "mooncake", "--l3-options", json.dumps(opts),
                           "--l3-audit-s", "0.5"])
    other = make_backend(master.address)  # another node's client of the same store
    keys = [f"hot-{i}" for i in range(4)]
    with d.client() as c:
        ns = namespace_digest(c.namespace)  # what the daemon names L3 pages by
        src, dst = kv_pool(seed=81), kv_pool()
        c.register_mem_host_pool_v2(src, "kv")
        assert c.batch_set_v2([PoolTransfer("kv", pages(0, 4), keys=keys)]) == {"kv": [True] * 4}
        assert wait_until(lambda: c.stats()["l3_writes"] == 4)
        assert other.exists(ns, "kv", keys) == [True] * 4
        assert other.clear() == 4  # as the master evicting them: the daemon is not told
        assert other.exists(ns, "kv", keys) == [False] * 4
        assert wait_until(lambda: c.stats()["l3_copies_lost"] >= 4, timeout_s=20)
        assert wait_until(lambda: other.exists(ns, "kv", keys) == [True] * 4)
        c.flush("l2")  # L2 lets them go: they come back from L3, byte for byte
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v2([PoolTransfer("kv", pages(4, 4), keys=keys)]) == {"kv": [True] * 4}
        assert torch.equal(kv_tokens(dst, 4, 4), kv_tokens(src, 0, 4))
