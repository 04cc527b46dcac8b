"""Two nodes on loopback: two real daemons sharing one real ``mooncake_master``, as the PD
prefill's and decode's daemons do (``docs/pd.md``, two nodes). The prefill's daemon confirms
pages stored in L3 (``Client.wait_stored``); the decode's daemon then loads them by name, even
when its short memory of keys the store lacked (``ABSENT_TTL_S``) says otherwise.

One master and two daemons for the session (``conftest.two_node_daemons``, shared with
``tests/engine/test_pd_two_nodes.py``); each test uses keys of its own."""

import time

import pytest
import torch
from mooncake_master import require_mooncake
from pools import kv_pool, kv_tokens, mamba_pool, pages

from hicached import PoolTransfer
from hicached.daemon.l3.tier import ABSENT_TTL_S

require_mooncake()


@pytest.fixture
def nodes(two_node_daemons):
    """(prefill's daemon, decode's daemon): ``conftest.two_node_daemons``."""
    return two_node_daemons


def pools(c, seed=None):
    kv, mamba = kv_pool(seed=seed), mamba_pool(seed=seed)
    c.register_mem_host_pool_v2(kv, "kv")
    c.register_mem_host_pool_v2(mamba, "mamba")
    return kv, mamba


def publish(c, keys, state_slot):
    """Set ``keys`` (KV) and the state of the last one; the transfers a wait names."""
    assert c.batch_set_v2([PoolTransfer("kv", pages(0, len(keys)), keys=keys),
                           PoolTransfer("mamba", torch.tensor([state_slot]), keys=keys[-1:],
                                        hit_policy="trailing_pages")]) \
        == {"kv": [True] * len(keys), "mamba": [True]}
    return [PoolTransfer("kv", keys=keys), PoolTransfer("mamba", keys=keys[-1:])]


def test_a_page_confirmed_stored_is_no_miss_on_the_other_node(nodes):
    """The decode's daemon is asked first (the decode's load-back at a request's arrival):
    the store lacks the keys, and the daemon remembers it. The prefill then stores them and
    waits for L3; the decode's get of those very keys (``Storage.load``) must not be a miss
    from that memory."""
    prefill, decode = nodes
    keys = [f"confirmed-{i}" for i in range(6)]
    with prefill.client() as p, decode.client() as d:
        src, src_state = pools(p, seed=11)
        dst, dst_state = pools(d)
        probe = [PoolTransfer("mamba", keys=keys[-1:], hit_policy="trailing_pages")]
        assert d.batch_exists_v2(keys, probe).kv_hit_pages == 0  # absent, remembered
        before = d.stats()  # (the daemons serve other tests of the session: deltas)
        written = p.stats()["l3_writes"]
        wanted = publish(p, keys, state_slot=3)
        p.wait_stored(wanted)
        assert p.stats()["l3_writes"] - written == 7  # 6 pages and a state, written through
        # within the absent memory's TTL (a loaded machine may take longer: still a hit)
        got = d.batch_get_v2([PoolTransfer("kv", pages(8, 6), keys=keys),
                              PoolTransfer("mamba", torch.tensor([5]), keys=keys[-1:],
                                           hit_policy="trailing_pages")])
        assert got == {"kv": [True] * 6, "mamba": [True]}
        assert torch.equal(kv_tokens(dst, 8, 6), kv_tokens(src, 0, 6))
        assert all(torch.equal(a[5], b[3]) for a, b in zip(dst_state.buffers,
                                                            src_state.buffers))
        st = d.stats()
        assert st["l3_loads"] - before["l3_loads"] == 7 and st["misses"] == before["misses"]
        # asked the store again: the memory was not trusted
        assert st["l3"]["exists_calls"] > before["l3"]["exists_calls"]


def test_exists_keeps_trusting_the_absent_memory(nodes):
    """The cost saving stays for exists (sparse state pools miss most keys): within
    ``ABSENT_TTL_S`` an exists of keys the store lacked asks nothing."""
    _, decode = nodes
    keys = [f"sparse-{i}" for i in range(4)]
    with decode.client(shared_exists=False) as d:
        pools(d)
        t0 = time.monotonic()
        assert d.batch_exists_v2(keys).kv_hit_pages == 0
        asked = d.stats()["l3"]["exists_calls"]
        assert d.batch_exists_v2(keys).kv_hit_pages == 0
        if time.monotonic() - t0 < ABSENT_TTL_S:  # (else a loaded machine outlived it)
            assert d.stats()["l3"]["exists_calls"] == asked


def test_write_back_pages_are_written_for_the_wait_and_found_on_the_other_node(nodes):
    prefill, decode = nodes
    keys = [f"wb-{i}" for i in range(4)]
    with prefill.client() as p, decode.client() as d:
        p.attach_backend("mooncake", write_policy="write_back")
        try:
            pools(p, seed=12)
            before = p.stats()
            wanted = publish(p, keys, state_slot=1)
            assert p.stats()["l3_tier"]["dirty_pages"] == before["l3_tier"]["dirty_pages"] + 5
            p.wait_stored(wanted)
            st = p.stats()
            assert st["l3_forced_writes"] - before["l3_forced_writes"] == 5
            assert st["l3_tier"]["dirty_pages"] == before["l3_tier"]["dirty_pages"]
        finally:
            p.attach_backend("mooncake", write_policy="write_through")
        dst, _ = pools(d)
        got = d.batch_get_v2([PoolTransfer("kv", pages(0, 4), keys=keys)])
        assert got == {"kv": [True] * 4}
        assert torch.equal(kv_tokens(dst, 0, 4), kv_tokens(kv_pool(seed=12), 0, 4))
