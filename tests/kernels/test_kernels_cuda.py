"""kernels/cuda.py against the plain-torch reference, byte for byte, on CPU and (when present) CUDA.

The device copier is device-agnostic, so the CPU variant runs everywhere and covers the run
splitting, gathers and scatters; the CUDA variant adds registration and real DMA transfers and
skips without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernels import CONFIGS, _arena_for, _bytes_equal, _ids, _spec, make_pool, patterns

from hicached import HostPool, PoolTransfer
from hicached.kernels import reference
from hicached.kernels.cuda import DeviceCopier, DevicePageIO, HostRegistration, contiguous_runs

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _on(device, tensors):
    return [t.to(device) for t in tensors]


def test_contiguous_runs_never_span_a_gap():
    runs = contiguous_runs(np.array([300, 0, 100, 200, 500, 600]), 100)
    assert [r.tolist() for r in runs] == [[1, 2, 3, 0], [4, 5]]
    gapped = contiguous_runs(np.array([0, 164, 328]), 100)  # slots padded to 164 bytes
    assert [r.tolist() for r in gapped] == [[0], [1], [2]]
    assert contiguous_runs(np.array([], dtype=np.int64), 100) == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_device_to_arena_matches_reference(device, config):
    pool = make_pool(*config)
    kind, layout, page_size, buffers = _spec(pool)
    copier = DeviceCopier(kind, layout, page_size, _on(device, buffers))
    assert copier.page_bytes == pool.page_bytes
    for name, (pages, offsets) in patterns(copier.page_bytes).items():
        got = _arena_for(offsets, copier.page_bytes, seed=1)
        want = got.clone()
        reg = HostRegistration(got) if device == "cuda" else None
        try:
            copier.to_arena(pages, got, offsets)
        finally:
            if reg is not None:
                reg.close()
        reference.to_arena(*_spec(pool), [p * page_size for p in pages], want, offsets)
        assert torch.equal(got, want), name  # gaps between slots untouched too


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_device_from_arena_matches_reference(device, config):
    for name, (pages, offsets) in patterns(make_pool(*config).page_bytes).items():
        want = make_pool(*config, seed=2)
        kind, layout, page_size, buffers = _spec(want)
        on_device = _on(device, buffers)
        copier = DeviceCopier(kind, layout, page_size, on_device)
        arena = _arena_for(offsets, copier.page_bytes, seed=3)
        copier.from_arena(pages, arena, offsets)
        reference.from_arena(kind, layout, page_size, buffers, [p * page_size for p in pages],
                             arena, offsets)
        assert _bytes_equal(_on("cpu", on_device), buffers), name


def test_device_copier_rejects_bad_input():
    pool = make_pool("mha", "page_first", 4, torch.float32)
    copier = DeviceCopier(*_spec(pool))
    arena = torch.zeros(10 * pool.page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside 0..11"):
        copier.to_arena([12], arena, [0])
    with pytest.raises(ValueError, match="overlap"):
        copier.to_arena([0, 1], arena, [0, 8])
    with pytest.raises(ValueError, match="outside the arena"):
        copier.from_arena([0], arena, [10 * pool.page_bytes])
    with pytest.raises(ValueError, match="2 pages but 1 arena offsets"):
        copier.from_arena([0, 1], arena, [0])


@pytest.mark.parametrize("device", DEVICES)
def test_device_pool_through_a_daemon(device, daemon):
    """A device-resident KV pool stores pages another client reads into a host pool, and
    loads pages a host pool stored; the client registers and releases the arena."""
    page, num_pages = 4, 16
    host_src = HostPool.allocate_mha(num_pages, page, 2, 2, 8, "page_first", torch.bfloat16)
    host_src.kv_buffer.copy_(torch.randn(host_src.kv_buffer.shape))
    dev_buf = torch.randn(host_src.kv_buffer.shape).to(torch.bfloat16).to(device)
    io = DevicePageIO("mha", "page_first", page, [dev_buf])
    keys = [f"dev{i}" for i in range(6)]
    with daemon.client() as dev_client, daemon.client() as host_client:
        dev_client.register_mem_host_pool_v2(io, "kv")
        host_client.register_mem_host_pool_v2(host_src, "kv")
        assert dev_client.batch_set_v2([PoolTransfer("kv", torch.arange(0, 24), keys=keys)]) == {
            "kv": [True] * 6}
        assert dev_client.batch_exists(keys) == 6  # its commit has been read
        assert host_client.batch_get_v1(keys, torch.arange(40, 64)) == [True] * 6
        assert torch.equal(host_src.kv_buffer[:, 40:64], dev_buf[:, 0:24].cpu())
        back = [f"host{i}" for i in range(3)]
        assert host_client.batch_set_v1(back, torch.arange(0, 12)) == [True] * 3
        assert host_client.batch_exists(back) == 3
        assert dev_client.batch_get_v1(back, torch.arange(48, 60)) == [True] * 3
        assert torch.equal(dev_buf[:, 48:60].cpu(), host_src.kv_buffer[:, 0:12])
        assert (io._registration is not None) == (device == "cuda")
    assert io._registration is None  # released before the client unmapped the arena
