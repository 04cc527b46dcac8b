"""The engine on its device cache (L1): exact continuations, predicted hits, eviction, leaks.

Page size 8, snapshots every 16 tokens, at the prompt end and at branching points. A prompt of n
tokens can take at most ``(n - 1) // 8 * 8`` tokens from the cache; on the hybrid model only up to
the deepest node that holds a state, on the KV-only (DSA) model up to the deepest matched page.
"""

import pytest
import torch
from conftest import TEST_DEVICE

from hicached.engine.config import EngineConfig
from hicached.engine.engine import Engine
from hicached.engine.models import live_logits, load_model, recompute_logits
from hicached.engine.request import Status

pytest.importorskip("transformers", reason="the reference engine needs the engine extra")

TOL = 1e-5
PS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # one torch thread: tiny models gain nothing from more, and on a shared 2-vCPU machine
    # spinning OpenMP threads make every forward several times slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {arch: load_model(arch, seed=0, path=str(tmp_path_factory.mktemp(arch)),
                             device=TEST_DEVICE)
           for arch in ("qwen3_next", "deepseek_v32")}
    torch.set_num_threads(threads)


def toks(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(lm, **kw):
    kw = {"device": TEST_DEVICE, "page_size": PS, "kv_pages": 64, "state_slots": 24,
          "track_interval": 16, "debug_pools": True, **kw}
    return Engine(lm, EngineConfig(**kw))


def assert_exact(lm, req):
    """Prompt-end and decode logits equal a live continuation (and a recompute for GDN)."""
    want = live_logits(lm, req.prompt, PS, req.output_ids[:-1])
    assert len(want) == len(req.logits)
    for got, ref in zip(req.logits, want):
        assert (got - ref).abs().max().item() <= TOL
    if lm.geometry.hybrid:
        for k in (0, len(req.logits) - 1):
            full = recompute_logits(lm, req.prompt + req.output_ids[:k])
            assert (req.logits[k] - full).abs().max().item() <= TOL


SYS = toks(40, 100)  # a shared system prompt: 5 pages


@pytest.mark.parametrize("arch", ["qwen3_next", "deepseek_v32"])
def test_l1_hits_continue_exactly(models, arch):
    lm = models[arch]
    eng = engine(lm)
    a = eng.generate(SYS + toks(13, 1), 4)
    assert a.cached_tokens == 0
    assert_exact(lm, a)
    b = eng.generate(SYS + toks(21, 2), 4)
    # hybrid: a's states sit at 16, 32, 48 (48 is past the shared 40); KV-only: any page
    assert b.cached_tokens == (32 if lm.geometry.hybrid else 40)
    assert b.hit_sources() == {"l1": b.cached_tokens, "l2": 0, "l3": 0,
                               "computed": 61 - b.cached_tokens}
    assert_exact(lm, b)
    c = eng.generate(SYS + toks(9, 3), 3)
    assert c.cached_tokens == 40  # b kept a state at its branching point, 40
    assert_exact(lm, c)
    turn2 = a.prompt + a.output_ids + toks(5, 4)  # a's next turn: 53 + 4 + 5 tokens
    d = eng.generate(turn2, 3)
    assert d.cached_tokens == 56  # a finished at 56 computed tokens, a page boundary
    assert_exact(lm, d)
    eng.check_idle()


def test_identical_prompt_and_full_recompute(models):
    lm = models["qwen3_next"]
    eng = engine(lm)
    p = toks(48, 5)
    first = eng.generate(p, 2)
    again = eng.generate(p, 2)
    assert again.cached_tokens == 40  # the last page holds the token that must run
    assert torch.equal(first.logits[0], again.logits[0])
    assert again.output_ids == first.output_ids
    eng.check_idle()


def test_lru_eviction_order_predicts_hits(models):
    eng = engine(models["qwen3_next"], kv_pages=24)
    p = [toks(41, 10 + i) for i in range(5)]  # each keeps 5 pages (40 tokens), runs in 6
    for i in range(4):
        assert eng.generate(p[i], 1).cached_tokens == 0
    assert eng.tree.cached_pages == 20 and eng.kv.allocator.available == 4
    assert eng.generate(p[0], 1).cached_tokens == 40  # p0 is now the most recent
    eng.generate(p[4], 1)  # needs 6 pages, 4 free: evicts p1's leaf [32,40), then [16,32)
    assert eng.generate(p[1], 1).cached_tokens == 16
    assert eng.generate(p[0], 1).cached_tokens == 40
    eng.check_idle()


def test_tombstones_cut_hits_until_a_branch_state(models):
    eng = engine(models["qwen3_next"])
    p = toks(41, 20)  # states at 16, 32 and 40
    eng.generate(p, 1)
    assert eng.tree.evict_states(2) == 2  # root end first: 16 and 32 become tombstones
    assert eng.generate(p, 1).cached_tokens == 40  # the leaf state still serves p
    q = p[:32] + toks(9, 21)
    r = eng.generate(q, 1)
    assert r.cached_tokens == 0  # only tombstones on q's path
    assert eng.generate(p[:32] + toks(9, 22), 1).cached_tokens == 32  # r's branch state
    eng.check_idle()


def test_concurrent_duplicates_and_aborts_keep_the_identity(models):
    lm = models["qwen3_next"]
    eng = engine(lm, kv_pages=40, state_slots=12)
    same = SYS + toks(12, 30)
    reqs = [eng.add_request(same, 3), eng.add_request(same, 3),  # computed twice at once
            eng.add_request(SYS + toks(30, 31), 5), eng.add_request(toks(60, 32), 2),
            eng.add_request(SYS + toks(7, 33), 4)]
    waiting = eng.add_request(SYS + toks(3, 35), 2)
    eng.abort(waiting.rid)  # before admission: nothing held yet
    assert waiting.status is Status.ABORTED and waiting not in eng.waiting
    steps = 0
    while eng.waiting or eng.running:
        eng.step()
        steps += 1
        if steps == 6:
            assert reqs[2].status is Status.PREFILL and reqs[2].pages
            eng.abort(reqs[2].rid)  # mid-prefill, holding pages and a lock
        if steps == 7:
            eng.abort(reqs[4].rid)
        eng.check_busy()
    assert reqs[0].output_ids == reqs[1].output_ids
    assert reqs[2].status is Status.ABORTED and reqs[0].status is Status.FINISHED
    assert not eng.abort(reqs[0].rid) and not eng.requests  # ended requests are forgotten
    assert_exact(lm, reqs[1])
    eng.check_idle()
    too_big = eng.generate(toks(400, 34), 2)  # 50 pages > 40: can never fit
    assert too_big.status is Status.ABORTED and "KV pages" in too_big.error
    eng.check_idle()
    eng.flush_cache()
    assert eng.kv.allocator.available == 40 and eng.states.allocator.available == 12
    eng.check_idle()


def test_out_of_memory_mid_run_aborts_cleanly(models):
    eng = engine(models["deepseek_v32"], kv_pages=12)
    a = eng.add_request(toks(40, 40), 40)  # needs 10 pages by the end
    b = eng.add_request(toks(40, 41), 40)  # admitted while a runs small, then starves
    eng.run()
    assert {a.status, b.status} <= {Status.FINISHED, Status.ABORTED}
    assert any(r.status is Status.ABORTED and "KV pages" in r.error for r in (a, b))
    eng.check_idle()


def test_disabled_radix_cache_never_hits(models):
    eng = engine(models["qwen3_next"], disable_radix_cache=True)
    p = SYS + toks(10, 50)
    eng.generate(p, 2)
    r = eng.generate(p, 2)
    assert r.cached_tokens == 0 and eng.tree.cached_pages == 0
    eng.check_idle()
    assert eng.kv.allocator.available == 64
