"""The hybrid cache controller in a real daemon (issue 25): the trailing pools a set names over
the wire, the eviction policy chosen at start (config / flag), its stats, and what it keeps of
chains a real client writes under memory pressure."""

import pytest
from inproc_daemon import inproc_daemon
from pools import kv_pool, mamba_pool, pages

from hicached import Client, PoolTransfer
from hicached.daemon.sessions import namespace_digest
from hicached.errors import ConfigError
from hicached.daemon.config import load_config

NS = "model-a"


def stats(d):
    with Client(d.endpoint, "probe") as c:
        return c.stats()


def test_a_set_names_its_trailing_pools_and_the_daemon_keeps_states_with_their_prefix(tmp_path):
    with inproc_daemon(tmp_path, l3_backend="none") as d, Client(d.endpoint, NS) as c:
        c.register_mem_host_pool_v2(kv_pool(num_pages=64, seed=1), "kv")
        c.register_mem_host_pool_v2(mamba_pool(seed=2), "mamba")
        keys = [f"a{i}" for i in range(6)]
        assert c.batch_set_v2([PoolTransfer("kv", pages(0, 6), keys=keys),
                               PoolTransfer("mamba", [0], keys=["a5"],
                                            hit_policy="trailing_pages")],
                              anchor_pool="kv", depth=0)["mamba"] == [True]
        ix = d.daemon.index
        ns = namespace_digest(NS)
        assert d.daemon.call(lambda: ix.trailing(ns)) == d.daemon.call(
            lambda: ix.pool_bit((ns, "mamba")))
        st = stats(d)
        assert (st["eviction"], st["l2_orphan_bytes"]) == ("hybrid", 0)
        # a flush slice takes a2's KV page: a3..a5 and the state go first, then a0, a1 (no
        # state left to end a hit on): nothing an exists could never use stays behind
        e = d.daemon.call(lambda: ix.get((ns, "kv"), "a2"))
        assert d.daemon.call(lambda: ix.drop_one(e)) == 7
        assert c.batch_exists(keys) == 0 and stats(d)["l2_orphan_bytes"] == 0


def test_an_old_client_naming_no_trailing_pool_still_stores(tmp_path):
    with inproc_daemon(tmp_path, eviction="prefix") as d, Client(d.endpoint, NS) as c:
        c.register_mem_host_pool_v2(kv_pool(seed=1), "kv")
        assert c.batch_set_v2([PoolTransfer("kv", pages(0, 2), keys=["x0", "x1"])])["kv"] == [
            True, True]
        assert stats(d)["eviction"] == "prefix"


@pytest.mark.parametrize("policy, kept", [("lru", 0), ("prefix", 6), ("hybrid", 6)])
def test_under_pressure_a_chain_keeps_its_head_unless_lru(tmp_path, policy, kept):
    """One slab of 16 pages of 1 KiB: chain A (10 pages), then chain B (10): A's prefix hit."""
    with inproc_daemon(tmp_path, eviction=policy, l2_size=16 << 10, slab_size=16 << 10,
                       l3_backend="none", evict_ahead=0,  # what the sets themselves evict
                       shared_exists=False) as d, Client(d.endpoint, NS) as c:
        c.register_mem_host_pool_v2(kv_pool(num_pages=32, seed=1), "kv")
        a, b = [f"a{i}" for i in range(10)], [f"b{i}" for i in range(10)]
        assert all(c.batch_set_v2([PoolTransfer("kv", pages(0, 10), keys=a)])["kv"])
        assert all(c.batch_set_v2([PoolTransfer("kv", pages(10, 10), keys=b)])["kv"])
        assert c.batch_exists(a) == kept and c.batch_exists(b) == 10
        assert (stats(d)["l2_orphan_bytes"] > 0) == (policy == "lru")


def test_the_eviction_config_is_checked():
    with pytest.raises(ConfigError, match="eviction: unknown 'mru'"):
        load_config(None, {}, {"eviction": "mru"}).resolved()
    with pytest.raises(ConfigError, match="eviction_alpha: must be >= 0"):
        load_config(None, {}, {"eviction_alpha": -1.0}).resolved()
    with pytest.raises(ConfigError, match="evict_ahead: must be a share of the arena"):
        load_config(None, {}, {"evict_ahead": 0.9}).resolved()
