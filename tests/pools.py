"""Host pools and page ranges the tests build their calls from: a KV pool (MHA, page_first), a
Mamba state pool, a DSA indexer pool, each filled from a seed, and the token indices of pages."""

import torch

from hicached import HostPool

PAGE = 4  # tokens per KV page


def kv_pool(num_pages=32, seed=None):
    pool = HostPool.allocate_mha(num_pages, PAGE, layers=2, heads=2, head_dim=8,
                                 layout="page_first", dtype=torch.float32)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g))
    return pool


def mamba_pool(num_slots=8, seed=None):
    pool = HostPool.allocate_mamba(num_slots, 2, (2, 4), [(3, 4)])
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for b in pool.buffers:
            b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
    return pool


def indexer_pool(num_pages=32, seed=None):
    pool = HostPool.allocate_indexer(num_pages, PAGE, layers=2, page_elems=16)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        pool.buffers[0].copy_(torch.randint(0, 255, pool.buffers[0].shape, generator=g))
    return pool


def pages(start, n):
    """Token indices of n KV pages starting at page ``start``."""
    return torch.arange(start * PAGE, (start + n) * PAGE)


def kv_tokens(pool, start, n):
    return pool.kv_buffer[:, start * PAGE:(start + n) * PAGE]
