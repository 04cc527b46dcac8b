"""The engine with hicached as L2/L3, on real daemons: every hit source continues exactly.

Request A (a 40-token system prompt + 13 tokens) keeps states at 16, 32 and 48 and writes them
through to the daemon. A later prompt sharing the 40 system tokens can restore, from storage,
32 tokens on the hybrid model (the deepest stored state within the shared pages) and 40 on the
KV-only DSA model. Sources: L2 after the engine's own cache is flushed; L3 after the daemon's L2
is flushed; a new engine process; a restarted daemon. Each continuation must equal a live one
(and a full recompute for the gated-delta-net model); the leak identity holds after each.
"""

import json
import time

import pytest
import torch
from conftest import TEST_DEVICE, run_client_proc, wait_until

from hicached.engine.config import EngineConfig
from hicached.engine.engine import Engine
from hicached.engine.models import live_logits, load_model, recompute_logits

pytest.importorskip("transformers", reason="the reference engine needs the engine extra")

TOL = 1e-5
PS = 8
ARCHS = ["qwen3_next", "deepseek_v32"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # one torch thread: tiny models gain nothing from more, and on a shared 2-vCPU machine
    # spinning OpenMP threads make every forward several times slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {arch: load_model(arch, seed=0, path=str(tmp_path_factory.mktemp(arch)),
                             device=TEST_DEVICE)
           for arch in ARCHS}
    torch.set_num_threads(threads)


