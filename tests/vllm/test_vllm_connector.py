"""The vLLM connector under real vLLM engines on CPU (``hicached.plugin.vllm``).

Engines A and B are separate vLLM processes on one daemon, alive at the same time; the reference
outputs come from a third engine with no connector at all. The tiny models are built in the test
(``tiny_models.py``). Every engine start costs 5-15 s and a few GB here, so the engines are
shared by the tests of a module and at most four run at once. A loads synchronously
(``"load_async": false``) and copies through the device path (``"copy_path": "device"``, what a
KV cache on a GPU uses, here on CPU tensors); B loads asynchronously and copies with
``memmove`` (the defaults on CPU): every page one stores, the other reads.
"""

from __future__ import annotations

import os
import pathlib
import signal

import pytest

from conftest import DaemonProc, wait_until
from vllm_harness import (  # noqa: F401 - models: a fixture
    HAVE_VLLM, Engine, models, start_all, tokens)

pytestmark = [pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (docs/vllm.md)"),
              pytest.mark.timeout(900)]

BLOCK = 128  # vLLM's CPU block size for attention-only models
P1 = tokens(1, 700)  # 5 full blocks (640 tokens) and a partial one
P2 = P1 + tokens(2, 40)
Q1, Q2 = tokens(3, 400), None
S = tokens(4, 520)
F1 = tokens(5, 1100)
F2 = F1 + tokens(6, 30)
K = [tokens(100 + i, 300) for i in range(8)]  # prompts served around a daemon restart
Q2 = Q1 + tokens(7, 30)
PROMPTS = [P2, Q2, S, F2, *K, *(k + tokens(200, 20) for k in K)]


def shared(n: int, block: int = BLOCK) -> int:
    """Tokens of the whole blocks a longer prompt can take from a cache for a shared prefix of
    ``n`` tokens (vLLM caches whole blocks only)."""
    return n // block * block


def whole(n: int, block: int = BLOCK) -> int:
    """The same for a prompt of exactly ``n`` tokens (vLLM computes at least its last token)."""
    return (n - 1) // block * block


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-daemon")
    d = DaemonProc(tmp, l2_size="256MiB", slab_size="4MiB").start()
    yield d
    d.cleanup()


@pytest.fixture(scope="module")
def started(models, daemon, tmp_path_factory):
    """The module's engines, started together: a reference without a connector, A and B."""
    tmp = tmp_path_factory.mktemp("engines")
    trio = start_all(
        Engine(tmp, "base", models["llama"], start=False),
        Engine(tmp, "a", models["llama"], daemon.endpoint,
               extra={"load_async": False, "copy_path": "device"}, start=False),
        Engine(tmp, "b", models["llama"], daemon.endpoint, start=False))
    yield trio
    for e in trio:
        e.close()


@pytest.fixture(scope="module")
def ref(started):
    """Outputs of every prompt in an engine without a connector (closed after)."""
    base = started[0]
    try:
        got = base.generate(PROMPTS)
    finally:
        base.close()
    return {tuple(p): g["out"] for p, g in zip(PROMPTS, got, strict=True)}


@pytest.fixture(scope="module")
def engines(started, ref):
    """A and B, once the reference outputs are known."""
    return started[1], started[2]


def test_cached_output_equals_uncached(engines, ref):
    a, b = engines
    first = a.one(P1)
    assert first["cached"] == 0
    got = b.one(P2)  # another process, its own prefix cache empty
    assert got["cached"] >= 0.9 * shared(len(P1)), (got, b.tail())
    assert got["out"] == ref[tuple(P2)]
    again = a.one(P2)  # A's own prefix cache serves its blocks; outputs still equal
    assert again["out"] == ref[tuple(P2)]


def test_instances_share_while_both_run(engines, ref):
    a, b = engines
    assert b.one(Q1)["cached"] == 0
    got = a.one(Q2)
    assert got["cached"] == shared(len(Q1)), got
    assert got["out"] == ref[tuple(Q2)]


def test_cache_salt_isolates_tenants(engines, ref):
    a, b = engines
    assert a.one(S, cache_salt="tenant-1")["cached"] == 0
    other = b.one(S, cache_salt="tenant-2")
    assert other["cached"] == 0, other
    assert other["out"] == ref[tuple(S)]
    same = b.one(S, cache_salt="tenant-1")  # the positive control
    assert same["cached"] == whole(len(S)), same
    assert same["out"] == ref[tuple(S)]


@pytest.mark.parametrize("what", ["config", "dtype"])
def test_another_model_or_dtype_gets_nothing(engines, models, daemon, ref, tmp_path, what):
    a, _ = engines
    assert a.one(P2)["out"] == ref[tuple(P2)]  # stored (test 1) and served by A
    model, dtype = (models["llama_other"], "bfloat16") if what == "config" else \
        (models["llama"], "float16")
    other = Engine(tmp_path, what, model, daemon.endpoint, dtype=dtype)
    try:
        got = other.one(P2)
    finally:
        other.close()
    assert got["cached"] == 0, got


def test_engine_keeps_serving_while_the_daemon_is_down(engines, daemon, ref):
    a, b = engines
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    down = a.generate(K[:2])  # every request is answered, as misses
    assert [g["out"] for g in down] == [ref[tuple(k)] for k in K[:2]]
    daemon.start()
    hit = None
    for k in K[2:]:  # the connectors re-join the restarted daemon after their back-off
        a.one(k)
        got = b.one(k + tokens(200, 20))
        assert got["out"] == ref[tuple(k + tokens(200, 20))]
        if got["cached"]:
            hit = got
            break
    assert hit is not None and hit["cached"] == shared(len(k)), (hit, a.tail(), b.tail())


def _page_files(daemon) -> set[pathlib.Path]:
    l3 = pathlib.Path(daemon.state_dir) / "l3"
    return {p for p in l3.rglob("*") if p.is_file() and len(p.name) == 64}


def test_a_load_that_fails_is_recomputed(engines, daemon, ref):
    """Pages whose L3 copies were corrupted on disk: the exists call still counts them (presence
    only), their loads fail the checksum, vLLM recomputes those blocks: outputs stay equal."""
    a, b = engines
    before = _page_files(daemon)
    a.one(F1)
    with daemon.client() as c:
        assert wait_until(lambda: c.stats()["l3_tier"]["jobs_in_flight"] == 0, 30)
        new = sorted(_page_files(daemon) - before)
        assert len(new) == (len(F1) + 8) // BLOCK, new
        for path in new[::2]:  # every other page of the chain (in key order: anywhere)
            raw = bytearray(path.read_bytes())
            raw[-100] ^= 0x5A
            path.write_bytes(bytes(raw))
        c.flush("l2")
        failures = c.stats()["l3"]["integrity_failures"]
    got = b.one(F2)
    assert got["out"] == ref[tuple(F2)], got
    # (vLLM still reports the blocks as cached: it recomputed the failed ones in place)
    with daemon.client() as c:
        assert c.stats()["l3"]["integrity_failures"] > failures, b.tail()
    assert os.path.exists(daemon.state_dir)
