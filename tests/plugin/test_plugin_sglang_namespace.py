"""Which SGLang ranks and engines share pages through the plugin, on one real daemon.

Pages are shared exactly when their bytes would be identical: same model, revision, KV dtype,
page size, host layout, parallel slice and tenant salt (``hicached.plugin.namespace``). MLA KV is
the same on every TP rank (shared; only the writer rank writes it), Mamba state is per rank.
"""

import dataclasses
import json

import torch
from conftest import run_client_proc
from sglang_env import (
    PAGE,
    backup,
    idx,
    indexer_pool,
    keys_of,
    kv_bytes,
    kv_pool,
    load_kv,
    mamba_pool,
    page_hashes,
    storage_config,
    storage_namespace_seed,
)

from hicached import HostPool
from hicached.plugin.namespace import build_namespace


def mla_pool(seed=None):
    pool = HostPool.allocate_mla(32, PAGE, layers=2, kv_dim=16)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g))
    return pool


def test_models_ranks_dtypes_layouts_and_salts_never_share(sg, plugin, daemon):
    keys = keys_of("ns-", 4)
    base = {"model": "org/a", "tp_rank": 0, "tp_size": 2}
    w = plugin(daemon.endpoint, {"kv": kv_pool(seed=1)}, **base)
    assert w.batch_set_v1(keys, idx(0, 4)) == [True] * 4
    assert w.batch_exists(keys) == 4
    same = plugin(daemon.endpoint, {"kv": kv_pool()}, **base)
    assert same.batch_exists(keys) == 4  # control: another engine with the same slice hits
    others = {
        "model": ({"kv": kv_pool()}, dict(base, model="org/b")),
        "tp rank": ({"kv": kv_pool()}, dict(base, tp_rank=1)),
        "tp size": ({"kv": kv_pool()}, dict(base, tp_size=4)),
        "pp stage": ({"kv": kv_pool()}, dict(base, pp_rank=1, pp_size=2)),
        "cp rank": ({"kv": kv_pool()}, dict(base, cp_rank=1, cp_size=2)),
        "kv dtype": ({"kv": kv_pool(dtype=torch.float16)}, base),  # same page bytes
        "layout": ({"kv": kv_pool(layout="layer_first")}, base),
        "tenant salt": ({"kv": kv_pool()}, dict(base, extra={"namespace_salt": "t1"})),
        "revision": ({"kv": kv_pool()}, dict(base, extra={"model_revision": "r2"})),
    }
    seen = {w.namespace.namespace}
    for label, (pools, cfg) in others.items():
        b = plugin(daemon.endpoint, pools, **cfg)
        assert b.batch_exists(keys) == 0, label
        assert b.batch_get_v1(keys, idx(0, 4)) == [False] * 4, label
        seen.add(b.namespace.namespace)
    assert len(seen) == 1 + len(others)


def test_request_cache_salt_and_extra_key_seed_distinct_chains(sg, plugin, daemon):
    """SGLang seeds a chain's first page with storage_namespace_seed(extra_key, cache_salt); the
    plugin keeps keys opaque, so tenants and adapters never read each other's pages."""
    seed = storage_namespace_seed()  # SGLang's own function
    assert seed(None, None) is None  # unsalted requests keep the old, unseeded chains
    tokens = list(range(100, 116))
    chains = {
        "plain": page_hashes(tokens, PAGE),
        "salt a": page_hashes(tokens, PAGE, seed(None, "tenant-a")),
        "salt b": page_hashes(tokens, PAGE, seed(None, "tenant-b")),
        "lora": page_hashes(tokens, PAGE, seed("lora-1", None)),
        "lora + salt a": page_hashes(tokens, PAGE, seed("lora-1", "tenant-a")),
    }
    assert len({c[0] for c in chains.values()}) == len(chains)
    b = plugin(daemon.endpoint, {"kv": kv_pool(seed=2)})
    assert b.batch_set_v1(chains["salt a"], idx(0, 4)) == [True] * 4
    for label, chain in chains.items():
        assert b.batch_exists(chain) == (4 if label == "salt a" else 0), label


