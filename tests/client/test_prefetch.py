"""Prefetch operations and SGLang's stop policies, against real daemons.

The operation's ``on_progress`` hook (called on its thread after every chunk) holds it between
chunks where a test needs a prefetch that is still running at a known point.
"""

import signal
import threading
import time

import pytest
import torch
from conftest import sigstop, wait_until

from hicached import HostPool, LengthMismatch, PoolHitPolicy, PoolTransfer, UnknownPool
from hicached.client.prefetch import BestEffort, Timeout, WaitComplete, make_policy

PAGE = 4


def kv_pool(num_pages=64, seed=None):
    pool = HostPool.allocate_mha(num_pages, PAGE, layers=2, heads=2, head_dim=8,
                                 layout="page_first", dtype=torch.float32)
    if seed is not None:
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape,
                                         generator=torch.Generator().manual_seed(seed)))
    return pool


def pages(first, n):
    return torch.arange(first * PAGE, (first + n) * PAGE)


def kv_of(pool, first, n):
    return pool.kv_buffer[:, first * PAGE:(first + n) * PAGE]


def stored(client, n, prefix="p"):
    """Keys of ``n`` pages written from host pages 0..n-1 of the client's KV pool."""
    keys = [f"{prefix}{i}" for i in range(n)]
    assert client.batch_set_v1(keys, pages(0, n)) == [True] * n
    return keys


class Gate:
    """``on_progress`` hook that parks the operation after ``after`` chunks until opened."""

    def __init__(self, after=1):
        self.after, self.chunks = after, 0
        self.reached, self.opened = threading.Event(), threading.Event()

    def __call__(self, op, completed):
        self.chunks += 1
        if self.chunks == self.after:
            self.reached.set()
            assert self.opened.wait(20)


def test_policy_math_and_names():
    t = Timeout()  # sglang 0.5.23 defaults: base 1 s, 0.25 s per 1024 tokens; max 30 s
    assert (t.base_s, t.per_ki_token_s, t.max_s) == (1.0, 0.25, 30.0)
    assert t.timeout_s(0) == 1.0
    assert t.timeout_s(1024) == 1.25
    assert t.timeout_s(4096 * 8) == 9.0
    assert t.timeout_s(10**6) == 30.0  # capped
    knobs = {"prefetch_timeout_base": 2, "prefetch_timeout_per_ki_token": 0.5,
             "prefetch_timeout_max": 4, "other": 1}
    custom = make_policy("timeout", knobs)
    assert custom == Timeout(2, 0.5, 4) and custom.timeout_s(2048) == 3.0
    assert custom.timeout_s(8192) == 4.0
    assert isinstance(make_policy("best_effort"), BestEffort)
    assert isinstance(make_policy("wait_complete"), WaitComplete)
    assert make_policy(custom) is custom
    assert custom.deadline_s(2048) == 3.0 and WaitComplete().deadline_s(2048) is None
    with pytest.raises(ValueError, match="valid: \\['best_effort', 'timeout', 'wait_complete'\\]"):
        make_policy("eventually")
    with pytest.raises(ValueError, match="base_s"):
        Timeout(base_s=-1)


def test_wait_complete_waits_for_every_page(daemon):
    with daemon.client() as c:
        src = kv_pool(seed=1)
        c.register_mem_host_pool_v2(src, "kv")
        keys = stored(c, 12)
        gate = Gate(after=1)
        op = c.prefetch(keys, pages(20, 12), policy="wait_complete", chunk_pages=4,
                        on_progress=gate)
        assert gate.reached.wait(10)
        assert op.completed_pages == 4 and op.hit_pages == 12 and not op.done
        assert not op.should_stop()
        assert not op.should_stop(now=op.started_s + 1e6)  # no deadline, however long
        gate.opened.set()
        assert op.wait(10)
        assert op.should_stop() and op.error is None
        assert op.terminate() == 12
        assert torch.equal(kv_of(src, 20, 12), kv_of(src, 0, 12))


def test_best_effort_stops_any_time_with_what_arrived(daemon):
    with daemon.client() as c:
        src = kv_pool(seed=2)
        c.register_mem_host_pool_v2(src, "kv")
        keys = stored(c, 12)
        kv_of(src, 20, 12).zero_()
        gate = Gate(after=1)
        op = c.prefetch(keys, pages(20, 12), policy="best_effort", chunk_pages=4,
                        on_progress=gate)
        assert gate.reached.wait(10)
        assert op.should_stop()  # at once: the caller decides when to run
        op.terminate(wait=False)
        gate.opened.set()
        assert op.terminate(timeout_s=10) == 4  # the chunk in flight, nothing after it
        assert op.done and op.terminated
        assert torch.equal(kv_of(src, 20, 4), kv_of(src, 0, 4))
        assert kv_of(src, 24, 8).abs().sum() == 0  # never written


