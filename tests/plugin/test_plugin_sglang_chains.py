"""The SGLang plugin hands SGLang's prefix keys to the daemon as its set calls' chains.

With ``hicache_storage_pass_prefix_keys: true`` in the storage extra config, SGLang 0.5.23 passes
``HiCacheStorageExtraInfo(prefix_keys=...)`` to ``batch_set_v1`` (KV, batch by batch, the prefix
growing by each batch: ``CacheController._page_backup``) and ``batch_set_v2`` (sidecars, grouped
by ``_trailing_chain_groups`` so that prefix_keys + keys is one chain); without it, prefix_keys
is None. The daemon runs in-process to read its index's ``chain``.
"""

import pytest
import torch
from inproc_daemon import inproc_daemon
from sglang_env import PAGE, idx, keys_of, kv_pool, mamba_pool, sglang_source_object

from hicached.daemon.sessions import namespace_digest

HYBRID = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller"


@pytest.fixture
def daemon(tmp_path):
    with inproc_daemon(tmp_path, l2_size=32 << 20) as d:
        yield d


def page_backup(hs, backend, keys, first_page, prefix_keys):
    """``CacheController._page_backup`` through the v1 path: KV batches of
    ``STORAGE_BATCH_SIZE`` pages, each with the keys of every page before it."""
    for i in range(0, len(keys), hs.STORAGE_BATCH_SIZE):
        batch = keys[i:i + hs.STORAGE_BATCH_SIZE]
        extra = hs.HiCacheStorageExtraInfo(prefix_keys=prefix_keys)
        assert all(backend.batch_set_v1(batch, idx(first_page + i, len(batch)), extra))
        if prefix_keys is not None:
            prefix_keys = prefix_keys + batch


def test_kv_batches_hang_after_their_prefix_keys(sg, plugin, daemon):
    keys = keys_of("kv-", 130)  # two batches
    w = plugin(daemon.endpoint, {"kv": kv_pool(seed=1)}, extra={"interface_v1": 1})
    ns = w.namespace.namespace
    page_backup(sg.hs, w, keys, 0, ["anc-0", "anc-1"])  # the node's ancestors' pages
    assert [daemon.chain(ns, k) for k in (keys[0], keys[1], keys[127], keys[128])] == [
        (None, 2), (keys[0], 3), (keys[126], 129), (keys[127], 130)]  # anc-1: not in L2
    page_backup(sg.hs, w, ["root-0", "root-1"], 140, [])  # a root node: depth 0
    assert [daemon.chain(ns, k) for k in ("root-0", "root-1")] == [(None, 0), ("root-0", 1)]
    assert w.get_stats().counters["errors"] == 0


def test_without_prefix_keys_the_plugin_says_nothing(sg, plugin, daemon):
    """SGLang without ``hicache_storage_pass_prefix_keys`` (prefix_keys None), no extra info
    at all, and the generic v0 path (whose ``batch_set`` SGLang gives no extra info)."""
    src = kv_pool(seed=2)
    w = plugin(daemon.endpoint, {"kv": src}, extra={"interface_v1": 1})
    ns = w.namespace.namespace
    page_backup(sg.hs, w, ["n-0", "n-1"], 0, None)
    assert w.batch_set_v1(["o-0"], idx(2, 1)) == [True]
    assert w.batch_set(["g-0", "g-1"], [src.get_data_page(p * PAGE) for p in (3, 4)])
    for first, second in (("n-0", "n-1"), ("g-0", "g-1")):
        assert [daemon.chain(ns, k) for k in (first, second)] == [(None, -1), (first, -1)]
    assert daemon.chain(ns, "o-0") == (None, -1)


