"""Every SGLang 0.5.23 pool through the plugin, with SGLang's real host-pool classes.

The pools are SGLang's own classes built on CPU (``sglang_pools.py``); the plugin is made by
SGLang's real ``dynamic`` factory and driven as SGLang's controller drives it: sidecars through
``batch_set_v2`` then KV through ``batch_set_v1`` (backup); ``batch_exists_v2`` with each pool's
hit policy, KV batches with their KV-derived sidecars, then the trailing sidecars (prefetch).
Bytes are compared page by page with SGLang's own ``get_data_page``.
"""

import sys
import types

import pytest
import torch
from sglang_env import PAGE, hicache_file, keys_of, plugins
from sglang_pools import (
    dsa_indexer_pool,
    fill,
    logical_pool,
    mamba_pool,
    mha_pool,
    mla_pool,
    page_bytes,
    require_sglang_pools,
    v4_paged_pool,
    v4_state_pool,
)

ALL, TRAILING = "all_pages", "trailing_pages"


@pytest.fixture
def sgp():
    return require_sglang_pools()


@pytest.fixture
def plugin(sgp):
    with plugins(sgp) as make:
        yield make


def pool_table(sgp):
    """PoolName value -> (make a host pool of SGLang's class for it, the hit policy SGLang
    queries it with, shared by the TP ranks of an MLA model). One entry per PoolName: a pool
    SGLang adds fails ``test_every_sglang_pool_is_stored_restored_and_hit`` until it is here."""
    name = sgp.hs.PoolName
    anchor = mla_pool(sgp)  # DSA indexers take their slots and layout from the MLA KV pool

    def paged(pool):
        return lambda: v4_paged_pool(sgp, pool, pages=40)

    def state(pool):
        return lambda: v4_state_pool(sgp, pool, pages=40)

    return {
        "kv": (lambda: mla_pool(sgp), None, True),
        "mamba": (lambda: mamba_pool(sgp), TRAILING, False),
        "swa": (lambda: mla_pool(sgp, layers=1, label="swa"), TRAILING, True),
        "auxiliary_swa": (lambda: mha_pool(sgp, layers=1, label="aux"), TRAILING, False),
        "indexer": (lambda: dsa_indexer_pool(sgp, anchor), ALL, True),
        "draft": (lambda: mla_pool(sgp, layers=1, label="draft"), ALL, True),
        "draft_indexer": (lambda: dsa_indexer_pool(sgp, anchor, layers=1,
                                                   name=name.DRAFT_INDEXER), ALL, True),
        "draft_swa": (lambda: mha_pool(sgp, layers=1, label="draft_swa"), ALL, False),
        **{p: (paged(p), ALL, True) for p in (
            "deepseek_v4_c1", "deepseek_v4_c1_indexer", "deepseek_v4_c1_indexer_scale",
            "deepseek_v4_c2", "deepseek_v4_c2_indexer", "deepseek_v4_c2_indexer_scale",
            "deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c4_indexer_scale",
            "deepseek_v4_c128", "deepseek_v4_c4_rope", "deepseek_v4_c128_rope")},
        **{p: (state(p), TRAILING, True) for p in (
            "deepseek_v4_c4_state", "deepseek_v4_c4_indexer_state", "deepseek_v4_c128_state")},
    }


def slots(pool, first, n):
    """Host indices of ``n`` pages of ``pool`` from page ``first`` (token-granular)."""
    return torch.arange(first * pool.page_size, (first + n) * pool.page_size, dtype=torch.int64)


