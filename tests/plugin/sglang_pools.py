"""SGLang 0.5.23's real host-pool classes, built on CPU for the plugin tests.

The classes are SGLang's own code (``pool_host/mha.py``, ``mla.py``, ``mamba.py``, ``dsa.py``,
``memory_pool_host.py``): constructors, buffer layouts and the page surface the plugin copies
through (``get_page_buffer_meta``, ``get_data_page``, ``set_from_flat_data_page``). Their
modules cannot be imported on a CPU machine with ``sglang --no-deps``: the import chain reaches
triton, sgl_kernel, torchvision, pillow, starlette and the rest of SGLang through a few modules
that hold GPU kernels or process-wide runtime state. Those modules, and only those, are replaced
by stand-ins while the pool modules load (``_STAND_INS``); the stand-ins' kernels raise if called
(only device <-> host transfers call them, which no test here does). Modules already imported
(a process with all of SGLang) are used as they are.

The device pools a host pool is built from are plain CPU tensors in the shapes SGLang's device
pools hand over (``MHABufferInfo``, ``MLABufferInfo``, ``MambaStateBufferInfo``, DSA index
buffers, DeepSeek V4 page rows and compress states). Host pools are built unpinned
(``pin_memory=False``: pinning needs CUDA).
"""

from __future__ import annotations

import importlib
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from sglang_env import require_sglang

from hicached.plugin._sglang_compat import import_sglang

CPU = torch.device("cpu")
POOL_MODULES = {
    "mha": "sglang.srt.mem_cache.pool_host.mha",
    "mla": "sglang.srt.mem_cache.pool_host.mla",
    "mamba": "sglang.srt.mem_cache.pool_host.mamba",
    "dsa": "sglang.srt.mem_cache.pool_host.dsa",
    "v4": "sglang.srt.mem_cache.memory_pool_host",
    "info": "sglang.srt.mem_cache.device_pool_info",
    "decl": "sglang.srt.mem_cache.pool_host.host_pool_decl",
}


class _Kernel:
    """A GPU kernel of a stand-in module: raises if a test ever reaches it."""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} is a GPU kernel, not available in the CPU tests")


def _stand_in(name, attrs=None, package_dir=None):
    module = types.ModuleType(name, "stand-in installed by tests/sglang_pools.py")
    module.__dict__.update(attrs or {})
    if package_dir is not None:  # a package whose real submodules still load
        module.__path__ = [package_dir]
    else:
        def __getattr__(attr, _name=name):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Kernel(f"{_name}.{attr}")
        module.__getattr__ = __getattr__
    return module


def _device_pool_class(name, **attrs):
    return type(name, (), {"__module__": "sglang.srt.mem_cache.memory_pool", **attrs})


def _stand_ins(srt_dir):
    """name -> module for the modules replaced while the pool modules load (see the module
    docstring): each is a GPU-kernel module, a process-state module or a package whose
    ``__init__`` imports most of SGLang."""
    no = lambda: False
    capabilities = SimpleNamespace(hicache_device_kernels=False)
    return {
        # is_cuda & co (the real package __init__ imports all of SGLang's utilities)
        "sglang.srt.utils": _stand_in("sglang.srt.utils", {
            "is_cuda": no, "is_hip": no, "is_npu": no, "is_xpu": no, "is_mps": no},
            package_dir=f"{srt_dir}/utils"),
        # host RAM probe (psutil): a test pool is tiny
        "sglang.srt.mem_cache.host_memory": _stand_in("sglang.srt.mem_cache.host_memory", {
            "available_host_memory_bytes": lambda **kw: 1 << 40}),
        "sglang.srt.platforms": _stand_in("sglang.srt.platforms", {
            "current_platform": SimpleNamespace(capabilities=capabilities)}),
        # GPU kernels (triton / JIT / sgl_kernel)
        "sglang.kernels.ops.kvcache.hicache": _stand_in("sglang.kernels.ops.kvcache.hicache"),
        "sglang.kernels.ops.kvcache.hisparse": _stand_in("sglang.kernels.ops.kvcache.hisparse"),
        "sglang.kernels.ops.mamba.transfer_mamba": _stand_in(
            "sglang.kernels.ops.mamba.transfer_mamba"),
        # the device pools (6,300 lines on triton): only class names and one dtype are used
        "sglang.srt.mem_cache.memory_pool": _stand_in("sglang.srt.mem_cache.memory_pool", {
            "MHATokenToKVPool": _device_pool_class("MHATokenToKVPool"),
            "MHATokenToKOnlyPool": _device_pool_class("MHATokenToKOnlyPool"),
            "DSATokenToKVPool": _device_pool_class(
                "DSATokenToKVPool", index_k_with_scale_buffer_dtype=torch.uint8)}),
        # packages whose __init__ loads kernels; their layout helpers are plain torch
        "sglang.srt.layers": _stand_in("sglang.srt.layers", package_dir=f"{srt_dir}/layers"),
        "sglang.srt.layers.dcp": _stand_in("sglang.srt.layers.dcp",
                                           package_dir=f"{srt_dir}/layers/dcp"),
    }


_loaded: SimpleNamespace | None = None


def require_sglang_pools() -> SimpleNamespace:
    """SGLang's host-pool modules (``mha``, ``mla``, ``mamba``, ``dsa``, ``v4``, ``info``,
    ``decl``, and ``hs``: hicache_storage), or skip the test saying why."""
    global _loaded
    if _loaded is not None:
        return _loaded
    sg = require_sglang()
    import_sglang()
    srt_dir = sys.modules["sglang"].__path__[0] + "/srt"
    for name, module in _stand_ins(srt_dir).items():
        sys.modules.setdefault(name, module)  # a module already imported stays itself
    try:
        loaded = {k: importlib.import_module(m) for k, m in POOL_MODULES.items()}
    except ImportError as e:
        pytest.skip(f"SGLang's host-pool modules do not load on this machine: {e}")
    _loaded = SimpleNamespace(hs=sg.hs, factory=sg.factory, **loaded)
    return _loaded