def toks(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYS = toks(40, 100)
A = SYS + toks(13, 1)


def prompt(seed):
    return SYS + toks(21, seed)


@pytest.fixture
def engine():
    """``engine(lm, daemon, **config)``; every engine made is closed after the test."""
    made = []

    def make(lm, daemon, **kw):
        kw = {"device": TEST_DEVICE, "page_size": PS, "kv_pages": 64, "state_slots": 24,
              "track_interval": 16, "debug_pools": True, "storage_backend": "hicached",
              "hicached_endpoint": daemon.endpoint, **kw}
        made.append(Engine(lm, EngineConfig(**kw)))
        return made[-1]

    yield make
    for e in made:
        e.close()


def storage_hit(lm):
    return 32 if lm.geometry.hybrid else 40


def assert_exact(lm, prompt_ids, output_ids, logits):
    want = live_logits(lm, prompt_ids, PS, output_ids[:-1])
    assert len(want) == len(logits)
    for got, ref in zip(logits, want):
        assert (got.to(ref.device) - ref).abs().max().item() <= TOL
    if lm.geometry.hybrid:
        full = recompute_logits(lm, prompt_ids)
        assert (logits[0].to(full.device) - full).abs().max().item() <= TOL


def check(lm, req, **hits):
    assert {k: req.hit_sources()[k] for k in hits} == hits
    assert_exact(lm, req.prompt, req.output_ids, req.logits)


def settle_l3(client):
    """Wait until the daemon's write-through to L3 has caught up with L2."""
    def done():
        s = client.stats()
        return s["l3_tier"]["jobs_in_flight"] == 0 and s["l3_writes"] >= s["l2_pages"]
    assert wait_until(done, 20)


@pytest.mark.parametrize("arch", ARCHS)
def test_l2_l1_l3_hits_continue_exactly(models, make_daemon, engine, arch):
    lm = models[arch]
    daemon = make_daemon()
    eng = engine(lm, daemon)
    a = eng.generate(A, 3)
    assert a.cached_tokens == 0 and eng.hicache.stored_pages == 6  # pages [0, 48)
    eng.flush_cache()
    assert eng.tree.cached_pages == 0
    check(lm, eng.generate(prompt(3), 3), l1=0, l2=storage_hit(lm), l3=0)
    eng.check_idle()
    # L1: the device holds [0, 32) (+ prompt 3's own pages): the hybrid model matches its KV
    # to 40 but resumes at 32, and keeps (and writes through) a state at the branch point 40
    check(lm, eng.generate(prompt(2), 3), l1=storage_hit(lm), l2=0, l3=0)

    with daemon.client() as admin:
        settle_l3(admin)
        admin.flush("l2")
        assert admin.stats()["l2_pages"] == 0
    eng.flush_cache()
    check(lm, eng.generate(prompt(4), 3), l1=0, l2=0, l3=40)
    eng.check_idle()


def test_a_load_past_the_device_match_reads_from_l3_only_the_pages_past_it(models, make_daemon,
                                                                          engine):
    """The device holds A's pages [0, 48) with a state at 48; another engine stored a longer
    prompt sharing them, [0, 72) with a state at 72, and the daemon's L2 lost everything (L3
    kept it). The engine asks hicached from its match on: the daemon reads from L3 the three
    pages past it and the state at their end, not the six pages the device holds too."""
    lm = models["qwen3_next"]
    daemon = make_daemon()
    eng, other = engine(lm, daemon), engine(lm, daemon)
    eng.generate(A, 3)
    longer = A[:48] + toks(27, 11)  # 75 tokens: whole pages [0, 72), states at 64 and 72
    other.generate(longer, 3)
    with daemon.client() as admin:
        settle_l3(admin)
        admin.flush("l2")
        before = admin.stats()["l3_loads"]
        r = eng.generate(longer + toks(4, 12), 3)
        loads = admin.stats()["l3_loads"] - before
    check(lm, r, l1=48, l2=0, l3=24)
    assert loads == 3 + 1, loads  # pages 6..8 and the state at 72 (asked from 0: 9 + 1)
    eng.check_idle()


ENGINE_PROC = """
import json, sys
import torch
torch.set_num_threads(1)
from hicached.engine.config import EngineConfig
from hicached.engine.engine import Engine
from hicached.engine.models import load_model
out = {}
for arch, path, endpoint, ids, device in json.loads(sys.argv[1]):
    lm = load_model(arch, path=path, device=device)
    eng = Engine(lm, EngineConfig(page_size=8, kv_pages=64, state_slots=24, track_interval=16,
                                  debug_pools=True, storage_backend="hicached",
                                  hicached_endpoint=endpoint, device=device))
    r = eng.generate(ids, 3)
    eng.check_idle()
    eng.close()
    out[arch] = {"hits": r.hit_sources(), "out": r.output_ids,
                 "logits": [x.tolist() for x in r.logits]}
print(json.dumps(out))
"""


def test_new_engine_process_hits_l2(models, make_daemon, engine):
    daemon = make_daemon()
    jobs = []
    for arch in ARCHS:
        lm = models[arch]
        engine(lm, daemon).generate(A, 3)
        jobs.append((arch, lm.path, daemon.endpoint, prompt(5), TEST_DEVICE))
    got = json.loads(run_client_proc(ENGINE_PROC, json.dumps(jobs), timeout_s=110))
    for arch in ARCHS:
        lm, res = models[arch], got[arch]
        assert res["hits"] == {"l1": 0, "l2": storage_hit(lm), "l3": 0,
                               "computed": 61 - storage_hit(lm)}
        assert_exact(lm, prompt(5), res["out"], [torch.tensor(x) for x in res["logits"]])


def test_restarted_daemon_serves_from_l3(models, make_daemon, engine):
    daemon = make_daemon()
    engines = {arch: engine(models[arch], daemon, storage_timeout_s=1.0, storage_retry_s=0.2)
               for arch in ARCHS}
    for eng in engines.values():
        eng.generate(A, 3)
    with daemon.client() as admin:
        settle_l3(admin)
    daemon.stop()
    eng, lm = engines["qwen3_next"], models["qwen3_next"]
    eng.flush_cache()
    down = eng.generate(prompt(6), 3)  # the daemon is gone: computed, never failed
    check(lm, down, l1=0, l2=0, l3=0)
    assert eng.storage.errors >= 1
    daemon.start()  # same state dir: the new daemon rescans its L3 directory
    time.sleep(0.2)  # past the engines' retry_s after the outage
    for arch, eng in engines.items():
        eng.flush_cache()
        r = eng.generate(prompt(7), 3)  # each engine's client re-joins the new daemon
        check(models[arch], r, l1=0, l2=0, l3=storage_hit(models[arch]))
        eng.check_idle()


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_write_policies(models, make_daemon, engine, policy):
    lm = models["qwen3_next"]
    daemon = make_daemon()
    eng = engine(lm, daemon, write_policy=policy, write_through_threshold=2)
    eng.generate(A, 3)
    with daemon.client() as admin:
        assert admin.stats()["l2_pages"] == 0  # neither policy stores on first insert
        if policy == "write_back":
            eng.flush_cache()  # eviction writes the nodes back before freeing them
        else:
            eng.generate(prompt(8), 3)  # a second hit on [0, 32) stores that path
            eng.flush_cache()
        assert wait_until(lambda: admin.stats()["l2_pages"] > 0)  # commits are fire-and-forget
    r = eng.generate(prompt(9), 3)
    check(lm, r, l1=0, l2=32, l3=0)
    eng.check_idle()


def test_tenants_do_not_share_pages(models, make_daemon, engine):
    lm = models["deepseek_v32"]
    daemon = make_daemon()
    engine(lm, daemon, tenant="a").generate(A, 2)
    assert engine(lm, daemon, tenant="b").generate(prompt(10), 2).cached_tokens == 0
    assert engine(lm, daemon, tenant="a").generate(prompt(11), 2).l2_tokens == 40


def test_same_weights_under_another_config_share_no_pages(models, make_daemon, engine,
                                                          tmp_path):
    """The same safetensors loaded with another RoPE base write other KV for the same tokens:
    an engine of that config must compute, never take the first config's pages (before the
    fix its namespace was the same and it continued from them, 0.1 off a live continuation)."""
    import os
    import shutil

    lm = models["deepseek_v32"]
    path = str(tmp_path / "rope")
    shutil.copytree(lm.path, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["rope_parameters"]["rope_theta"] *= 50
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    other = load_model("deepseek_v32", path=path, device=TEST_DEVICE)
    daemon = make_daemon()
    first = engine(lm, daemon)
    first.generate(A, 2)
    second = engine(other, daemon)
    assert second.namespace != first.namespace
    check(other, second.generate(prompt(12), 2), l1=0, l2=0, l3=0)
    second.check_idle()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefetch_stop_policies(models, make_daemon, engine, arch):
    """``timeout`` waits for the pages within its budget (here: all of them, exactly as
    wait_complete); ``best_effort`` keeps what arrived when the request runs, which may be
    nothing: either way the continuation is exact and nothing leaks."""
    lm = models[arch]
    daemon = make_daemon()
    writer = engine(lm, daemon)
    writer.generate(A, 3)
    timeout = engine(lm, daemon, prefetch_policy="timeout")
    check(lm, timeout.generate(prompt(10), 3), l1=0, l2=storage_hit(lm), l3=0)
    timeout.check_idle()
    best = engine(lm, daemon, prefetch_policy="best_effort")
    r = best.generate(prompt(11), 3)
    assert r.hit_sources()["l2"] in range(storage_hit(lm) + 1)
    assert_exact(lm, r.prompt, r.output_ids, r.logits)
    best.check_idle()