def test_every_sglang_pool_is_stored_restored_and_hit(sgp, plugin, daemon):
    hs = sgp.hs
    table = pool_table(sgp)
    assert set(table) == {p.value for p in hs.PoolName}  # a new SGLang pool: add it above
    n = 5
    keys = keys_of("all-", n)
    src = {p: fill(make(), seed) for seed, (p, (make, _, _)) in enumerate(table.items())}
    dst = {p: make() for p, (make, _, _) in table.items()}
    w = plugin(daemon.endpoint, src, mla=True, extra={"interface_v1": 1})
    for p, (_, _, shared) in table.items():
        assert w._sessions.wire(p) == (p if shared else f"{p}@tp0of1"), p

    def transfer(p, pool, first):
        trailing = table[p][1] == TRAILING and p != "swa"  # (SWA: its window, all pages here)
        ks = keys[-1:] if p == "mamba" else keys[-2:] if trailing else keys
        return hs.PoolTransfer(name=hs.PoolName(p), host_indices=slots(pool, first, len(ks)),
                               keys=ks, hit_policy=hs.PoolHitPolicy(table[p][1] or ALL))

    sidecars = [transfer(p, pool, 0) for p, pool in src.items() if p != "kv"]
    assert all(all(row) for row in w.batch_set_v2(sidecars).values())
    assert all(w.batch_set_v1(keys, slots(src["kv"], 0, n)))

    r = plugin(daemon.endpoint, dst, mla=True, extra={"interface_v1": 1})
    for p, (_, policy, _) in table.items():
        if p == "kv":
            continue
        query = [hs.PoolTransfer(name=hs.PoolName(p), keys=["_"] * (1 if p == "mamba" else 2),
                                 hit_policy=hs.PoolHitPolicy(policy))]
        hit = r.batch_exists_v2(keys, query)
        assert (hit.kv_hit_pages, hit.extra_pool_hit_pages.get(p)) == (n, n), (p, hit)
    everything = [hs.PoolTransfer(name=hs.PoolName(p), keys=["_"],
                                  hit_policy=hs.PoolHitPolicy(policy))
                  for p, (_, policy, _) in table.items() if p != "kv"]
    assert r.batch_exists_v2(keys, everything).restorable_prefix_pages[-1] == n

    first = {"mamba": 9}  # restore elsewhere in every pool
    assert r.batch_get_v1(keys, slots(dst["kv"], 20, n)) == [True] * n
    got = r.batch_get_v2([transfer(p, pool, first.get(p, 20)) for p, pool in dst.items()
                          if p != "kv"])
    assert all(all(row) for row in got.values()) and len(got) == len(table) - 1
    for p, pool in src.items():  # every stored page came back, byte for byte
        width = 1 if p == "mamba" else 2 if table[p][1] == TRAILING and p != "swa" else n
        at = first.get(p, 20) * pool.page_size
        assert torch.equal(page_bytes(dst[p], at, width), page_bytes(pool, 0, width)), p
    stats = r.get_stats().counters
    assert stats["errors"] == stats["unavailable"] == stats["unsupported_pool_pages"] == 0


def deepseek_v4_pools(sgp, seed=None):
    """DeepSeek V4's host pool group (GPU: C4 + C128 + their indexer, SWA rows, C4 compress
    states): the KV anchor is a ``LogicalHostPool`` without bytes."""
    pools = {"kv": logical_pool(sgp, pages=40), "swa": v4_paged_pool(sgp, "swa", pages=40)}
    for p in ("deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c128"):
        pools[p] = v4_paged_pool(sgp, p, pages=40, item_bytes=32 if "indexer" in p else 48)
    for p in ("deepseek_v4_c4_state", "deepseek_v4_c4_indexer_state"):
        pools[p] = v4_state_pool(sgp, p, pages=40)
    if seed is not None:
        for i, (p, pool) in enumerate(pools.items()):
            if p != "kv":
                fill(pool, seed + i)
    return pools


KV_DERIVED = ("deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c128")
SWA_DERIVED = ("deepseek_v4_c4_state", "deepseek_v4_c4_indexer_state")


