"""The vLLM connector's parts that need no vLLM: vLLM's block tensors as host pools
(``plugin/vllm_blocks.py``), its namespace, pools and keys (``plugin/vllm_naming.py``), and the
daemon answering the exists calls of a session that registered no pool (vLLM's scheduler
process asks about the pools its workers register). The connector itself runs under real vLLM
engines in ``tests/vllm``."""

from __future__ import annotations

import hashlib

import pytest
import torch

from hicached import PoolHitPolicy, PoolTransfer, UnknownPool
from hicached.plugin.vllm_blocks import BlockPool, device_pool, token_indices
from hicached.plugin.vllm_naming import (
    GroupSpec,
    build_vllm_namespace,
    check_hash_algo,
    chunk_alignment_warning,
    config_digest,
    copy_path,
    load_async,
    page_keys,
    pool_names,
)
from pools import kv_pool, pages

BLOCKS, BLOCK = 16, 4


def layer(seed: int, shape=(BLOCKS, 2, BLOCK, 8), dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def test_a_block_page_is_its_bytes_in_every_layer_of_the_group():
    layers = [("l0", layer(0)), ("l1", layer(1))]
    pool = BlockPool(layers, BLOCKS, BLOCK)
    assert pool.size == BLOCKS * BLOCK and pool.page_size == BLOCK
    assert pool.page_bytes == 2 * 2 * BLOCK * 8 * 2
    for b in (0, 5, BLOCKS - 1):
        want = b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for _, t in layers)
        assert pool.block_bytes(b) == want


def test_a_block_dimension_after_the_kv_split_gives_two_segments():
    t = layer(2, shape=(2, BLOCKS, BLOCK, 8))  # (K/V, blocks, ...)
    pool = BlockPool([("l0", t)], BLOCKS, BLOCK)
    assert pool.block_bytes(3) == t[0, 3].view(torch.uint8).numpy().tobytes() + \
        t[1, 3].view(torch.uint8).numpy().tobytes()


def test_blocks_go_through_the_daemon_unchanged(daemon):
    """Store blocks 2, 7, 9 of one group, load them into blocks 0, 1, 3 of another engine's."""
    src = [("l0", layer(3)), ("l1", layer(4))]
    dst = [("l0", torch.zeros(BLOCKS, 2, BLOCK, 8, dtype=torch.bfloat16)),
           ("l1", torch.zeros(BLOCKS, 2, BLOCK, 8, dtype=torch.bfloat16))]
    keys = ["k2", "k7", "k9"]
    with daemon.client("vllm-a") as a, daemon.client("vllm-a") as b:
        a.register_mem_host_pool_v2(BlockPool(src, BLOCKS, BLOCK), "kv")
        b.register_mem_host_pool_v2(BlockPool(dst, BLOCKS, BLOCK), "kv")
        assert a.batch_set_v2([PoolTransfer("kv", token_indices([2, 7, 9], BLOCK),
                                            keys=keys)]) == {"kv": [True] * 3}
        a.wait_committed()  # b's get may reach the daemon before a's commit otherwise
        assert b.batch_get_v2([PoolTransfer("kv", token_indices([0, 1, 3], BLOCK),
                                            keys=keys)]) == {"kv": [True] * 3}
    for (_, s), (_, d) in zip(src, dst, strict=True):
        assert torch.equal(d[[0, 1, 3]], s[[2, 7, 9]])
        assert not d[2].any()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("shape", [(BLOCKS, 2, BLOCK, 8), (2, BLOCKS, BLOCK, 8)])
