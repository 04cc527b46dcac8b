"""The SGLang plugin against SGLang's real storage ABC, factory and file backend, on real daemons.

Every test drives ``HicachedStorage`` the way SGLang 0.5.23 does (engine-plugins.md §1.4):
``StorageBackendFactory.create_backend("dynamic", ...)``, the attach registrations, backup
(sidecars through ``batch_set_v2`` first, then KV in 128-page batches through ``batch_set`` or
``batch_set_v1``) and prefetch (``batch_exists_v2``, KV batches with their KV-derived sidecars,
then the trailing sidecars with their real keys).
"""

import signal
import sys
import threading
import time

import pytest
import torch
from conftest import age_heartbeat, sigstop, wait_until
from sglang_env import (
    PAGE,
    SGLangLikePool,
    backup,
    hicache_file,
    idx,
    indexer_pool,
    keys_of,
    kv_bytes,
    kv_pool,
    load_kv,
    mamba_pool,
    storage_metrics_module,
    swa_pool,
)

from hicached.presence import STALE_S

# ---------------------------------------------------------------- tests


def test_factory_builds_the_plugin_as_sglang_does(sg, plugin, daemon):
    pools = {"kv": kv_pool()}
    backend = plugin(daemon.endpoint, pools, model="org/model-a")
    assert isinstance(backend, sg.hs.HiCacheStorage)
    assert type(backend).__name__ == "HicachedStorage"
    assert backend.namespace.namespace == (
        "sglang|model=org/model-a|rev=|kv=bfloat16|page=4|layout=page_first|bytes=512"
        "|tp=tp0of1|pp=0of1|cp=0of1")
    assert backend.get_stats().counters["errors"] == 0
    backend.close()
    backend.close()  # idempotent


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_kv_bytes_roundtrip_generic_v0_path(sg, plugin, daemon, layout):
    keys = keys_of("v0-", 130)  # two STORAGE_BATCH_SIZE batches
    src, dst = kv_pool(layout=layout, seed=1), kv_pool(layout=layout)
    writer = plugin(daemon.endpoint, {"kv": src})
    assert backup(sg, writer, keys, idx(0, 130), v1=False, kv_pool_=src) == 130
    assert writer.batch_exists(keys) == 130  # a round trip: the commits were read before it
    reader = plugin(daemon.endpoint, {"kv": dst})  # another engine, same model
    assert reader.batch_exists(keys, sg.hs.HiCacheStorageExtraInfo()) == 130
    assert reader.exists(keys[5]) and not reader.exists("nope")
    assert load_kv(sg, reader, keys, idx(20, 130), dst, v1=False) == 130
    assert torch.equal(kv_bytes(dst, 20, 130), kv_bytes(src, 0, 130))
    one = dst.get_dummy_flat_data_page()
    assert reader.get(keys[7], one) is one
    assert torch.equal(one.view(torch.uint8), src.get_data_page(7 * PAGE).view(torch.uint8))
    assert reader.get("missing", dst.get_dummy_flat_data_page()) is None
    assert reader.set("single", src.get_data_page(0)) is True
    for b in (writer, reader):
        assert b.get_stats().counters["errors"] == 0
        b.close()


@pytest.mark.parametrize("duck_typed", [False, True])
def test_kv_bytes_roundtrip_v1_path(sg, plugin, daemon, duck_typed):
    keys = keys_of("v1-", 130)
    src, dst = kv_pool(seed=2), kv_pool()
    wrap = SGLangLikePool if duck_typed else (lambda p: p)
    writer = plugin(daemon.endpoint, {"kv": wrap(src)}, extra={"interface_v1": 1})
    assert backup(sg, writer, keys, idx(0, 130)) == 130
    assert writer.batch_exists(keys) == 130  # a round trip: the commits were read before it
    reader = plugin(daemon.endpoint, {"kv": wrap(dst)}, extra={"interface_v1": 1})
    # pages 0..129 from host page 30 on, in reverse slot order: any host indices work
    host = torch.cat([idx(30 + 129 - i, 1) for i in range(130)])
    assert load_kv(sg, reader, keys, host, dst) == 130
    for i in range(130):
        assert torch.equal(kv_bytes(dst, 30 + 129 - i, 1), kv_bytes(src, i, 1))
    assert reader.batch_get_v1(["a", keys[0]], idx(0, 2)) == [False, True]
    writer.close()
    reader.close()