def test_deepseek_v4_stores_restores_and_hits_as_sglangs_file_backend(sgp, plugin, daemon,
                                                                       tmp_path, monkeypatch):
    """DeepSeek V4 (rank-replicated): the byte-less KV anchor is stored as marker pages, so it
    gates the compressed pools as in SGLang's file backend; every answer equals HiCacheFile's
    on the same writes (trailing SWA windows with holes, a KV hole), and the pages restore."""
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    hs = sgp.hs
    src = deepseek_v4_pools(sgp, seed=40)
    ours = plugin(daemon.endpoint, src, mla=True, extra={"interface_v1": 1})
    assert ours._sessions.is_marker("kv") and "|bytes=0|" in ours.namespace.namespace
    theirs = hicache_file(sgp, tmp_path / "hicache-file", mla=True)
    for p, pool in src.items():
        theirs.register_mem_host_pool_v2(pool, hs.PoolName(p))
    keys, holed = keys_of("v4-", 8), keys_of("v4h-", 5)

    def tr(p, ks, first, policy=ALL):
        return hs.PoolTransfer(name=hs.PoolName(p), host_indices=slots(src[p], first, len(ks)),
                               keys=ks, hit_policy=hs.PoolHitPolicy(policy))

    def node(ks, first, window):
        """One backed-up radix node: its KV-derived pages, then its trailing SWA window."""
        side = [tr(p, ks, first) for p in KV_DERIVED]
        win = ks[-window:]
        side += [tr(p, win, first + len(ks) - window, TRAILING) for p in ("swa", *SWA_DERIVED)]
        return side

    for b in (ours, theirs):
        for ks, first, window in ((keys[:3], 0, 1), (keys[3:6], 3, 2), (keys[6:], 6, 2)):
            assert all(all(row) for row in b.batch_set_v2(node(ks, first, window)).values())
            assert b.batch_set(ks, [src["kv"].get_data_page(p * PAGE)
                                    for p in range(first, first + len(ks))])
        assert b.batch_set([holed[i] for i in (0, 1, 3, 4)],  # KV page 2 missing
                           [src["kv"].get_data_page(0)] * 4)
        assert all(all(row) for row in b.batch_set_v2(node(holed, 10, 2)).values())

    def query(window):
        return [hs.PoolTransfer(name=hs.PoolName(p), keys=["_"] * window,
                                hit_policy=hs.PoolHitPolicy(TRAILING))
                for p in ("swa", *SWA_DERIVED)] + [
            hs.PoolTransfer(name=hs.PoolName(p), indices_from_pool=hs.PoolName.KV)
            for p in KV_DERIVED]

    for chain in (keys, keys[:5], keys[:4], holed, keys[1:]):
        for window in (1, 2):
            a = ours.batch_exists_v2(chain, query(window), hs.HiCacheStorageExtraInfo())
            b = theirs.batch_exists_v2(chain, query(window), hs.HiCacheStorageExtraInfo())
            where = f"{chain[0]}..({len(chain)}) window {window}"
            assert (a.kv_hit_pages, a.restorable_prefix_pages) == (
                b.kv_hit_pages, b.restorable_prefix_pages), where
    hit = ours.batch_exists_v2(keys, query(2))
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (8, [6, 7, 8])  # SWA windows

    dst = deepseek_v4_pools(sgp)
    r = plugin(daemon.endpoint, dst, mla=True, extra={"interface_v1": 1})
    assert r.batch_exists_v2(keys, query(2)).restorable_prefix_pages == [6, 7, 8]
    assert r.batch_get_v1(keys, slots(dst["kv"], 20, 8)) == [True] * 8  # markers: presence
    derived = r.batch_get_v2([tr(p, keys, 20) for p in KV_DERIVED])
    assert all(all(row) for row in derived.values())
    trailing = r.batch_get_v2([tr(p, keys[-2:], 30, TRAILING) for p in ("swa", *SWA_DERIVED)])
    assert all(all(row) for row in trailing.values())
    for p in KV_DERIVED:
        assert torch.equal(page_bytes(dst[p], 20 * PAGE, 8), page_bytes(src[p], 0, 8)), p
    for p in ("swa", *SWA_DERIVED):
        assert torch.equal(page_bytes(dst[p], 30 * PAGE, 2), page_bytes(src[p], 6 * PAGE, 2)), p
    # the generic (v0) KV path: marker pages in, SGLang's empty flat pages out
    empty = [dst["kv"].get_dummy_flat_data_page() for _ in range(3)]
    got = r.batch_get([keys[0], "absent", keys[2]], empty)
    assert got[0] is empty[0] and got[1] is None and got[2] is empty[2]
    assert r.batch_set(["v0-marker"], [dst["kv"].get_data_page(0)]) is True
    assert r.batch_exists(["v0-marker"]) == 1
    assert r.get_stats().counters["errors"] == 0


