"""The vLLM connector under tensor parallelism: real vLLM engines on CPU with two TP ranks (two
worker processes, each bound to one core). Each rank stores and loads its own half of every
block under its own namespace (``tp=0of2``, ``tp=1of2``); the scheduler asks rank 0's."""

from __future__ import annotations

import os

import pytest

from conftest import DaemonProc
from vllm_harness import HAVE_VLLM, Engine, models, tokens  # noqa: F401 - models: a fixture

pytestmark = [pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (docs/vllm.md)"),
              pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP=2 needs two cores"),
              pytest.mark.timeout(900)]

BLOCK = 128
P = tokens(31, 700)  # 5 full blocks
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (vLLM refuses one NUMA node)


def test_two_ranks_store_and_load_their_halves(models, tmp_path):
    d = DaemonProc(tmp_path, l2_size="256MiB", slab_size="4MiB").start()
    a = b = None
    try:
        a = Engine(tmp_path, "tp-a", models["llama"], d.endpoint, llm_args=TP2, env=BIND)
        first = a.one(P)  # nothing stored yet: computed, then stored by both ranks
        assert first["cached"] == 0
        a.close()
        a = None
        with d.client() as c:  # 5 blocks, each rank's half a page of its own namespace
            assert c.stats()["l2_pages"] == 2 * (len(P) // BLOCK), c.stats()
        b = Engine(tmp_path, "tp-b", models["llama"], d.endpoint, llm_args=TP2, env=BIND)
        got = b.one(P)  # another process, its own prefix cache empty: both ranks load
        assert got["cached"] == (len(P) - 1) // BLOCK * BLOCK, (got, b.tail())
        assert got["out"] == first["out"]
    finally:
        for e in (a, b):
            if e is not None:
                e.close()
        d.cleanup()