def test_hybrid_backup_and_prefetch_restore_kv_mamba_indexer(sg, plugin, daemon):
    hs = sg.hs
    n = 6
    keys = keys_of("hy-", n)
    src = {"kv": kv_pool(seed=3), "mamba": mamba_pool(seed=4), "indexer": indexer_pool(seed=5)}
    dst = {"kv": kv_pool(), "mamba": mamba_pool(), "indexer": indexer_pool()}
    w = plugin(daemon.endpoint, src, extra={"interface_v1": 1})
    sidecars = [
        hs.PoolTransfer(name=hs.PoolName.MAMBA, host_indices=torch.tensor([6]), keys=keys[-1:],
                        hit_policy=hs.PoolHitPolicy.TRAILING_PAGES),
        hs.PoolTransfer(name=hs.PoolName.INDEXER, host_indices=idx(0, n), keys=keys,
                        indices_from_pool=hs.PoolName.KV),
    ]
    assert backup(sg, w, keys, idx(0, n), sidecars) == n
    assert w.batch_exists(keys) == n  # a round trip: the commits were read before it
    r = plugin(daemon.endpoint, dst, extra={"interface_v1": 1})
    query = [hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=["__placeholder__"],
                             hit_policy=hs.PoolHitPolicy.TRAILING_PAGES),
             hs.PoolTransfer(name=hs.PoolName.INDEXER, hit_policy=hs.PoolHitPolicy.ALL_PAGES,
                             indices_from_pool=hs.PoolName.KV)]
    hit = r.batch_exists_v2(keys, query, hs.HiCacheStorageExtraInfo(prefix_keys=None))
    assert isinstance(hit, hs.PoolTransferResult)
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (n, [n])
    assert hit.extra_pool_hit_pages == {"kv": n, "mamba": n, "indexer": n}
    assert load_kv(sg, r, keys, idx(40, n), dst["kv"], derived=[hs.PoolName.INDEXER]) == n
    got = r.batch_get_v2([hs.PoolTransfer(name=hs.PoolName.MAMBA, host_indices=torch.tensor([1]),
                                          keys=keys[-1:],
                                          hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)])
    assert got == {"mamba": [True]}
    assert torch.equal(kv_bytes(dst["kv"], 40, n), kv_bytes(src["kv"], 0, n))
    assert torch.equal(dst["indexer"].buffers[0][40:40 + n], src["indexer"].buffers[0][0:n])
    for a, b in zip(dst["mamba"].buffers, src["mamba"].buffers, strict=True):
        assert torch.equal(a[1].view(torch.uint8), b[6].view(torch.uint8))
    w.close()
    r.close()


EXISTS_QUERIES = {
    "kv only": [],
    "mamba N=1": [("mamba", "trailing_pages", 1)],
    "mamba N=2": [("mamba", "trailing_pages", 2)],
    "indexer": [("indexer", "all_pages", 0)],
    "mamba+indexer": [("mamba", "trailing_pages", 1), ("indexer", "all_pages", 0)],
    "indexer+mamba": [("indexer", "all_pages", 0), ("mamba", "trailing_pages", 1)],
    "swa N=1": [("swa", "trailing_pages", 1)],
    "swa N=2": [("swa", "trailing_pages", 2)],
    "swa N=2+mamba": [("swa", "trailing_pages", 2), ("mamba", "trailing_pages", 1)],
    "mamba N=3+indexer": [("mamba", "trailing_pages", 3), ("indexer", "all_pages", 0)],
}


