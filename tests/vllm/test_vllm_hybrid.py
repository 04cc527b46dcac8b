"""The vLLM connector with hybrid models, built locally, in real vLLM engines on CPU: Qwen3-Next
(gated delta net + attention) and Granite-4 hybrid (Mamba2 + attention). vLLM keeps its
recurrent state per block in mamba "align" mode; the connector stores the attention group as
pool ``kv`` and the state group as a trailing pool, so a hit is a prefix whose KV blocks and the
state at its end are all there."""

from __future__ import annotations

import pathlib
import re

import pytest

from conftest import DaemonProc, wait_until
from vllm_harness import (  # noqa: F401 - models: a fixture
    HAVE_VLLM, Engine, models, start_all, tokens)

pytestmark = [pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (docs/vllm.md)"),
              pytest.mark.timeout(900)]

BLOCK = 256  # Qwen3-Next's block size on CPU with a bf16 state (vLLM aligns it to the state)
P1 = tokens(11, 1100)  # 4 full blocks
P2 = P1 + tokens(12, 50)
OTHER = tokens(13, 600)
MID = P1[:600] + tokens(14, 50)  # a hit that ends at block 2 of P1 (1 at 384): needs its state
H1 = tokens(15, 1100)  # stored, then its L3 copies corrupted
H2 = H1 + tokens(16, 30)


def _page_files(daemon) -> set[pathlib.Path]:
    l3 = pathlib.Path(daemon.state_dir) / "l3"
    return {p for p in l3.rglob("*") if p.is_file() and len(p.name) == 64}


def _block_size(engine) -> int:
    """The attention block size vLLM chose (it raises it to fit the state: 256 tokens here with
    a bf16 SSM state, 384 where its accelerated GDN backend keeps the SSM state in fp32)."""
    with open(engine.log_path, "rb") as f:
        found = re.search(rb"Setting attention block size to (\d+) tokens", f.read())
    return int(found.group(1)) if found else BLOCK


@pytest.fixture(scope="module")
def qwen_ref(models, tmp_path_factory):
    """The block size vLLM chose for Qwen3-Next and the outputs of the module's prompts in an
    engine without a connector (started once for the module's tests; the first test's prompts
    only where that engine is its reference: blocks of ``BLOCK`` tokens)."""
    base = Engine(tmp_path_factory.mktemp("qwen-base"), "base", models["qwen3_next"])
    try:
        block = _block_size(base)  # (logged before the engine said it was ready)
        prompts = QWEN_PROMPTS if block == BLOCK else [C_LONG, C_MID]
        got = base.generate(prompts)
    finally:
        base.close()
    return block, {tuple(p): g["out"] for p, g in zip(prompts, got, strict=True)}


