"""SGLang on CPU for the plugin tests: the real storage ABC, factory and file backend.

SGLang is imported through ``hicached.plugin._sglang_compat`` (engine-plugins.md §1.5(b)): only
torch and ``sglang --no-deps`` are needed. Its real host pools do not import on CPU as they are
(``sglang_pools.py`` loads them with their GPU-kernel imports replaced); the tests here use
``hicached.HostPool`` (real tensors, SGLang's host-pool surface) or ``SGLangLikePool``, which hides
that it is a HostPool so the plugin takes the path a real SGLang pool gets.

``hicache_file`` builds SGLang's own ``HiCacheFile`` as the differential oracle. Its LRU evictor
imports ``sglang.srt.utils.common`` (all of SGLang) for one size parser that is only called when
a disk-size limit is configured; the import is satisfied by a stand-in module for the duration
of that one import (the tests configure no limit, so the stand-in is never called).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import importlib
import sys
import types
import typing
from types import SimpleNamespace

import pytest
import torch

from hicached import HostPool
from hicached.plugin._sglang_compat import BACKEND_FACTORY, HICACHE_STORAGE, import_sglang

PAGE = 4  # tokens per KV page

SKIP_REASON = ("sglang is not installed: pip install --no-deps sglang==0.5.23 "
               "(the README test command and .ci/run install it)")


def require_sglang() -> SimpleNamespace:
    """SGLang's storage modules (``hs``: hicache_storage, ``factory``: StorageBackendFactory),
    or skip the test with the install command."""
    hs = import_sglang(HICACHE_STORAGE)
    bf = import_sglang(BACKEND_FACTORY)
    if hs is None or bf is None:
        pytest.skip(SKIP_REASON)
    return SimpleNamespace(hs=hs, factory=bf.StorageBackendFactory)


def storage_config(sg, *, model="org/model-a", tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                   cp_rank=0, cp_size=1, mla=False, extra=None, metrics=False, **fields):
    """A ``HiCacheStorageConfig`` as SGLang's controller builds it."""
    return sg.hs.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
        attn_cp_rank=cp_rank, attn_cp_size=cp_size, is_mla_model=mla,
        enable_storage_metrics=metrics, is_page_first_layout=True, model_name=model,
        extra_config=extra, **fields)


@contextlib.contextmanager
def plugins(sg):
    """Yields ``make(endpoint, pools, extra=..., **config)`` (``create_plugin``); every plugin
    made is closed on exit."""
    made = []

    def make(endpoint, pools, **kw):
        made.append(create_plugin(sg, endpoint, pools, **kw))
        return made[-1]

    try:
        yield make
    finally:
        for backend in made:
            backend.close()


def plugin_extra(endpoint, **more):
    """The extra_config of ``--hicache-storage-backend dynamic`` for the plugin."""
    return {"backend_name": "hicached", "module_path": "hicached.plugin.sglang",
            "class_name": "HicachedStorage", "endpoint": endpoint, **more}


def create_plugin(sg, endpoint, pools, *, extra=None, **cfg):
    """SGLang's attach sequence (§1.4): factory ``create_backend("dynamic", cfg, host_pool)``
    -> ``register_mem_pool_host(kv)`` -> ``register_mem_host_pool_v2`` for every entry, KV
    first -> ``on_host_pools_registered()``. ``pools``: {PoolName value: host pool}."""
    config = storage_config(sg, extra=plugin_extra(endpoint, **(extra or {})), **cfg)
    backend = sg.factory.create_backend("dynamic", config, pools.get("kv"))
    attach(sg, backend, pools)
    return backend


def attach(sg, backend, pools):
    """Register ``pools`` the way SGLang's HybridCacheController does."""
    backend.register_mem_pool_host(pools["kv"])
    for name, pool in pools.items():
        backend.register_mem_host_pool_v2(pool, sg.hs.PoolName(name))
    if hasattr(backend, "on_host_pools_registered"):
        backend.on_host_pools_registered()