def test_exists_v2_equals_sglang_file_backend(sg, plugin, daemon, tmp_path, monkeypatch):
    """Same pages written to both; every query answered identically (trailing-pool holes,
    windows, ALL_PAGES bounds, a KV hole, keys past the stored prefix)."""
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    hs = sg.hs
    pools = {"kv": kv_pool(seed=6), "mamba": mamba_pool(seed=7), "indexer": indexer_pool(seed=8),
             "swa": swa_pool(seed=9)}
    ours = plugin(daemon.endpoint, pools)
    theirs = hicache_file(sg, tmp_path / "hicache-file")
    for name, pool in pools.items():
        theirs.register_mem_host_pool_v2(pool, hs.PoolName(name))
    keys = keys_of("chain-", 8)
    holed = keys_of("holed-", 5)

    def tr(name, keys_, page_list=None, policy="all_pages"):
        per = 1 if name == "mamba" else PAGE
        pages = page_list if page_list is not None else range(len(keys_))
        host = torch.cat([torch.arange(p * per, (p + 1) * per) for p in pages])
        return hs.PoolTransfer(name=hs.PoolName(name), host_indices=host, keys=keys_,
                               hit_policy=hs.PoolHitPolicy(policy))

    for b in (ours, theirs):
        # KV pages 0..5 of `keys`; pages 0,1,3,4 of `holed` (2 missing)
        assert b.batch_set(keys[:6], [pools["kv"].get_data_page(p * PAGE) for p in range(6)])
        assert b.batch_set([holed[i] for i in (0, 1, 3, 4)],
                           [pools["kv"].get_data_page(p * PAGE) for p in range(4)])
        side = [tr("mamba", [keys[i] for i in (1, 3, 5, 7)], [0, 1, 2, 3], "trailing_pages"),
                tr("indexer", keys[:4]),
                tr("swa", [keys[i] for i in (2, 3, 4)], [2, 3, 4], "trailing_pages")]
        assert all(all(v) for v in b.batch_set_v2(side).values())
        assert b.batch_set_v2([tr("mamba", holed[:1], [5], "trailing_pages")]) == {
            "mamba": [True]}

    compared = 0
    for chain in (keys, keys[:5], holed, keys[1:]):
        for label, spec in EXISTS_QUERIES.items():
            query = [hs.PoolTransfer(name=hs.PoolName(n), keys=["__placeholder__"] * max(1, w),
                                     hit_policy=hs.PoolHitPolicy(p)) for n, p, w in spec]
            a = ours.batch_exists_v2(chain, query, hs.HiCacheStorageExtraInfo())
            b = theirs.batch_exists_v2(chain, query, hs.HiCacheStorageExtraInfo())
            where = f"{label} over {chain[0]}..({len(chain)})"
            assert a.kv_hit_pages == b.kv_hit_pages, where
            assert a.restorable_prefix_pages == b.restorable_prefix_pages, where
            if b.restorable_prefix_pages:
                assert a.extra_pool_hit_pages == b.extra_pool_hit_pages, where
            else:  # HiCacheFile stops counting pools once nothing is restorable
                assert b.extra_pool_hit_pages.items() <= a.extra_pool_hit_pages.items(), where
            compared += 1
    assert compared == 40
    spot = ours.batch_exists_v2(keys, [hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=["x"],
                                                       hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)])
    assert (spot.kv_hit_pages, spot.restorable_prefix_pages) == (6, [2, 4, 6])  # the holes
    ours.close()


def test_unregistered_pools_and_bad_input_answer_misses(sg, plugin, daemon):
    hs = sg.hs
    keys = keys_of("u-", 3)
    b = plugin(daemon.endpoint, {"kv": kv_pool(seed=11), "indexer": indexer_pool()})
    assert all(b.batch_set_v1(keys, idx(0, 3)))
    never = hs.PoolTransfer(name=hs.PoolName.DRAFT_SWA, host_indices=idx(0, 3), keys=keys)
    assert b.batch_set_v2([never]) == {"draft_swa": [False] * 3}
    assert b.batch_get_v2([never]) == {"draft_swa": [False] * 3}
    res = b.batch_exists_v2(keys, [hs.PoolTransfer(name=hs.PoolName.DRAFT_SWA, keys=keys)])
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (0, [])
    blocks = hs.PoolTransfer(name=hs.PoolName.INDEXER, keys=keys,
                             hit_policy=hs.PoolHitPolicy.BLOCK_GROUPS)
    assert b.batch_exists_v2(keys, [blocks]).kv_hit_pages == 0
    short = hs.PoolTransfer(name=hs.PoolName.INDEXER, host_indices=idx(0, 2), keys=keys)
    assert b.batch_set_v2([short]) == {"indexer": [False] * 3}  # 3 keys, 2 pages of indices
    assert b.batch_get_v1(keys, idx(0, 2)) == [False] * 3
    assert b.batch_set(keys[:1], None) is False
    st = b.get_stats().counters
    assert st["unsupported_pool_pages"] >= 6 and st["unavailable"] == 0
    b.close()


def test_a_speculative_draft_pool_is_stored_and_restored_with_the_kv(sg, plugin, daemon):
    """EAGLE's draft KV (SGLang's SIDECAR draft pool) rides with every prefetch query: it must hit
    like the KV, or every prefetch hit would be 0."""
    hs = sg.hs
    keys = keys_of("dr-", 5)
    src, back = kv_pool(seed=30), kv_pool(seed=31)
    b = plugin(daemon.endpoint, {"kv": kv_pool(seed=32), "draft": src})
    draft_t = hs.PoolTransfer(name=hs.PoolName.DRAFT, host_indices=idx(0, 5), keys=keys)
    assert all(b.batch_set_v1(keys, idx(0, 5)))
    assert b.batch_set_v2([draft_t]) == {"draft": [True] * 5}
    res = b.batch_exists_v2(keys, [hs.PoolTransfer(name=hs.PoolName.DRAFT, keys=keys)])
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (5, [1, 2, 3, 4, 5])
    b.register_mem_host_pool_v2(back, hs.PoolName.DRAFT)
    assert b.batch_get_v2([draft_t]) == {"draft": [True] * 5}
    for p in range(5):
        assert torch.equal(back.get_data_page(p * back.page_size).view(torch.int16),
                           src.get_data_page(p * src.page_size).view(torch.int16))  # (NaNs)
    b.close()