# ---------------------------------------------------------------- real host pools


def fill(pool, seed):
    """Random bytes in every host buffer of a real SGLang host pool (deterministic per seed)."""
    g = torch.Generator().manual_seed(seed)
    for buf in host_buffers(pool):
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    return pool


def host_buffers(pool):
    """The host tensors of a real SGLang host pool."""
    for attr in ("kv_buffer", "index_k_with_scale_buffer", "temporal_buffer"):
        value = getattr(pool, attr, None)
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))
    yield from getattr(pool, "conv_buffer", None) or ()


def page_bytes(pool, token, n=1):
    """Bytes of ``n`` pages from the page at ``token`` (SGLang's flat data pages)."""
    size = pool.page_size
    return torch.cat([pool.get_data_page(token + i * size, flat=True).reshape(-1)
                      .view(torch.uint8) for i in range(n)])


def mha_pool(sgp, *, page=4, layers=2, heads=2, head_dim=8, tokens=64, layout="page_first",
             dtype=torch.bfloat16, label="kv"):
    """``MHATokenToKVPoolHost`` over a CPU device pool of ``tokens`` slots."""
    info = sgp.info
    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)
    buffers = info.KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                             layout=info.KVBufferLayout.NHD)
    buffer_info = info.MHABufferInfo(buffers=buffers, page_size=page, head_num=heads,
                                     head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
                                     device=CPU)
    return sgp.mha.MHATokenToKVPoolHost(
        buffer_info, 2.0, 0, page, layout, pin_memory=False, device_capacity_tokens=tokens,
        start_layer=0, end_layer=layers, pool_label=label)


def mla_pool(sgp, *, page=4, layers=2, kv_lora_rank=16, rope_dim=8, tokens=64,
             layout="page_first", dtype=torch.bfloat16, label="kv"):
    """``MLATokenToKVPoolHost`` over a CPU device pool of ``tokens`` slots."""
    dim = kv_lora_rank + rope_dim
    bufs = tuple(torch.zeros(tokens, 1, dim, dtype=dtype) for _ in range(layers))
    buffer_info = sgp.info.MLABufferInfo(
        buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page,
        kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim, kv_cache_dim=dim, dtype=dtype,
        device=CPU)
    return sgp.mla.MLATokenToKVPoolHost(
        buffer_info, 2.0, 0, page, layout, pin_memory=False, device_capacity_tokens=tokens,
        start_layer=0, end_layer=layers, target_layer_num=layers, pool_label=label)


def mamba_pool(sgp, *, slots=8, layers=2, temporal=(2, 4), convs=((3, 4),),
               layout="page_first"):
    """``MambaPoolHost`` (one state per slot, page_size 1) over CPU checkpoint buffers."""
    info = sgp.info.MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, *temporal, dtype=torch.float32),
        conv=tuple(torch.zeros(layers, slots, *c, dtype=torch.bfloat16) for c in convs))
    return sgp.mamba.MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False,
                                   layout=layout)


def dsa_indexer_pool(sgp, anchor, *, layers=2, index_head_dim=16, quant_block=8, name=None):
    """``DSAIndexerPoolHost`` laid out on the MLA host pool ``anchor`` (its slots)."""
    page = anchor.page_size
    row = index_head_dim + index_head_dim // quant_block * 4  # fp8 keys + fp32 scale per block
    device = SimpleNamespace(
        device="cpu", store_dtype=torch.uint8, start_layer=0, end_layer=layers,
        layer_shard_enabled=False,
        layer_num=layers, page_size=page, index_page_size=page, index_head_dim=index_head_dim,
        quant_block_size=quant_block, skip_topk_layers=[False] * layers,
        index_k_with_scale_buffer=[torch.zeros(anchor.page_num, page * row, dtype=torch.uint8)
                                   for _ in range(layers)])
    decl = sgp.dsa.make_dsa_indexer_pool_decl(device, name=name or sgp.hs.PoolName.INDEXER)
    return sgp.dsa.DSAIndexerPoolHost(decl, anchor, pin_memory=False)


def v4_paged_pool(sgp, name, *, pages=16, page=4, layers=2, item_bytes=48,
                  layout="page_first"):
    """``DeepSeekV4PagedHostPool``: one ``item_bytes`` row per layer per page (compressed KV,
    indexer, SWA rows of DeepSeek V4)."""
    device = [torch.zeros(pages, item_bytes, dtype=torch.uint8) for _ in range(layers)]
    return sgp.v4.DeepSeekV4PagedHostPool(str(name), device, item_bytes, pages, page,
                                         layout=layout, pin_memory=False)


def v4_state_pool(sgp, name, *, pages=16, page=4, layers=2, ring=4, state_dim=6,
                  layout="page_first"):
    """``DeepSeekV4StateHostPool`` over CPU compress-state pools (``ring`` slots per page)."""
    states = [SimpleNamespace(ring_size=ring, kv_score_buffer=SimpleNamespace(
        kv_score=torch.zeros(pages * ring, state_dim, dtype=torch.float32)))
        for _ in range(layers)]
    return sgp.v4.DeepSeekV4StateHostPool(str(name), states, pages, page, layout=layout,
                                         pin_memory=False)


def logical_pool(sgp, *, pages=16, page=4, layout="page_first"):
    """``LogicalHostPool``: DeepSeek V4's KV anchor, page indices without bytes."""
    return sgp.v4.LogicalHostPool(pages * page, page, layout=layout)