def test_hybrid_cached_output_equals_uncached(models, qwen_ref, tmp_path):
    block, ref = qwen_ref
    args = {}
    d = DaemonProc(tmp_path, l2_size="512MiB", slab_size="8MiB").start()
    base = a = b = None
    try:
        if block != BLOCK:
            # vLLM raised its blocks to fit an fp32 state (384 tokens) but would still chunk
            # prefills on 128: run every engine as docs/vllm.md tells operators to, with
            # ``--block-size`` the groups' size. The reference is such an engine with a
            # connector and nothing to hit (no daemon there): with an fp32 state, vLLM computes
            # MID's third token otherwise with any KV connector configured than with none (a
            # connector whose every call does nothing gives the same tokens as ours), so only an
            # engine with one tells what a hit changes
            args = {"block_size": block}
            base = Engine(tmp_path, "base-aligned", models["qwen3_next"],
                          f"ipc://{tmp_path}/no-daemon.sock", llm_args=args, start=False)
        a = Engine(tmp_path, "a", models["qwen3_next"], d.endpoint, llm_args=args, start=False)
        b = Engine(tmp_path, "b", models["qwen3_next"], d.endpoint, llm_args=args, start=False)
        start_all(*(e for e in (base, a, b) if e is not None))
        if base is not None:
            want = [g["out"] for g in base.generate([P2, OTHER, MID, H2])]
            base.close()
        else:
            want = [ref[tuple(p)] for p in (P2, OTHER, MID, H2)]
        assert a.one(P1)["cached"] == 0
        got = b.one(P2)
        assert got["cached"] >= 0.9 * (len(P1) // block * block), (got, block, b.tail())
        assert got["out"] == want[0]
        # a prompt that shares nothing: no hit, same outputs
        none = b.one(OTHER)
        assert none["cached"] == 0 and none["out"] == want[1]
        # a prompt leaving P1's chain at block 2 (block 1 at 384 tokens), from B with its own
        # prefix cache emptied: vLLM keeps a state only where a scheduled chunk ended (P1 was
        # one chunk, cut at its last block end), so there is none there to restore and no hit,
        # rather than one restoring the wrong state
        assert b.reset()
        mid = b.one(MID)
        assert mid["cached"] == 0, mid
        assert mid["out"] == want[2]
        # a load that fails with two KV-cache groups (L3 copies corrupted on disk): vLLM maps
        # no block id back to a request then, so the request is a failed receive and is
        # recomputed whole, with the same output; the engine goes on
        before = _page_files(d)
        a.one(H1)
        with d.client() as cl:
            assert wait_until(lambda: cl.stats()["l3_tier"]["jobs_in_flight"] == 0, 30)
            new = sorted(_page_files(d) - before)
            assert new
            for path in new[::2]:
                raw = bytearray(path.read_bytes())
                raw[-100] ^= 0x5A
                path.write_bytes(bytes(raw))
            cl.flush("l2")
            failures = cl.stats()["l3"]["integrity_failures"]
        got = b.one(H2)
        assert got["out"] == want[3], (got, b.tail())
        with d.client() as cl:
            assert cl.stats()["l3"]["integrity_failures"] > failures, b.tail()
        assert b.one(OTHER)["out"] == want[1]  # still serving
    finally:
        for e in (base, a, b):
            if e is not None:
                e.close()
        d.cleanup()
    # B's loads ran in the background (the default), and H2's failed whole
    summary = worker_summary(b)
    assert re.search(r"\(([1-9]\d*) in the background; ([1-9]\d*) requests' loads failed",
                     summary), summary


# A prefill in chunks of a block and 128 tokens: chunks that end inside a block and then cross
# its end (blocks 256: chunk ends 384, 768, 1152, 1536; blocks 384: 512, 1024, 1536). Only
# 768 and 1536, resp. 1536, are block ends: the only blocks whose state slot holds their state.
# (vLLM's engine core aligns chunks to 128 tokens on CPU whatever block size its groups took.)
C1 = tokens(31, 1700)
C_LONG = C1 + tokens(32, 50)  # a hit at 1536, where a chunk ended on a block end
C_MID = C1[:1300] + tokens(33, 50)  # leaves C1 inside block 4 (256) or 3 (384)
QWEN_PROMPTS = [P2, OTHER, MID, H2, C_LONG, C_MID]


def test_a_state_is_stored_only_at_a_block_where_a_chunk_ended(models, qwen_ref, tmp_path):
    """vLLM rotates a request's state slots, and a slot holds the state after the step's last
    token: stored at a block that step did not end on, it would be restored as that block's
    state (a hit at 1152 with another position's state gave other outputs, before the fix)."""
    block, ref = qwen_ref
    want = [ref[tuple(p)] for p in (C_LONG, C_MID)]
    d = DaemonProc(tmp_path, l2_size="512MiB", slab_size="8MiB").start()
    a = b = None
    try:
        a = Engine(tmp_path, "a", models["qwen3_next"], d.endpoint,
                   llm_args={"max_num_batched_tokens": block + 128,
                             "enable_chunked_prefill": True}, start=False)
        b = Engine(tmp_path, "b", models["qwen3_next"], d.endpoint, start=False)
        start_all(a, b)
        a.one(C1)
        a.close()  # (its log is whole once it is closed)
        with open(a.log_path, "rb") as f:
            core = re.search(rb"aligns prefill chunks to (\d+)-token blocks", f.read())
        a = None
        mid = b.one(C_MID)
        assert mid["out"] == want[1], (mid, block, b.tail())
        if core:  # the engine core chunked on 128 tokens: states only where a chunk ended
            ends = range(block + 128, len(C_MID), block + 128)
            assert mid["cached"] in {0, *(e for e in ends if e % block == 0)}, (mid, block)
        else:  # it chunked on the groups' blocks: every block of the match has its state
            assert mid["cached"] == 1300 // block * block, (mid, block)
        assert b.reset()  # vLLM's own prefix cache: the next hit comes from hicached
        long = b.one(C_LONG)
        assert long["out"] == want[0], (long, block, b.tail())
        assert long["cached"] >= 1536, (long, block, b.tail())
    finally:
        for e in (a, b):
            if e is not None:
                e.close()
        d.cleanup()


def worker_summary(engine: Engine) -> str:
    """The connector worker's last words (logged at shutdown) in a closed engine's log."""
    with open(engine.log_path, errors="replace") as f:
        lines = [ln for ln in f if "hicached-vllm worker: saved" in ln]
    assert lines, engine.log_path
    return lines[-1]


# Granite-4 hybrid: vLLM 0.32's CPU Mamba2 kernel cannot export the state at a block boundary
# inside one prefill chunk (IndexError in conv_ssm_forward, with or without a connector), so
# its engines run chunks of one block: every chunk ends at a block, where vLLM keeps a state.
GRANITE_BLOCK = 128
GRANITE_ARGS = {"max_num_batched_tokens": GRANITE_BLOCK, "enable_chunked_prefill": True}
G1 = tokens(21, 700)  # 5 full blocks
G2 = G1 + tokens(22, 40)
G_MID = G1[:300] + tokens(23, 40)  # leaves G1's chain in block 2: a state at block 2 exists


def test_granite_hybrid_cached_output_equals_uncached(models, tmp_path):
    d = DaemonProc(tmp_path, l2_size="512MiB", slab_size="8MiB").start()
    base = a = b = None
    try:
        base = Engine(tmp_path, "gbase", models["granite"], llm_args=GRANITE_ARGS, start=False)
        a = Engine(tmp_path, "ga", models["granite"], d.endpoint, llm_args=GRANITE_ARGS,
                   start=False)
        b = Engine(tmp_path, "gb", models["granite"], d.endpoint, llm_args=GRANITE_ARGS,
                   start=False)
        start_all(base, a, b)
        want = base.generate([G2, G_MID])
        base.close()
        assert a.one(G1)["cached"] == 0
        got = b.one(G2)
        assert got["cached"] >= 0.9 * (len(G1) // GRANITE_BLOCK * GRANITE_BLOCK), (got, b.tail())
        assert got["out"] == want[0]["out"]
        b.reset()  # vLLM's own cache would serve G_MID's prefix itself
        mid = b.one(G_MID)
        assert mid["cached"] == 2 * GRANITE_BLOCK, (mid, b.tail())
        assert mid["out"] == want[1]["out"]
    finally:
        for e in (base, a, b):
            if e is not None:
                e.close()
        d.cleanup()