def test_the_device_path_stores_the_pointer_paths_pages(daemon, shape, device):
    """Blocks stored through the device path (what a GPU KV cache uses: on ``cuda``, DMA into
    the arena registered with CUDA; ``kernels/cuda.py`` runs the same gathers on CPU tensors)
    load through the pointer path into other blocks, and back: one page format, whichever
    path copied it."""
    src = [("l0", layer(5, shape).to(device)), ("l1", layer(6, shape).to(device))]
    mid = [("l0", torch.zeros(shape, dtype=torch.bfloat16)),
           ("l1", torch.zeros(shape, dtype=torch.bfloat16))]
    back = [("l0", torch.zeros(shape, dtype=torch.bfloat16, device=device)),
            ("l1", torch.zeros(shape, dtype=torch.bfloat16, device=device))]
    dev = device_pool(src, BLOCKS, BLOCK)
    assert dev.page_bytes == BlockPool(mid, BLOCKS, BLOCK).page_bytes
    keys = ["d1", "d4", "d15"]
    with daemon.client("vllm-d") as a, daemon.client("vllm-d") as b, \
            daemon.client("vllm-d") as c:
        a.register_mem_host_pool_v2(dev, "kv")
        b.register_mem_host_pool_v2(BlockPool(mid, BLOCKS, BLOCK), "kv")
        c.register_mem_host_pool_v2(device_pool(back, BLOCKS, BLOCK), "kv")
        assert a.batch_set_v2([PoolTransfer("kv", token_indices([1, 4, 15], BLOCK),
                                            keys=keys)]) == {"kv": [True] * 3}
        a.wait_committed()  # b's get may reach the daemon before a's commit otherwise
        assert b.batch_get_v2([PoolTransfer("kv", token_indices([0, 2, 3], BLOCK),
                                            keys=keys)]) == {"kv": [True] * 3}
        assert c.batch_get_v2([PoolTransfer("kv", token_indices([9, 8, 7], BLOCK),
                                            keys=keys)]) == {"kv": [True] * 3}
    dim = shape.index(BLOCKS)
    src, back = [(n, t.cpu()) for n, t in src], [(n, t.cpu()) for n, t in back]
    for (_, s_), (_, m), (_, k) in zip(src, mid, back, strict=True):
        sel = lambda t, ix: t.index_select(dim, torch.tensor(ix))  # noqa: E731
        assert torch.equal(sel(m, [0, 2, 3]), sel(s_, [1, 4, 15]))
        assert torch.equal(sel(k, [9, 8, 7]), sel(s_, [1, 4, 15]))
        assert not sel(m, [1]).any() and not sel(k, [0]).any()


def test_copy_path_setting():
    assert copy_path({}) == "auto" and copy_path({"copy_path": "device"}) == "device"
    with pytest.raises(ValueError, match="copy_path must be one of"):
        copy_path({"copy_path": "gpu"})
    with pytest.raises(ValueError, match="no dimension"):
        device_pool([("l0", layer(0))], BLOCKS + 1, BLOCK)
    with pytest.raises(ValueError, match="not contiguous"):
        device_pool([("l0", layer(0).transpose(2, 3))], BLOCKS, BLOCK)


def test_bad_blocks_and_tensors_are_refused_by_name():
    pool = BlockPool([("l0", layer(0))], BLOCKS, BLOCK)
    with pytest.raises(ValueError, match="not blocks of this group"):
        pool.get_page_buffer_meta(token_indices([BLOCKS], BLOCK))
    with pytest.raises(ValueError, match="multiple of block_size"):
        pool.get_page_buffer_meta([0, 1, 2])
    with pytest.raises(ValueError, match="no dimension"):
        BlockPool([("l0", layer(0))], BLOCKS + 1, BLOCK)
    with pytest.raises(ValueError, match="not contiguous"):
        BlockPool([("l0", layer(0).transpose(2, 3))], BLOCKS, BLOCK)


def test_keys_are_the_block_hashes_at_each_block_end():
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(8)]
    assert page_keys(hashes, 16, 16, 3) == [h.hex() for h in hashes[:3]]
    # blocks of 64 tokens hashed every 16: the hash at each block's last 16 tokens
    assert page_keys(hashes, 16, 64, 5) == [hashes[3].hex(), hashes[7].hex()]
    with pytest.raises(ValueError, match="not a multiple"):
        page_keys(hashes, 48, 64, 1)


def test_only_reproducible_block_hashes_are_accepted():
    check_hash_algo("sha256", {})
    check_hash_algo("sha256_cbor", {})
    check_hash_algo("xxhash", {"PYTHONHASHSEED": "0"})
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        check_hash_algo("xxhash", {})
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        check_hash_algo("xxhash_cbor", {})


def test_load_async_setting(caplog):
    assert load_async({}, 1) and load_async({"load_async": True}, 1)
    assert not load_async({"load_async": False}, 1)
    with caplog.at_level("WARNING"):  # several groups: vLLM takes their failures async only
        assert load_async({"load_async": False}, 2)
    assert "2 KV-cache groups" in caplog.text
    with pytest.raises(ValueError, match="load_async must be true or false, got 'no'"):
        load_async({"load_async": "no"}, 1)