def test_daemon_down_or_slow_is_a_counted_miss(sg, plugin, make_daemon, tmp_path):
    hs = sg.hs
    endpoint = f"ipc://{tmp_path}/late.sock"
    keys = keys_of("d-", 4)
    src = kv_pool(seed=12)
    b = plugin(endpoint, {"kv": src, "mamba": mamba_pool(seed=13)},
                      extra={"timeout_s": 0.5, "retry_interval_s": 0.2})  # attach: no raise
    mamba_t = hs.PoolTransfer(name=hs.PoolName.MAMBA, host_indices=torch.tensor([0]),
                              keys=keys[-1:], hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, idx(0, 4)) == [False] * 4
    assert b.batch_get_v1(keys, idx(0, 4)) == [False] * 4
    assert b.batch_set(keys, [src.get_data_page(0)] * 4) is False
    assert b.batch_get(keys, [src.get_dummy_flat_data_page()] * 4) == [None] * 4
    assert b.batch_set_v2([mamba_t]) == {"mamba": [False]}
    assert b.batch_exists_v2(keys, [mamba_t]).kv_hit_pages == 0
    assert b.clear() is False
    st = b.get_stats().counters
    assert st["episodes"] == 1 and st["unavailable"] >= 8 and st["errors"] == 0

    d = make_daemon(name="late")
    time.sleep(0.25)  # past retry_interval_s
    assert b.batch_set_v1(keys, idx(0, 4)) == [True] * 4
    assert b.batch_exists(keys) == 4
    sigstop(d.proc.pid)  # alive but not answering: slow = miss
    try:
        age_heartbeat(d, STALE_S + 0.1)  # the table's heartbeat is stale: exists ask the socket
        t = time.monotonic()
        assert b.batch_exists(keys) == 0
        assert time.monotonic() - t < 3.0
        t = time.monotonic()  # then misses at once, not one timeout each (retry_interval_s)
        assert [b.batch_exists(keys) for _ in range(5)] == [0] * 5
        assert time.monotonic() - t < 0.1
    finally:
        d.proc.send_signal(signal.SIGCONT)
    time.sleep(0.25)
    assert b.batch_exists(keys) == 4
    d.stop(signal.SIGKILL)  # died: its socket file stays behind; calls miss at once
    age_heartbeat(d, STALE_S + 0.1)  # (once its table's heartbeat is stale: exists ask the socket)
    t = time.monotonic()
    for _ in range(3):
        assert b.batch_exists(keys) == 0
        time.sleep(0.45)  # past the first backoffs: each retry finds nobody at once
    assert time.monotonic() - t < 3 * 0.45 + 0.3
    d.start()  # restart: pages in L3 come back, the session is re-joined
    assert wait_until(lambda: b.batch_exists(keys) == 4, 5)  # after the backoff (< 1.6 s)
    assert b.batch_set_v2([mamba_t]) == {"mamba": [True]}
    st = b.get_stats().counters
    assert st["episodes"] >= 2 and st["errors"] == 0
    b.close()
    assert b.batch_exists(keys) == 0  # closed: a miss, not an exception