def test_mla_kv_is_shared_across_tp_ranks_mamba_is_per_rank(sg, plugin, daemon):
    hs = sg.hs
    n = 4
    keys = keys_of("mla-", n)
    pools0 = {"kv": mla_pool(seed=3), "mamba": mamba_pool(seed=4), "indexer": indexer_pool(seed=5)}
    pools1 = {"kv": mla_pool(), "mamba": mamba_pool(seed=6), "indexer": indexer_pool()}
    r0 = plugin(daemon.endpoint, pools0, mla=True, tp_rank=0, tp_size=2)
    r1 = plugin(daemon.endpoint, pools1, mla=True, tp_rank=1, tp_size=2)
    assert r0.namespace.namespace == r1.namespace.namespace
    assert "tp=replicated" in r0.namespace.namespace
    assert (r0.namespace.is_writer, r1.namespace.is_writer) == (True, False)

    def mamba(slot):
        return hs.PoolTransfer(name=hs.PoolName.MAMBA, host_indices=torch.tensor([slot]),
                               keys=keys[-1:], hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)

    # rank 0 (writer) backs up everything; rank 1 only its own Mamba state (SGLang's
    # should_backup), and a KV write it is asked for anyway is skipped, reported stored
    indexer = hs.PoolTransfer(name=hs.PoolName.INDEXER, host_indices=idx(0, n), keys=keys)
    assert backup(sg, r0, keys, idx(0, n), [mamba(0), indexer]) == n
    assert r1.batch_set_v2([mamba(3)]) == {"mamba": [True]}
    assert r1.batch_set_v1(keys, idx(0, n)) == [True] * n
    assert r1.batch_set_v2([indexer]) == {"indexer": [True] * n}
    assert r1.get_stats().counters["skipped_write_pages"] == 2 * n
    assert r0.batch_exists(keys) == n  # round trips: both ranks' commits were read
    query = [hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=["__placeholder__"],
                             hit_policy=hs.PoolHitPolicy.TRAILING_PAGES),
             hs.PoolTransfer(name=hs.PoolName.INDEXER, hit_policy=hs.PoolHitPolicy.ALL_PAGES)]
    hit = r1.batch_exists_v2(keys, query)
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (n, [n])
    assert load_kv(sg, r1, keys, idx(10, n), pools1["kv"], derived=[hs.PoolName.INDEXER]) == n
    assert torch.equal(kv_bytes(pools1["kv"], 10, n), kv_bytes(pools0["kv"], 0, n))
    assert torch.equal(pools1["indexer"].buffers[0][10:10 + n], pools0["indexer"].buffers[0][:n])
    assert r1.batch_get_v2([mamba(5)]) == {"mamba": [True]}
    for comp in pools1["mamba"].buffers:  # rank 1 got its own state, not rank 0's
        assert torch.equal(comp[5].view(torch.uint8), comp[3].view(torch.uint8))
    other_size = plugin(daemon.endpoint, {"kv": mla_pool(), "mamba": mamba_pool()}, mla=True,
                        tp_rank=1, tp_size=4)
    assert other_size.batch_exists(keys) == n  # replicated KV: any TP size
    assert other_size.batch_exists_v2(keys, query[:1]).kv_hit_pages == 0  # no state of its own


def test_dcp_shards_share_within_their_shard_only(sg):
    """Decode context parallelism: MLA KV is split into DCP shards; the equal shard of every
    DCP group shares pages, and its first rank (tp_rank == dcp_rank) writes them."""
    ns = {r: build_namespace(storage_config(sg, mla=True, tp_rank=r, tp_size=4, dcp_size=2,
                                            dcp_rank=r % 2, logical_page_size=8), kv_pool())
          for r in range(4)}
    assert ns[0].namespace == ns[2].namespace != ns[1].namespace == ns[3].namespace
    assert "tp=replicated,dcp1of2,tp4,lp8" in ns[1].namespace
    assert [ns[r].is_writer for r in range(4)] == [True, True, False, False]
    assert (ns[0].wire_pool("mamba", True), ns[2].wire_pool("mamba", True)) == (
        "mamba@tp0of4", "mamba@tp2of4")
    assert ns[2].wire_pool("indexer", False) == "indexer" and not ns[2].writes(False)
    assert ns[2].writes(True)
    mha = build_namespace(storage_config(sg, tp_rank=1, tp_size=2), kv_pool())
    assert mha.wire_pool("mamba", True) == "mamba" and mha.writes(False)
    assert "tp=tp1of2" in mha.namespace


