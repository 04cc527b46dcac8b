"""``Client.wait_stored``: returns once named pages are in L3, whatever the write policy, and
says why not with a typed error (no L3, a failed write, pages nowhere, the deadline, a detach).

Real daemons on ``ipc://`` with the real file backend, made slow or failing on purpose
(``l3_doubles.SlowFileBackend``). Two daemons sharing a real Mooncake store:
``tests/backends/test_mooncake_two_nodes.py``."""

import json
import threading
import time

import pytest
import torch
from conftest import wait_until
from pools import kv_pool, kv_tokens, mamba_pool, pages

from hicached import PoolTransfer
from hicached.errors import InvalidTransfer, NoL3, NotStored, StoreTimeout, UnknownPool

SLOW = "l3_doubles:SlowFileBackend"


def slow_l3(tmp_path, **options):
    return ["--l3-backend", SLOW, "--l3-options",
            json.dumps({"root": str(tmp_path / "l3"), **options})]


def kv_and_state(c, keys, start=0):
    """Store ``keys`` as KV pages and the state of the last one; the transfers to wait for."""
    assert c.batch_set_v2([PoolTransfer("kv", pages(start, len(keys)), keys=keys),
                           PoolTransfer("mamba", torch.tensor([start % 8]), keys=keys[-1:],
                                        hit_policy="trailing_pages")]) \
        == {"kv": [True] * len(keys), "mamba": [True]}
    return [PoolTransfer("kv", keys=keys), PoolTransfer("mamba", keys=keys[-1:])]


def registered(c, seed=1):
    c.register_mem_host_pool_v2(kv_pool(seed=seed), "kv")
    c.register_mem_host_pool_v2(mamba_pool(seed=seed), "mamba")
    return c


def test_without_l3_it_raises_at_once(make_daemon):
    d = make_daemon(extra=("--l3-backend", "none"))
    with registered(d.client()) as c:
        wanted = kv_and_state(c, ["a", "b"])
        t = time.monotonic()
        with pytest.raises(NoL3, match="no L3 backend"):
            c.wait_stored(wanted, timeout_s=30)
        assert time.monotonic() - t < 1.0
        c.wait_stored([PoolTransfer("kv", keys=[])])  # nothing named: nothing asked
        with pytest.raises(UnknownPool):
            c.wait_stored([PoolTransfer("nope", keys=["a"])])
        with pytest.raises(InvalidTransfer, match="longer than 1024"):
            c.wait_stored([PoolTransfer("kv", keys=["k" * 1025])])
        with pytest.raises(InvalidTransfer, match="keys must be str"):
            c.wait_stored([PoolTransfer("kv", keys=[1])])
        assert c.stats()["store_waits"] == 0


def test_waits_for_the_write_and_says_why_not(make_daemon, tmp_path):
    """A slow store (0.5 s a put): the deadline, then the same writes done; pages known
    stored; pages nowhere; a detach while waiting; a store whose writes fail."""
    d = make_daemon(extra=slow_l3(tmp_path, put_delay_s=0.5))
    with registered(d.client()) as c, d.client() as admin:
        wanted = kv_and_state(c, ["w0", "w1", "w2"])
        with pytest.raises(StoreTimeout, match=r"4 of 4 pages not stored in L3 within 0.1 s: "
                                               r"4 still being written"):
            c.wait_stored(wanted, timeout_s=0.1)
        c.wait_stored(wanted)  # the same writes, done now
        st = c.stats()
        assert (st["l3_writes"], st["store_waits"], st["store_wait_timeouts"]) == (4, 2, 1)
        assert st["l3_forced_writes"] == 0 and st["parked_store_waits"] == 0
        c.flush("l2")
        t = time.monotonic()
        c.wait_stored(wanted)  # known stored: no store round trip
        assert time.monotonic() - t < 0.4
        with pytest.raises(NotStored, match=r"2 of 2 pages not stored in L3 .*2 in neither L2 "
                                            r"nor L3 \('never-0', 'never-1'\)"):
            c.wait_stored([PoolTransfer("kv", keys=["never-0", "never-1"])])
        c.flush("l3")  # the store forgets them, and the daemon what it knew: asked again
        with pytest.raises(NotStored, match="4 in neither L2 nor L3"):
            c.wait_stored(wanted)
        # a detach while a wait waits for its write: no L3 any more
        wanted = kv_and_state(c, ["d0"], start=8)
        got = []

        def wait():
            try:
                c.wait_stored(wanted, timeout_s=10)
                got.append(None)
            except Exception as e:  # noqa: BLE001 - asserted below
                got.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert wait_until(lambda: admin.stats()["parked_store_waits"] == 1)
        admin.detach_backend()
        waiter.join(10)
        assert len(got) == 1 and isinstance(got[0], NoL3) and "detached" in str(got[0])
        # a store whose writes fail
        admin.attach_backend(SLOW, {"root": str(tmp_path / "l3"), "fail_puts": True})
        wanted = kv_and_state(c, ["f0", "f1"], start=12)
        with pytest.raises(NotStored, match=r"3 of 3 pages not stored .*3 whose L3 write "
                                            r"failed \('f0', 'f1', 'f1'\)"):
            c.wait_stored(wanted)


def test_pages_the_policies_keep_back_are_written_for_the_wait(make_daemon):
    """write_back writes under pressure only, selective after hits: a wait writes them now."""
    d = make_daemon(extra=["--l3-backend", "file"])
    with registered(d.client(), seed=3) as c:
        for n, policy in enumerate(["write_back", "write_through_selective"]):
            c.attach_backend("file", write_policy=policy)  # (attached: the policy only)
            keys = [f"{policy}-{i}" for i in range(4)]
            wanted = kv_and_state(c, keys)
            time.sleep(0.2)
            assert c.stats()["l3_writes"] == 5 * n  # kept back by the policy
            c.wait_stored(wanted)
            st = c.stats()
            assert (st["l3_writes"], st["l3_forced_writes"]) == (5 * n + 5, 5 * n + 5)
            assert st["l3_tier"]["dirty_pages"] == 0  # write_back: clean now, evictable
            c.flush("l2")  # from L3, byte for byte
            dst = kv_pool()
            c.register_mem_host_pool_v2(dst, "kv")
            got = c.batch_get_v2([PoolTransfer("kv", pages(8, 4), keys=keys)])
            assert got == {"kv": [True] * 4}
            assert torch.equal(kv_tokens(dst, 8, 4), kv_tokens(kv_pool(seed=3), 0, 4))
            c.register_mem_host_pool_v2(kv_pool(seed=3), "kv")