def test_mla_ranks_share_replicated_pools_and_keep_mha_and_mamba_pools_apart(sgp, plugin,
                                                                             daemon):
    """An MLA model at TP 2 with a DSA indexer, an MLA MTP draft, Mamba state and an MHA draft:
    the MLA and DSA pools are one set of pages for both ranks (rank 0 writes them), Mamba and
    the MHA pool are per rank: rank 1 never sees rank 0's pages of them."""
    hs = sgp.hs
    n = 4
    keys = keys_of("mla2-", n)

    def pools(seed):
        anchor = mla_pool(sgp)
        made = {"kv": mla_pool(sgp), "indexer": dsa_indexer_pool(sgp, anchor),
                "draft": mla_pool(sgp, layers=1, label="draft"), "mamba": mamba_pool(sgp),
                "draft_swa": mha_pool(sgp, layers=1, label="draft_swa")}
        return {p: fill(pool, seed + i) for i, (p, pool) in enumerate(made.items())}

    p0, p1 = pools(50), pools(60)
    r0 = plugin(daemon.endpoint, p0, mla=True, tp_rank=0, tp_size=2, extra={"interface_v1": 1})
    r1 = plugin(daemon.endpoint, p1, mla=True, tp_rank=1, tp_size=2, extra={"interface_v1": 1})
    assert [r1._sessions.wire(p) for p in p1] == ["kv", "indexer", "draft", "mamba@tp1of2",
                                                  "draft_swa@tp1of2"]

    def tr(p, pools_, first, ks=keys, policy=ALL):
        return hs.PoolTransfer(name=hs.PoolName(p), host_indices=slots(pools_[p], first, len(ks)),
                               keys=ks, hit_policy=hs.PoolHitPolicy(policy))

    side0 = [tr(p, p0, 0) for p in ("indexer", "draft", "draft_swa")]
    side0.append(tr("mamba", p0, 0, keys[-1:], TRAILING))
    assert all(all(row) for row in r0.batch_set_v2(side0).values())
    assert all(r0.batch_set_v1(keys, slots(p0["kv"], 0, n)))
    # rank 1: SGLang backs up only Mamba on a non-writer rank; shared writes are skipped
    assert r1.batch_set_v2([tr("mamba", p1, 0, keys[-1:], TRAILING)]) == {"mamba": [True]}
    assert r1.batch_set_v2([tr("indexer", p1, 0)]) == {"indexer": [True] * n}  # (skipped)
    assert r0.batch_exists(keys) == n  # a round trip: rank 0's commits were read

    def query(*names):
        return [hs.PoolTransfer(name=hs.PoolName(p), keys=["_"],
                                hit_policy=hs.PoolHitPolicy(TRAILING if p == "mamba" else ALL))
                for p in names]

    shared = query("indexer", "draft", "mamba")
    assert r1.batch_exists_v2(keys, shared).restorable_prefix_pages == [n]
    assert r1.batch_exists_v2(keys, query("draft_swa")).kv_hit_pages == 0  # rank 0's: not ours
    assert r1.batch_get_v2([tr("draft_swa", p1, 20)]) == {"draft_swa": [False] * n}
    assert r1.batch_get_v1(keys, slots(p1["kv"], 20, n)) == [True] * n
    got = r1.batch_get_v2([tr("indexer", p1, 20), tr("draft", p1, 20),
                           tr("mamba", p1, 9, keys[-1:], TRAILING)])
    assert all(all(row) for row in got.values())
    for p in ("kv", "indexer", "draft"):  # rank 0's pages: the same bytes on every rank
        assert torch.equal(page_bytes(p1[p], 20 * PAGE, n), page_bytes(p0[p], 0, n)), p
    assert torch.equal(page_bytes(p1["mamba"], 9), page_bytes(p1["mamba"], 0))  # its own
    assert not torch.equal(page_bytes(p1["mamba"], 9), page_bytes(p0["mamba"], 0))
    # an MHA draft written by rank 1 itself (as SGLang does for Mooncake) hits on rank 1 only
    assert r1.batch_set_v2([tr("draft_swa", p1, 0)]) == {"draft_swa": [True] * n}
    assert r1.batch_exists_v2(keys, query("draft_swa")).kv_hit_pages == n
    assert r1.batch_get_v2([tr("draft_swa", p1, 24)]) == {"draft_swa": [True] * n}
    assert torch.equal(page_bytes(p1["draft_swa"], 24 * PAGE, n),
                       page_bytes(p1["draft_swa"], 0, n))
    assert not torch.equal(page_bytes(p1["draft_swa"], 24 * PAGE, n),
                           page_bytes(p0["draft_swa"], 0, n))
    r4 = plugin(daemon.endpoint, pools(70), mla=True, tp_rank=3, tp_size=4)
    assert r4.batch_exists_v2(keys, query("indexer", "draft")).kv_hit_pages == n  # any TP size