def test_pools_and_their_hit_policies():
    groups = [GroupSpec(0, "state", 256, 2, 100), GroupSpec(1, "attention", 256, 2, 200),
              GroupSpec(2, "sliding", 256, 1, 100, window_blocks=3),
              GroupSpec(3, "attention", 256, 1, 100)]
    assert pool_names(groups) == {0: "mamba.0", 1: "kv", 2: "swa.2", 3: "kv.3"}
    assert [g.hit_policy for g in groups] == [PoolHitPolicy.TRAILING_PAGES,
                                              PoolHitPolicy.ALL_PAGES,
                                              PoolHitPolicy.TRAILING_PAGES,
                                              PoolHitPolicy.ALL_PAGES]
    with pytest.raises(ValueError, match="no full-attention"):
        pool_names([GroupSpec(0, "state", 256, 2, 100)])


def test_everything_that_shapes_a_page_separates_namespaces():
    groups = [GroupSpec(0, "attention", 128, 2, 65536)]
    base = dict(model="m", config=config_digest({"hidden_size": 128}), dtype=torch.bfloat16,
                kv_cache_dtype="auto", block_size=128, hash_algo="sha256", groups=groups)
    ns = build_vllm_namespace(**base).namespace
    assert ns.startswith("vllm|model=m|") and "dtype=bfloat16" in ns and "tp=0of1" in ns
    variants = [dict(model="n"), dict(config=config_digest({"hidden_size": 256})),
                dict(dtype=torch.float16), dict(kv_cache_dtype="fp8"), dict(block_size=16),
                dict(hash_algo="sha256_cbor"), dict(groups=[GroupSpec(0, "attention", 128, 2,
                                                                     32768)]),
                dict(tp_rank=1, tp_size=2), dict(revision="r2"), dict(salt="tenant|1")]
    names = {build_vllm_namespace(**{**base, **v}).namespace for v in variants}
    assert ns not in names and len(names) == len(variants)
    # where a config came from is not what it computes
    assert config_digest({"hidden_size": 128, "_name_or_path": "/a"}) == \
        config_digest({"hidden_size": 128, "_name_or_path": "/b"})
    # separators in values are escaped, never confused with fields
    assert "salt=tenant%7C1" in build_vllm_namespace(**base, salt="tenant|1").namespace


def test_exists_of_pools_registered_by_another_session_of_the_namespace(daemon):
    with daemon.client("ns-x") as worker, daemon.client("ns-x") as scheduler, \
            daemon.client("ns-y") as stranger:
        worker.register_mem_host_pool_v2(kv_pool(), "kv")
        worker.batch_set_v2([PoolTransfer("kv", pages(0, 2), keys=["a", "b"])])
        worker.wait_committed()  # a set sends its commit without waiting for the daemon
        assert scheduler.batch_exists_v2(["a", "b", "c"]).kv_hit_pages == 2
        scheduler.flush("l2")  # answered from L3 now (and the pages pulled back into L2)
        assert scheduler.batch_exists_v2(["a", "b", "c"]).kv_hit_pages == 2
        with pytest.raises(UnknownPool):  # nobody registered it in that namespace
            stranger.batch_exists_v2(["a"])
        with pytest.raises(UnknownPool):
            scheduler.batch_exists_v2(["a"], [PoolTransfer("mamba", keys=["a"],
                                                           hit_policy="trailing_pages")])


def test_a_scheduler_chunking_on_other_blocks_than_its_hybrid_groups_is_told_to_the_operator():
    hybrid = [GroupSpec(0, "state", 384, 2, 1 << 20), GroupSpec(1, "attention", 384, 2, 1 << 20)]
    told = chunk_alignment_warning(128, 384, hybrid)
    assert "--block-size 384" in told and "128-token" in told
    assert chunk_alignment_warning(384, 384, hybrid) is None
    assert chunk_alignment_warning(0, 384, hybrid) is None  # not known: nothing to say
    assert chunk_alignment_warning(16, 256, hybrid[1:]) is None  # no state: blocks are blocks