def test_threads_share_one_plugin(sg, plugin, daemon):
    """SGLang's backup thread and prefetch threads call one backend instance at once: each thread
    here backs pages up from its own host region and restores them into another region of the
    same pools, as SGLang does."""
    hs = sg.hs
    pools = {"kv": kv_pool(num_pages=200, seed=14), "mamba": mamba_pool(seed=15),
             "indexer": indexer_pool(num_pages=200, seed=16)}
    b = plugin(daemon.endpoint, pools, extra={"interface_v1": 1})
    b.register_mem_host_pool_v2(kv_pool(), hs.PoolName.AUXILIARY_SWA)  # unused, harmless
    errors = []

    def work(t):
        try:
            for rnd in range(6):
                keys = keys_of(f"t{t}r{rnd}-", 5)
                first = t * 20 + rnd
                side = [hs.PoolTransfer(name=hs.PoolName.MAMBA, host_indices=torch.tensor([t]),
                                        keys=keys[-1:], hit_policy=hs.PoolHitPolicy.TRAILING_PAGES),
                        hs.PoolTransfer(name=hs.PoolName.INDEXER, host_indices=idx(first, 5),
                                        keys=keys)]
                assert backup(sg, b, keys, idx(first, 5), side) == 5
                q = [hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=["p"],
                                     hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)]
                assert b.batch_exists_v2(keys, q).kv_hit_pages == 5
                assert load_kv(sg, b, keys, idx(100 + t * 20, 5), pools["kv"],
                               derived=[hs.PoolName.INDEXER]) == 5
                assert torch.equal(kv_bytes(pools["kv"], 100 + t * 20, 5),
                                   kv_bytes(pools["kv"], first, 5))
                assert torch.equal(pools["indexer"].buffers[0][100 + t * 20:105 + t * 20],
                                   pools["indexer"].buffers[0][first:first + 5])
                got = b.batch_get_v2([hs.PoolTransfer(
                    name=hs.PoolName.MAMBA, host_indices=torch.tensor([4 + t]), keys=keys[-1:],
                    hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)])
                assert got == {"mamba": [True]}
                b.get_stats()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for a, c in zip(pools["mamba"].buffers[0][4:8], pools["mamba"].buffers[0][0:4], strict=True):
        assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))
    counters = b.get_stats().counters
    assert counters["errors"] == 0 and counters["unavailable"] == 0
    assert counters["written_pages"] == 4 * 6 * (5 + 5 + 1)


def test_storage_metrics_are_drained_per_call(sg, plugin, daemon):
    keys = keys_of("m-", 8)
    b = plugin(daemon.endpoint, {"kv": kv_pool(seed=17)}, metrics=True)
    b.batch_set_v1(keys, idx(0, 8))
    b.batch_get_v1(keys, idx(10, 8))
    st = b.get_stats()
    assert st.backup_pgs == [8] and st.prefetch_pgs == [8]
    assert st.backup_bandwidth[0] > 0 and st.prefetch_bandwidth[0] > 0
    assert st.counters["written_pages"] == 8 and st.counters["read_hit_pages"] == 8
    again = b.get_stats()
    assert again.backup_pgs == [] and again.counters["written_pages"] == 8
    with daemon.client("probe") as probe:  # a flush does not drop pages still being written
        assert wait_until(lambda: probe.stats()["l3_writes"] >= 8)
    assert b.clear() is True
    assert b.batch_exists(keys) == 0  # flushed L2 and L3
    b.close()


def test_get_stats_returns_sglangs_storage_metrics_when_sglang_has_it(sg, plugin, daemon,
                                                                      monkeypatch):
    module = storage_metrics_module()  # SGLang's class, as a running server has it imported
    monkeypatch.setitem(sys.modules, module.__name__, module)
    b = plugin(daemon.endpoint, {"kv": kv_pool(seed=18)}, metrics=True)
    b.batch_set_v1(keys_of("sm-", 3), idx(0, 3))
    st = b.get_stats()
    assert type(st) is module.StorageMetrics
    assert st.backup_pgs == [3] and st.prefetch_pgs == [] and st.counters["written_pages"] == 3


def test_a_daemon_with_a_client_token_serves_the_plugin(sg, plugin, make_daemon, monkeypatch):
    """client_token on the daemon: the plugin presents extra_config's ``token``, else the
    engine's HICACHED_CLIENT_TOKEN; without one every call is a miss (Unauthorized, counted)."""
    token = "plugin-t0ken"
    d = make_daemon(extra=["--client-token", token], token=token)
    keys = keys_of("tok-", 4)
    writer = plugin(d.endpoint, {"kv": kv_pool(seed=3)}, extra={"interface_v1": 1,
                                                                "token": token})
    assert backup(sg, writer, keys, idx(0, 4)) == 4
    assert "plugin-t0ken" not in repr(writer.settings)  # never logged
    monkeypatch.setenv("HICACHED_CLIENT_TOKEN", token)
    reader = plugin(d.endpoint, {"kv": kv_pool()}, extra={"interface_v1": 1})
    assert reader.batch_exists(keys) == 4
    monkeypatch.delenv("HICACHED_CLIENT_TOKEN")
    stranger = plugin(d.endpoint, {"kv": kv_pool()}, extra={"interface_v1": 1})
    assert stranger.batch_exists(keys) == 0
    assert stranger.get_stats().counters["errors"] >= 1