def test_a_pool_of_an_unknown_class_is_kept_per_rank(sgp, plugin, daemon):
    """When in doubt, per rank: an MLA model's pool whose host-pool class the plugin does not
    know is never shared across TP ranks (it may hold per-rank heads)."""
    class SomeFutureHostPool:  # SGLang's page surface over a real pool, under a new class name
        def __init__(self, pool):
            self._pool = pool
            self.page_size, self.size, self.layout = pool.page_size, pool.size, pool.layout
            self.dtype = pool.dtype

        def __getattr__(self, name):
            return getattr(self._pool, name)

    pools = {"kv": mla_pool(sgp), "swa": SomeFutureHostPool(fill(mla_pool(sgp, layers=1), 5))}
    b = plugin(daemon.endpoint, pools, mla=True, tp_rank=0, tp_size=2)
    assert b._sessions.wire("swa") == "swa@tp0of2" and b._sessions.writes("swa")
    shared = plugin(daemon.endpoint, {"kv": mla_pool(sgp), "swa": mla_pool(sgp, layers=1)},
                    mla=True, tp_rank=1, tp_size=2)
    assert shared._sessions.wire("swa") == "swa" and not shared._sessions.writes("swa")


LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def real_pools(sgp, layout):
    """name -> a real SGLang host pool of every class the plugin may get, in ``layout``."""
    anchor = mla_pool(sgp, layout=layout)
    made = {"mha": mha_pool(sgp, layout=layout), "mla": anchor,
            "dsa_indexer": dsa_indexer_pool(sgp, anchor),
            "v4_paged": v4_paged_pool(sgp, "deepseek_v4_c4", layout=layout),
            "v4_state": v4_state_pool(sgp, "deepseek_v4_c4_state", layout=layout)}
    if layout != "layer_first":  # (SGLang's Mamba host pool has page-first layouts only)
        made["mamba"] = mamba_pool(sgp, layout=layout)
    return made


@pytest.mark.parametrize("layout", LAYOUTS)
def test_real_pools_put_their_flat_page_into_the_arena(sgp, layout):
    """The client's page path for each of SGLang's host-pool classes lays a page out in the
    arena as the pool's own flat data page (so any path, any engine, reads it back), and
    restores it byte for byte; every class gets the pointer (memmove) path where SGLang gives
    page pointers for the layout (not the DSA indexer's layer_first: the flat path)."""
    from hicached.client.hostpool import make_page_io

    for label, pool in real_pools(sgp, layout).items():
        fill(pool, 7)
        io = make_page_io(pool)
        flat = label == "dsa_indexer" and layout == "layer_first"
        assert io.path == ("flat" if flat else "pointer"), label
        at, to = 3 * pool.page_size, 5 * pool.page_size
        arena = torch.zeros(2 * io.page_bytes, dtype=torch.uint8)
        io.to_arena([at], arena, [io.page_bytes])
        assert torch.equal(arena[io.page_bytes:], page_bytes(pool, at)), label
        io.from_arena([to], arena, [io.page_bytes])
        assert torch.equal(page_bytes(pool, to), page_bytes(pool, at)), label