def hicache_file(sg, directory, **cfg):
    """SGLang's ``HiCacheFile`` over ``directory`` (see the module docstring)."""
    evictor = "sglang.srt.mem_cache.storage.file.lru_file_evictor"
    common = "sglang.srt.utils.common"
    if evictor not in sys.modules and common not in sys.modules:
        stand_in = types.ModuleType(common, "stand-in for the file backend tests")

        def human_readable_int(value):
            raise NotImplementedError("disk size limits are not used in these tests")

        stand_in.human_readable_int = human_readable_int
        sys.modules[common] = stand_in
        try:
            importlib.import_module(evictor)
        finally:
            if sys.modules.get(common) is stand_in:
                del sys.modules[common]
    config = storage_config(sg, extra={"file_storage_path": str(directory)}, **cfg)
    return sg.hs.HiCacheFile(config)


def sglang_source_object(module, name, scope, into=None):
    """One top-level function or class of an SGLang module, compiled from its source with
    ``scope`` as globals (``into``: a module object whose namespace to use): for modules whose
    own imports need all of SGLang (kernels, metrics)."""
    spec = importlib.util.find_spec(module)
    with open(spec.origin) as f:
        tree = ast.parse(f.read())
    node = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                and n.name == name)
    namespace = into.__dict__ if into is not None else {"__name__": module}
    namespace.update(scope)
    code = compile(ast.Module(body=[node], type_ignores=[]), spec.origin, "exec")
    exec(code, namespace)  # noqa: S102 - SGLang's own source
    return namespace[name]


def storage_namespace_seed():
    """SGLang's own ``storage_namespace_seed(extra_key, cache_salt)`` (``mem_cache/utils.py``
    imports SGLang's kernels, so the module itself cannot be imported on CPU)."""
    return sglang_source_object("sglang.srt.mem_cache.utils", "storage_namespace_seed",
                                {"hashlib": hashlib, "Optional": typing.Optional})


def storage_metrics_module():
    """A module holding SGLang's own ``StorageMetrics`` dataclass, compiled from
    ``observability/metrics_collector.py`` (which imports most of SGLang). The caller puts it in
    ``sys.modules`` (where a running server has the real one)."""
    name = "sglang.srt.observability.metrics_collector"
    module = types.ModuleType(name)
    module.__spec__ = importlib.util.find_spec(name)
    saved = sys.modules.get(name)
    sys.modules[name] = module  # dataclass() looks its class's module up while decorating
    try:
        sglang_source_object(name, "StorageMetrics", {
            "annotations": __import__("__future__").annotations,
            "dataclass": dataclasses.dataclass, "field": dataclasses.field, "List": list},
            into=module)
    finally:
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved
    return module


def page_hashes(token_ids, page_size, prior_hash=None):
    """SGLang's page keys: SHA-256 chain over (prior digest, page tokens as uint32 LE)."""
    out, prior = [], bytes.fromhex(prior_hash) if prior_hash else b""
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hashlib.sha256(prior)
        for t in token_ids[start:start + page_size]:
            h.update(int(t).to_bytes(4, "little"))
        prior = h.digest()
        out.append(h.hexdigest())
    return out


class SGLangLikePool:
    """SGLang's host-pool surface over a HostPool, without being one: the plugin copies through
    ``get_page_buffer_meta`` pointers, as it does for SGLang's real pools."""

    def __init__(self, pool):
        self._pool = pool
        for name in ("page_size", "layout", "dtype", "size", "kv_buffer", "layer_num"):
            if hasattr(pool, name):
                setattr(self, name, getattr(pool, name))

    def __getattr__(self, name):
        if name in ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page",
                    "get_page_buffer_meta", "get_size_per_token", "get_ksize_per_token"):
            return getattr(self._pool, name)
        raise AttributeError(name)


def fill_random(pool, seed):
    """Give every buffer of a HostPool random bytes (deterministic per seed)."""
    g = torch.Generator().manual_seed(seed)
    for buf in pool.buffers:
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    return pool


