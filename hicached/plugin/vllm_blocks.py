"""vLLM's paged KV cache as hicached host pools: one pool per KV-cache group, one page per block.

vLLM hands a connector's workers one tensor per layer (``register_kv_caches``), every one indexed
by the same block ids within its group. A block of a group is therefore, as a page, the bytes of
that block in each of the group's layers, in the group's layer order::

    page(block b) = layer_0[b] | layer_1[b] | ... | layer_{n-1}[b]

``BlockPool`` describes such a group with SGLang's pointer surface (``get_page_buffer_meta``), so
the client's pointer path (``client/hostpool.PointerPageIO``) copies blocks to and from arena slots
with one ``memmove`` per layer segment and no staging copy. Indices are token-granular as
everywhere in the client: block ``b`` is named by token ``b * block_size``.

A layer tensor may put its block dimension anywhere (vLLM's CPU attention uses
``(blocks, ...)``, some backends ``(2, blocks, ...)``): the dimensions before it become separate
segments of the block, the ones after it must be contiguous. Hybrid models' state groups
(Mamba, gated delta net) register one block of raw state bytes per block id the same way.

KV caches on a GPU cannot be ``memmove``d: ``device_pool`` describes the same pages as views
of the layer tensors with their block dimension first, for ``kernels/cuda.DevicePageIO`` (a
batch's blocks gathered on the device, one DMA into the arena registered with CUDA). It lays
out a page's bytes exactly as ``BlockPool`` does, and runs on CPU tensors too, which is how it
is tested without a GPU.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch


def _block_dim(name: str, t: torch.Tensor, num_blocks: int) -> tuple[int, torch.Tensor]:
    """The block dimension of layer tensor ``t`` (its first with ``num_blocks`` entries) and the
    view of block 0 over the dimensions after it, which must be contiguous. Raises ``ValueError`` naming the layer when no
    dimension fits or a block is not contiguous."""
    dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
    if not dims:
        raise ValueError(f"layer {name}: no dimension of {tuple(t.shape)} has the group's "
                         f"{num_blocks} blocks")
    dim = dims[0]
    inner = t[(0,) * (dim + 1)] if dim + 1 < t.dim() else t.reshape(-1)[:1]
    if not inner.is_contiguous():
        raise ValueError(f"layer {name}: a block of shape {tuple(inner.shape)} with strides "
                         f"{inner.stride()} is not contiguous")
    return dim, inner


def _segments(name: str, t: torch.Tensor, num_blocks: int) -> tuple[list[int], int, int]:
    """(start addresses of block 0's segments, bytes per segment, bytes between blocks) of one
    layer tensor ``t`` whose block dimension has ``num_blocks`` entries."""
    if t.device.type != "cpu":
        raise ValueError(f"layer {name}: the KV cache is on {t.device}; memmove copies host "
                         "memory only (device_pool copies device blocks)")
    dim, inner = _block_dim(name, t, num_blocks)
    es = t.element_size()
    seg_bytes = inner.numel() * es
    outer = np.indices(t.shape[:dim]).reshape(dim, -1).T if dim else np.zeros((1, 0), np.int64)
    starts = [t.data_ptr() + int(np.dot(ix, t.stride()[:dim])) * es for ix in outer]
    return starts, seg_bytes, t.stride(dim) * es


class BlockPool:
    """The layers of one KV-cache group as a host pool (see the module docstring)."""

    def __init__(self, layers: Sequence[tuple[str, torch.Tensor]], num_blocks: int,
                 block_size: int):
        if not layers:
            raise ValueError("a KV-cache group needs at least one layer")
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.page_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.size = self.num_blocks * self.page_size
        self.layer_names = [name for name, _ in layers]
        self.layout = "vllm_block"
        starts, sizes, strides = [], [], []
        for name, t in layers:
            s, seg, stride = _segments(name, t, self.num_blocks)
            starts += s
            sizes += [seg] * len(s)
            strides += [stride] * len(s)
        self._starts = np.asarray(starts, dtype=np.int64)
        self._sizes = np.asarray(sizes, dtype=np.int64)
        self._strides = np.asarray(strides, dtype=np.int64)
        self.page_bytes = int(self._sizes.sum())
        self._keep = [t for _, t in layers]  # the memory the addresses point into

    def get_page_buffer_meta(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(pointers, sizes) of every page's segments, page after page, for the token-granular
        ``indices`` (``page_size`` per page, each page's run starting at a block boundary)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size % self.page_size:
            raise ValueError(f"{idx.size} indices is not a multiple of block_size "
                             f"{self.page_size}")
        firsts = idx[:: self.page_size]
        blocks = firsts // self.page_size
        if ((firsts % self.page_size) != 0).any() or (blocks < 0).any() \
                or (blocks >= self.num_blocks).any():
            bad = firsts[((firsts % self.page_size) != 0) | (blocks < 0)
                         | (blocks >= self.num_blocks)][:4].tolist()
            raise ValueError(f"page starts {bad} are not blocks of this group "
                             f"({self.num_blocks} blocks of {self.page_size} tokens)")
        ptrs = self._starts[None, :] + blocks[:, None] * self._strides[None, :]
        sizes = np.broadcast_to(self._sizes, ptrs.shape)
        return ptrs.reshape(-1), sizes.reshape(-1)

    def block_bytes(self, block: int) -> bytes:
        """The page of ``block`` as bytes (tests and debugging)."""
        ptrs, sizes = self.get_page_buffer_meta(token_indices([block], self.page_size))
        return b"".join(ctypes.string_at(int(p), int(n))
                        for p, n in zip(ptrs, sizes, strict=True))


def token_indices(blocks: Sequence[int], block_size: int) -> np.ndarray:
    """The token-granular host indices of ``blocks`` (what a ``PoolTransfer`` carries)."""
    b = np.asarray(blocks, dtype=np.int64)
    return (b[:, None] * block_size + np.arange(block_size, dtype=np.int64)).reshape(-1)


def block_parts(layers: Sequence[tuple[str, torch.Tensor]], num_blocks: int
                ) -> list[torch.Tensor]:
    """Each layer tensor as a ``torch.uint8`` view ``[blocks, ...]`` (its block dimension moved
    first, no copy): block ``b`` of a part flattens to that layer's segments of block ``b`` in
    ``BlockPool``'s order."""
    parts = []
    for name, t in layers:
        dim, _ = _block_dim(name, t, num_blocks)  # the same checks as BlockPool's
        part = t.movedim(dim, 0)
        parts.append((part.unsqueeze(1) if part.dim() == 1 else part).view(torch.uint8))
    return parts


def device_pool(layers: Sequence[tuple[str, torch.Tensor]], num_blocks: int, block_size: int):
    """The layers of one KV-cache group as a device page path (``kernels/cuda.DevicePageIO``):
    for KV caches on a GPU, or on CPU when ``copy_path`` asks for it."""
    from hicached.kernels.cuda import DevicePageIO

    if not layers:
        raise ValueError("a KV-cache group needs at least one layer")
    return DevicePageIO.from_parts(block_parts(layers, int(num_blocks)), int(block_size))