def test_timeout_policy_deadline_with_a_stalled_daemon(daemon):
    with daemon.client(timeout_s=5.0) as c:
        src = kv_pool(seed=3)
        c.register_mem_host_pool_v2(src, "kv")
        keys = stored(c, 16)
        policy = Timeout(base_s=0.3, per_ki_token_s=1.0, max_s=10.0)
        deadline = policy.timeout_s(16 * PAGE)
        assert deadline == pytest.approx(0.3 + 64 / 1024)
        gate = Gate(after=1)
        op = c.prefetch(keys, pages(20, 16), policy=policy, chunk_pages=4, on_progress=gate)
        assert gate.reached.wait(10)
        assert not op.should_stop(now=op.started_s + deadline - 0.01)
        assert op.should_stop(now=op.started_s + deadline + 0.01)
        sigstop(daemon.proc.pid)  # the next chunk will hang on the daemon
        try:
            gate.opened.set()
            assert wait_until(lambda: op.should_stop(), timeout_s=5)  # real clock
            assert time.monotonic() - op.started_s >= deadline and not op.done
            op.terminate(wait=False)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert op.terminate(timeout_s=10) in (4, 8)  # the chunk in flight may still land
        assert torch.equal(kv_of(src, 20, 4), kv_of(src, 0, 4))


def test_prefetch_with_sidecars_restores_indexer_and_trailing_mamba(daemon):
    with daemon.client() as c:
        kv = kv_pool(seed=4)
        ix = HostPool.allocate_indexer(64, PAGE, layers=2, page_elems=16)
        ix.buffers[0].copy_(torch.randint(0, 255, ix.buffers[0].shape,
                                          generator=torch.Generator().manual_seed(5)))
        mb = HostPool.allocate_mamba(8, 2, (2, 4), [(3, 4)])
        for comp in mb.buffers:
            comp.copy_(torch.randn(comp.shape, generator=torch.Generator().manual_seed(6)))
        for name, pool in (("kv", kv), ("indexer", ix), ("mamba", mb)):
            c.register_mem_host_pool_v2(pool, name)
        keys = [f"s{i}" for i in range(10)]
        c.batch_set_v2([PoolTransfer("kv", pages(0, 10), keys=keys),
                        PoolTransfer("indexer", pages(0, 10), keys=keys),
                        PoolTransfer("mamba", torch.tensor([0, 1]), keys=[keys[5], keys[9]])])
        progress = []
        op = c.prefetch(keys, pages(30, 10), [
            PoolTransfer("indexer", pages(30, 10), hit_policy=PoolHitPolicy.ALL_PAGES),
            PoolTransfer("mamba", torch.tensor([4]), keys=["placeholder"],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)],
            policy="wait_complete", chunk_pages=3, on_progress=lambda o, n: progress.append(n))
        assert op.wait(10) and op.error is None
        assert progress == [3, 6, 9, 10]
        assert (op.hit_pages, op.restorable, op.restorable_pages) == (10, [6, 10], 10)
        assert op.sidecar_results == {"mamba": [True]}
        assert torch.equal(kv_of(kv, 30, 10), kv_of(kv, 0, 10))
        assert torch.equal(ix.buffers[0][30:40], ix.buffers[0][0:10])
        for comp in mb.buffers:
            assert torch.equal(comp[4], comp[1])  # the state at page 9 (key s9)
        with pytest.raises(UnknownPool):
            c.prefetch(keys, pages(30, 10), [PoolTransfer("swa", pages(0, 10))])
        with pytest.raises(LengthMismatch):
            c.prefetch(keys, pages(30, 9))


def test_prefetch_of_pages_only_in_l3_and_a_miss(daemon):
    with daemon.client() as c:
        src = kv_pool(seed=7)
        c.register_mem_host_pool_v2(src, "kv")
        keys = stored(c, 8)
        assert wait_until(lambda: c.stats()["l3_writes"] >= 8)
        c.flush("l2")
        assert c.stats()["l2_pages"] == 0
        op = c.prefetch(keys + ["absent"], pages(20, 9), policy="wait_complete")
        assert op.wait(10) and op.error is None
        assert (op.hit_pages, op.completed_pages) == (8, 8)
        assert torch.equal(kv_of(src, 20, 8), kv_of(src, 0, 8))
        assert c.stats()["l3_loads"] >= 8


def test_daemon_gone_mid_prefetch_ends_it_with_the_error(make_daemon):
    d = make_daemon(name="gone")
    c = d.client(timeout_s=0.5)
    try:
        src = kv_pool(seed=8)
        c.register_mem_host_pool_v2(src, "kv")
        keys = stored(c, 8)
        gate = Gate(after=1)
        op = c.prefetch(keys, pages(20, 8), policy="timeout", chunk_pages=2, on_progress=gate)
        assert gate.reached.wait(10)
        sigstop(d.proc.pid)
        try:
            gate.opened.set()
            assert op.wait(10)
        finally:
            d.proc.send_signal(signal.SIGCONT)
        assert type(op.error).__name__ == "DaemonUnavailable"
        assert op.completed_pages == 2 and op.restorable_pages == 2 and op.should_stop()
    finally:
        c.close()