def test_fp8_kv_formats_never_share_pages(sgp, plugin, daemon, caplog):
    """SGLang stores every fp8 KV cache as uint8 (``store_dtype``), so its host pools of an
    fp8_e4m3 and an fp8_e5m2 deployment of one model look alike: the same dtype, page bytes,
    layout and model name. ``kv_cache_dtype`` in extra_config (the engine's --kv-cache-dtype)
    tells them apart (before the fix it was ignored and e5m2 engines read e4m3 pages); a uint8
    KV pool without it is warned about."""
    keys = keys_of("fp8-", 2)
    src = mha_pool(sgp, dtype=torch.uint8)  # what SGLang hands the host pool for any fp8
    fill(src, seed=8)
    e4m3 = plugin(daemon.endpoint, {"kv": src}, extra={"kv_cache_dtype": "fp8_e4m3"})
    assert e4m3.batch_set_v1(keys, torch.arange(2 * PAGE)) == [True, True]
    same = plugin(daemon.endpoint, {"kv": mha_pool(sgp, dtype=torch.uint8)},
                  extra={"kv_cache_dtype": "fp8_e4m3"})
    assert same.batch_exists(keys) == 2  # control: the same format hits
    e5m2 = plugin(daemon.endpoint, {"kv": mha_pool(sgp, dtype=torch.uint8)},
                  extra={"kv_cache_dtype": "fp8_e5m2"})
    assert e5m2.namespace.namespace != e4m3.namespace.namespace
    assert e5m2.batch_exists(keys) == 0
    with caplog.at_level("WARNING", logger="hicached.plugin.namespace"):
        plugin(daemon.endpoint, {"kv": mha_pool(sgp, dtype=torch.uint8)})
    assert "kv_cache_dtype" in caplog.text


def test_the_fp8_format_is_read_from_sglangs_server_args(sgp, plugin, daemon, monkeypatch,
                                                         caplog):
    """Inside SGLang the plugin needs no extra_config: the scheduler process published its
    server args (``sglang.srt.runtime_context``), whose ``kv_cache_dtype`` names the format.
    That module needs all of SGLang's dependencies, so a stand-in with the same call holds the
    value here; without it (outside SGLang) the warning stays."""
    context = types.ModuleType("sglang.srt.runtime_context")
    args = types.SimpleNamespace(kv_cache_dtype="fp8_e5m2")
    context.get_server_args = lambda: args
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", context)
    keys = keys_of("fp8auto-", 2)
    src = mha_pool(sgp, dtype=torch.uint8)
    fill(src, seed=9)
    with caplog.at_level("WARNING", logger="hicached.plugin.namespace"):
        e5m2 = plugin(daemon.endpoint, {"kv": src})
    assert "kv_cache_dtype" not in caplog.text
    assert "|kvfmt=fp8_e5m2|" in e5m2.namespace.namespace
    assert e5m2.batch_set_v1(keys, torch.arange(2 * PAGE)) == [True, True]
    explicit = plugin(daemon.endpoint, {"kv": mha_pool(sgp, dtype=torch.uint8)},
                      extra={"kv_cache_dtype": "fp8_e5m2"})
    assert explicit.batch_exists(keys) == 2  # the same format, however it was learnt
    args.kv_cache_dtype = "fp8_e4m3"
    assert plugin(daemon.endpoint, {"kv": mha_pool(sgp, dtype=torch.uint8)}).batch_exists(keys) == 0
    args.kv_cache_dtype = "auto"  # resolved by SGLang from the checkpoint later: not known here
    caplog.clear()
    with caplog.at_level("WARNING", logger="hicached.plugin.namespace"):
        auto = plugin(daemon.endpoint, {"kv": mha_pool(sgp, dtype=torch.uint8)})
    assert "kvfmt" not in auto.namespace.namespace and "kv_cache_dtype" in caplog.text
