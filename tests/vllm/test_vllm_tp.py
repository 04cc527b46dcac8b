"""The vLLM connector under tensor parallelism: real vLLM engines on CPU with two TP ranks (two
worker processes, each bound to one core). Each rank stores and loads its own half of every
block under its own namespace (``tp=0of2``, ``tp=1of2``); the scheduler asks rank 0's."""

from __future__ import annotations

import os
import re

import pytest

from conftest import DaemonProc, wait_until
from vllm_harness import HAVE_VLLM, Engine, models, tokens  # noqa: F401 - models: a fixture

pytestmark = [pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (docs/vllm.md)"),
              pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP=2 needs two cores"),
              pytest.mark.timeout(900)]

BLOCK = 128
P = tokens(31, 700)  # 5 full blocks
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (vLLM refuses one NUMA node)


def test_two_ranks_store_and_load_their_halves(models, tmp_path):
    """One engine (its two worker processes start in 30-60 s, vLLM spawns them): it computes and
    stores P, then, its own prefix cache emptied, loads P back; each rank's connector then
    reports its five pages read and hit at shutdown."""
    d = DaemonProc(tmp_path, l2_size="256MiB", slab_size="4MiB").start()
    e = None
    try:
        e = Engine(tmp_path, "tp", models["llama"], d.endpoint, llm_args=TP2, env=BIND)
        first = e.one(P)  # nothing stored yet: computed, then stored by both ranks
        assert first["cached"] == 0
        with d.client() as c:  # 5 blocks, each rank's half a page of its own namespace
            assert wait_until(lambda: c.stats()["l2_pages"] >= 2 * (len(P) // BLOCK), 30)
            assert c.stats()["l2_pages"] == 2 * (len(P) // BLOCK), c.stats()
        assert e.reset()  # vLLM's own prefix cache: the hit comes from hicached, both ranks load
        got = e.one(P)
        assert got["cached"] == (len(P) - 1) // BLOCK * BLOCK, (got, e.tail())
        assert got["out"] == first["out"]
        e.close()
        with open(e.log_path, errors="replace") as f:
            summaries = [ln for ln in f if "hicached-vllm worker: saved" in ln]
        hits = [re.search(r"'read_hit_pages': (\d+)", ln) for ln in summaries]
        assert [int(h.group(1)) if h else None for h in hits] == [(len(P) - 1) // BLOCK] * 2, \
            summaries
    finally:
        if e is not None:
            e.close()
        d.cleanup()