def test_a_non_writer_mla_rank_links_its_own_pool_by_namespace_and_key(sg, plugin, daemon):
    """MLA with tp 2: only rank 0 writes KV; rank 1's calls carry only its rank-tagged Mamba
    pool, grouped by SGLang's own ``_trailing_chain_groups``. Both ranks' links are the same
    (namespace, key)'s."""
    hs = sg.hs
    groups = sglang_source_object(HYBRID, "_trailing_chain_groups",
                                  {"HiCacheStorageExtraInfo": hs.HiCacheStorageExtraInfo})
    keys, prefix = keys_of("mla-", 3), ["anc-0"]
    rank1, rank0 = (plugin(daemon.endpoint, {"kv": kv_pool(seed=3), "mamba": mamba_pool(seed=4)},
                           mla=True, tp_rank=r, tp_size=2, extra={"interface_v1": 1})
                    for r in (1, 0))
    ns = rank1.namespace.namespace
    assert rank0.namespace.namespace == ns
    assert rank1._sessions.wire("mamba") == "mamba@tp1of2"
    for backend in (rank1, rank0):
        sidecar = hs.PoolTransfer(name=hs.PoolName.MAMBA, host_indices=torch.tensor([0]),
                                  keys=keys[-1:], hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)
        for extra, transfers in groups(prefix, keys, [sidecar]):
            assert extra.prefix_keys == prefix + keys[:-1]
            assert backend.batch_set_v2(transfers, extra) == {hs.PoolName.MAMBA: [True]}
        if backend is rank1:  # its Mamba page is linked; no KV page is held yet
            assert daemon.chain(ns, keys[-1]) == (None, 3)  # its parent: not in L2 yet
            # and the daemon knows that pool holds states (kept only with their KV prefix)
            ix, digest = daemon.daemon.index, namespace_digest(ns)
            assert daemon.daemon.call(lambda: ix.trailing(digest) == ix.pool_bit(
                (digest, "mamba@tp1of2")))
            assert [daemon.chain(ns, k) for k in keys[:-1]] == [(None, -1)] * 2
    page_backup(hs, rank1, keys, 0, prefix)  # skipped: rank 0 writes the KV
    assert rank1.get_stats().counters["skipped_write_pages"] == 3
    page_backup(hs, rank0, keys, 0, prefix)
    assert [daemon.chain(ns, k) for k in keys] == [(None, 1), (keys[0], 2), (keys[1], 3)]


def test_the_kv_pool_is_declared_for_kv_events_as_sglang_publishes_them(sg, plugin, tmp_path):
    """The daemon's KV events name SGLang's pages as SGLang's own events do
    (``hash_str_to_int64`` of the page hash, ``page_size`` tokens a block); read back through
    the replay socket (no subscription to race)."""
    import hashlib
    import time

    import msgspec
    import zmq

    from hicached.daemon.kv_events import BlockStored, KVEventBatch

    keys = [hashlib.sha256(bytes([i])).hexdigest() for i in range(3)]
    replay = f"ipc://{tmp_path}/replay.sock"
    with inproc_daemon(tmp_path, l3_backend="none", kv_events_endpoint=f"ipc://{tmp_path}/ev",
                       kv_events_replay_endpoint=replay) as d:
        w = plugin(d.endpoint, {"kv": kv_pool(seed=3)}, extra={"interface_v1": 1})
        assert all(w.batch_set_v1(keys, idx(0, 3)))
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.connect(replay)
        events, deadline = [], time.monotonic() + 10
        while not events and time.monotonic() < deadline:
            s.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                assert s.poll(5000)
                _, _, payload = s.recv_multipart()
                if not payload:
                    break
                events += msgspec.msgpack.decode(payload, type=KVEventBatch).events
        s.close(linger=0)
        ctx.term()

    def to_int64(k):  # SGLang's mem_cache.utils.hash_str_to_int64 (its module needs triton)
        v = int(k[:16], 16)
        return v - 2**64 if v >= 2**63 else v

    assert events == [BlockStored([to_int64(k) for k in keys], None, [], PAGE, None, "CPU_PINNED",
                                  None)]
