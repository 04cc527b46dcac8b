"""Tiny real hybrid models: geometry, reload, and state snapshots that continue exactly.

A prefix is prefilled page by page into the device pools, its recurrent state snapshotted at a page
boundary; a new cache rebuilt from those pages and a copy of the snapshot must continue (prompt
tail + decode) exactly like a live cache, and for the gated-delta-net model like a full recompute.
"""

import pytest
import torch
from conftest import TEST_DEVICE

from hicached.engine.cache_io import CacheIO
from hicached.engine.models import live_logits, load_model, recompute_logits
from hicached.engine.pools import IndexerPool, KVPool, StatePool

pytest.importorskip("transformers", reason="the reference engine needs the engine extra")

TOL = 1e-5  # CPU fp32


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


def tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_geometry_read_from_the_cache(models):
    q = models["qwen3_next"].geometry
    assert (q.kind, q.attn_layers, q.linear_layers, q.kv_heads, q.k_dim) == \
        ("mha", (1, 3), (0, 2), 2, 16)
    assert q.conv_shape == (1, 128, 4) and q.recurrent_shape == (1, 4, 16, 16) and q.hybrid
    d = models["deepseek_v32"].geometry
    assert (d.kind, d.attn_layers, d.kv_heads, d.k_dim, d.v_dim, d.indexer_dim) == \
        ("mla", (0, 1), 1, 32, 8, 16)
    assert not d.hybrid and d.has_indexer


def test_reload_is_bit_identical(models):
    lm = models["qwen3_next"]
    again = load_model("qwen3_next", path=lm.path, device=TEST_DEVICE)
    assert again.weights_digest == lm.weights_digest
    ids = tokens(20, 3)
    assert torch.equal(recompute_logits(again, ids), recompute_logits(lm, ids))
    other = load_model("qwen3_next", seed=1)
    assert other.weights_digest != lm.weights_digest


def pools_for(lm, page_size):
    g = lm.geometry
    kv = KVPool(g.kind, 16, page_size, len(g.attn_layers), g.kv_heads, g.k_dim, g.v_dim,
                g.kv_dtype, lm.device, debug=True)
    idx = IndexerPool(16, page_size, len(g.attn_layers), g.indexer_dim, g.kv_dtype,
                      lm.device) if g.has_indexer else None
    st = StatePool(4, len(g.linear_layers), g.conv_shape, g.recurrent_shape, g.state_dtype,
                   lm.device) if g.hybrid else None
    return CacheIO(g, lm.new_cache, kv, idx, st)


@pytest.mark.parametrize("arch", ["qwen3_next", "deepseek_v32"])
def test_snapshot_restore_continues_exactly(models, arch):
    lm, P = models[arch], 8
    io = pools_for(lm, P)
    hybrid = lm.geometry.hybrid
    ids = tokens(70, 1)  # a 48-token cached prefix, then 22 tokens (a partial last page)
    pages = list(range(9))
    live = io.build([], 0, 0 if hybrid else None, has_state=False)  # runs on slot 0
    for s in range(0, 48, P):
        lm.forward(ids[s : s + P], live)
        io.store(live, s, s + P, pages)
    if hybrid:
        io.states.copy(0, 1)  # the snapshot the tree would keep at token 48
        io.states.copy(1, 2)  # a new request's private copy of it
    restored = io.build(pages[:6], 48, 2 if hybrid else None, has_state=hybrid)
    for s in range(48, 70, P):
        logits = lm.forward(ids[s : s + P], restored)[-1]
    got, decoded = [logits], []
    for _ in range(3):
        decoded.append(int(got[-1].argmax()))
        got.append(lm.forward(decoded[-1:], restored)[-1])
    want = live_logits(lm, ids, P, decoded)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= TOL
    if hybrid:
        # the tree's snapshot (slot 1) is untouched by the continuation on the copy (slot 2)
        assert not torch.equal(io.states.temporal[1], io.states.temporal[2])
        for k in range(4):
            full = recompute_logits(lm, ids + decoded[:k])
            assert (got[k] - full).abs().max().item() <= TOL


@pytest.mark.parametrize("capacity", [70 + 3, 50])  # the request's tokens; too few: it grows
def test_a_reserved_cache_continues_bit_equal_to_a_growing_one(models, capacity):
    """``build(capacity=...)``: plain attention layers keep their KV in token-major buffers
    written in place (``ReservedLayer``); the logits and the pages stored from it are the
    bits of transformers' concatenating ``DynamicLayer``."""
    lm, P = models["qwen3_next"], 8
    runs = []
    for cap in (0, capacity):
        io = pools_for(lm, P)
        ids = tokens(70, 4)
        pages = list(range(9))
        live = io.build([], 0, 0, has_state=False)
        for s in range(0, 48, P):
            lm.forward(ids[s : s + P], live)
            io.store(live, s, s + P, pages)
        io.states.copy(0, 2)
        cache = io.build(pages[:6], 48, 2, has_state=True, capacity=cap)
        kinds = {type(cache.layers[i]).__name__ for i in lm.geometry.attn_layers}
        assert kinds == ({"ReservedLayer"} if cap else {"DynamicLayer"})
        got = []
        for s in range(48, 70, P):
            got.append(lm.forward(ids[s : s + P], cache)[-1])
            io.store(cache, s, min(70, s + P), pages)
        for _ in range(3):
            got.append(lm.forward([int(got[-1].argmax())], cache)[-1])
        assert cache.get_seq_length() == 73
        runs.append((got, io.kv.kv[:, :9].clone()))
    (a, pa), (b, pb) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(pa, pb)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_pool_read_into_a_reserved_buffer_holds_the_same_tokens(kind):
    """``KVPool.read(capacity=C)``: [1, heads, >= C, dim] views whose first T tokens are the
    plain read's, whatever the page order; the rest is room for the request's later tokens."""
    pool = KVPool(kind, 8, 4, 2, 3 if kind == "mha" else 1, 5, 5 if kind == "mha" else 2,
                  torch.float32, torch.device("cpu"))
    pool.kv.normal_(generator=torch.Generator().manual_seed(1))
    pages, t = [5, 2, 7], 10  # 12 tokens of pages, the last page partly used
    for cap in (10, 16, 64):
        for li in (0, 1):
            k0, v0 = pool.read(li, pages, t)
            k, v = pool.read(li, pages, t, capacity=cap)
            assert k.shape[2] >= cap and v.shape[2] >= cap
            assert k.shape[:2] == k0.shape[:2] and k.shape[3] == k0.shape[3]
            assert torch.equal(k[:, :, :t], k0) and torch.equal(v[:, :, :t], v0)