NO_SGLANG = """
import json, sys
sys.modules["sglang"] = None  # as if SGLang were not installed
from types import SimpleNamespace
import torch
import hicached.plugin.sglang as m
from hicached import HostPool
from hicached.plugin.namespace import build_namespace
cfg = SimpleNamespace(tp_rank=0, tp_size=1, is_mla_model=False, is_page_first_layout=True,
                      model_name="old", extra_config={"endpoint": sys.argv[1]})  # oldest form
b = m.HicachedStorage(cfg, {})
kv = HostPool.allocate_mha(8, 4, layers=1, heads=1, head_dim=8, dtype=torch.float32)
b.register_mem_pool_host(kv)
b.on_host_pools_registered()
ok = b.batch_set_v1(["a", "b"], torch.arange(8))
res = b.batch_exists_v2(["a", "b", "c"])
print(json.dumps({"base": m._Base.__name__, "ok": ok, "result": type(res).__module__,
                  "hit": res.kv_hit_pages, "restorable": res.restorable_prefix_pages,
                  "ns": b.namespace.namespace}))
b.close()
"""


def test_plugin_works_without_sglang_and_with_the_oldest_config(daemon):
    out = json.loads(run_client_proc(NO_SGLANG, daemon.endpoint))
    assert out == {"base": "object", "ok": [True, True], "result": "hicached.types", "hit": 2,
                   "restorable": [1, 2],
                   "ns": "sglang|model=old|rev=|kv=float32|page=4|layout=page_first"
                         "|bytes=256|tp=tp0of1|pp=0of1|cp=0of1"}


def test_kv_pages_of_another_size_get_another_namespace():
    """One model with and without MTP draft layers packed into its KV pool: other page bytes,
    so another namespace (the daemon fixes a pool's page size per namespace)."""
    from types import SimpleNamespace
    cfg = SimpleNamespace(tp_rank=0, tp_size=1, is_mla_model=False, model_name="m")
    plain, packed = (HostPool.allocate_mha(8, 4, layers=n, heads=1, head_dim=8,
                                           dtype=torch.float32) for n in (2, 3))
    a, b = build_namespace(cfg, plain), build_namespace(cfg, packed)
    assert a.namespace != b.namespace
    assert "|bytes=512|" in a.namespace and "|bytes=768|" in b.namespace


def test_older_result_type_without_restorable_field(sg, plugin, daemon, monkeypatch):
    import hicached.plugin.sglang as m

    @dataclasses.dataclass
    class OldResult:  # PoolTransferResult before restorable_prefix_pages existed
        kv_hit_pages: int
        extra_pool_hit_pages: dict

    monkeypatch.setattr(m, "_Result", OldResult)
    monkeypatch.setattr(m, "_RESULT_HAS_RESTORABLE", False)
    b = plugin(daemon.endpoint, {"kv": kv_pool(seed=7)})
    b.batch_set_v1(["x"], idx(0, 1))
    assert b.batch_exists_v2(["x", "y"]) == OldResult(1, {"kv": 1})


def test_distinct_salts_and_model_names_never_give_one_namespace():
    """Separators in a component are escaped, not replaced: before the fix "tenant=1" and
    "tenant:1" (or models "org|x" and "org/x") gave one namespace, so those tenants shared
    pages."""
    from types import SimpleNamespace
    pool = HostPool.allocate_mha(8, 4, layers=2, heads=1, head_dim=8, dtype=torch.float32)

    def ns(model="m", **kw):
        cfg = SimpleNamespace(tp_rank=0, tp_size=1, is_mla_model=False, model_name=model)
        return build_namespace(cfg, pool, **kw).namespace

    salts = ["tenant=1", "tenant:1", "tenant%3D1", "tenant|1", "tenant/1", "tenant%7C1"]
    assert len({ns(namespace_salt=s) for s in salts}) == len(salts)
    models = ["org|x", "org/x", "org=x", "org:x", "org%7Cx"]
    assert len({ns(m) for m in models}) == len(models)
    assert ns("org/model") == ns(" org/model ")  # plain names are as they were
    assert "|model=org/model|" in ns("org/model")