# ---------------------------------------------------------------- pools and keys


def kv_pool(num_pages=160, layout="page_first", dtype=torch.bfloat16, seed=None):
    pool = HostPool.allocate_mha(num_pages, PAGE, layers=2, heads=2, head_dim=8, layout=layout,
                                 dtype=dtype)
    return fill_random(pool, seed) if seed is not None else pool


def mamba_pool(seed=None):
    pool = HostPool.allocate_mamba(8, 2, (2, 4), [(3, 4)])
    return fill_random(pool, seed) if seed is not None else pool


def indexer_pool(num_pages=160, seed=None):
    pool = HostPool.allocate_indexer(num_pages, PAGE, layers=2, page_elems=16)
    return fill_random(pool, seed) if seed is not None else pool


def swa_pool(num_pages=160, seed=None):
    pool = HostPool.allocate_mha(num_pages, PAGE, layers=1, heads=1, head_dim=8,
                                 layout="page_first", dtype=torch.bfloat16)
    return fill_random(pool, seed) if seed is not None else pool


def idx(first_page, n):
    """Token host indices of ``n`` pages from page ``first_page``."""
    return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)


def kv_bytes(pool, first_page, n):
    """The bytes of ``n`` KV pages from ``first_page`` (SGLang's flat pages, any layout)."""
    return torch.cat([pool.get_data_page((first_page + i) * PAGE).view(torch.uint8)
                      for i in range(n)])


def keys_of(prefix, n):
    return [f"{prefix}{i:03d}" for i in range(n)]


# ---------------------------------------------------------------- SGLang's controller, in small


def backup(sg, backend, keys, kv_idx, sidecars=(), v1=True, kv_pool_=None):
    """HybridCacheController._page_backup: sidecars, then KV batches (stop at a failed one)."""
    hs = sg.hs
    if sidecars:
        res = backend.batch_set_v2(list(sidecars), hs.HiCacheStorageExtraInfo())
        assert all(all(v) for v in res.values()), res
    stored = 0
    for i in range(0, len(keys), hs.STORAGE_BATCH_SIZE):
        batch = keys[i:i + hs.STORAGE_BATCH_SIZE]
        batch_idx = kv_idx[i * PAGE:(i + len(batch)) * PAGE]
        if v1:
            ok = all(backend.batch_set_v1(batch, batch_idx, hs.HiCacheStorageExtraInfo()))
        else:
            ok = backend.batch_set(batch, [kv_pool_.get_data_page(batch_idx[j * PAGE])
                                           for j in range(len(batch))])
        if not ok:
            break
        stored += len(batch)
    return stored


def load_kv(sg, backend, keys, kv_idx, kv_pool_, derived=(), v1=True):
    """CacheController._page_transfer: KV batches (+ KV-derived sidecars), min of the hits."""
    hs = sg.hs
    done = 0
    for i in range(0, len(keys), hs.STORAGE_BATCH_SIZE):
        batch = keys[i:i + hs.STORAGE_BATCH_SIZE]
        batch_idx = kv_idx[i * PAGE:(i + len(batch)) * PAGE]
        if v1:
            res = backend.batch_get_v1(batch, batch_idx, hs.HiCacheStorageExtraInfo())
            hits = res.index(False) if False in res else len(res)
        else:
            pages = backend.batch_get(batch, [kv_pool_.get_dummy_flat_data_page() for _ in batch])
            hits = 0
            for j, page in enumerate(pages):
                if page is None:
                    break
                kv_pool_.set_from_flat_data_page(batch_idx[j * PAGE], page)
                hits += 1
        if derived:
            side = backend.batch_get_v2(
                [hs.PoolTransfer(name=name, host_indices=batch_idx, keys=batch)
                 for name in derived], hs.HiCacheStorageExtraInfo())
            hits = min([hits, *hs.count_pool_hits(side).values()])
        done += hits
        if hits != len(batch):
            break
    return done
