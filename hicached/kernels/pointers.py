"""Pointer path: ``memmove`` of the (pointer, size) segments of SGLang's ``get_page_buffer_meta``.

A host pool that only hands out raw addresses (SGLang's zero-copy surface) describes each page as
``segments_per_page`` segments, e.g. ``[k_ptr, v_ptr]`` (MHA page_first), one pointer (MLA), one
per layer (MLA layer_first), ``k_l0, v_l0, k_l1, v_l1, ...`` (MHA layer_first), temporal then conv
states (Mamba). An arena page is those segments back to back, in *arena order*: a permutation of the
meta order chosen so the arena bytes equal the pool's flat data page (``kernels/reference.py``):

    meta order  (MHA layer_first)   k_l0 v_l0 k_l1 v_l1 ... k_lN v_lN
    arena order                     k_l0 k_l1 ... k_lN v_l0 v_l1 ... v_lN   (= [2, layers, P, h, d])

Segments that touch on both sides (consecutive slots of consecutive host pages) merge into one
``memmove``. ``ctypes.memmove`` releases the GIL; no state is shared between calls.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from hicached.kernels.cpu import as_index_array, check_arena, check_disjoint, check_slots


def mha_layer_first_order(num_layers: int) -> list[int]:
    """Arena order of SGLang's MHA layer_first meta (``k_l, v_l`` per layer): all K, then all V."""
    return list(range(0, 2 * num_layers, 2)) + list(range(1, 2 * num_layers, 2))


def segment_order(pool, segments_per_page: int) -> list[int] | None:
    """Arena order of a pool's meta segments; only SGLang's MHA layer_first interleaves K/V."""
    kv = getattr(pool, "kv_buffer", None)
    if (getattr(pool, "layout", None) == "layer_first" and isinstance(kv, torch.Tensor)
            and kv.dim() == 5 and kv.shape[0] == 2 and segments_per_page == 2 * kv.shape[1]):
        return mha_layer_first_order(int(kv.shape[1]))
    return None


def memmove_runs(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> int:
    """``memmove(dst[i], src[i], sizes[i])`` for all i, merging touching neighbours.

    Addresses are int64 arrays of raw process addresses; returns the number of memmoves issued.
    """
    if dst.size == 0:
        return 0
    touching = (src[:-1] + sizes[:-1] == src[1:]) & (dst[:-1] + sizes[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~touching)))
    run_sizes = np.add.reduceat(sizes, starts)
    calls = 0
    runs = zip(dst[starts].tolist(), src[starts].tolist(), run_sizes.tolist(), strict=True)
    for d, s, count in runs:
        if count:
            ctypes.memmove(d, s, count)
            calls += 1
    return calls


class SegmentPlan:
    """Where each meta segment of a page lands inside an arena page.

    ``segment_bytes``: sizes of one page's segments in meta order (the same for every page).
    ``order``: arena order as a permutation of meta positions; None keeps the meta order.
    """

    def __init__(self, segment_bytes: Sequence[int], order: Sequence[int] | None = None):
        self.segment_bytes = np.asarray(list(segment_bytes), dtype=np.int64)
        count = self.segment_bytes.size
        if count == 0:
            raise ValueError("a page needs at least one segment, got 0")
        if (self.segment_bytes < 0).any():
            raise ValueError(f"segment sizes must be >= 0, got {self.segment_bytes.tolist()}")
        self.order = np.arange(count) if order is None else np.asarray(list(order), np.int64)
        if sorted(self.order.tolist()) != list(range(count)):
            raise ValueError(f"order {self.order.tolist()} is not a permutation of 0..{count - 1}")
        self.segments_per_page = count
        self.page_bytes = int(self.segment_bytes.sum())
        # Arena offset (inside the page) of each segment, indexed by meta position.
        in_arena_order = self.segment_bytes[self.order]
        starts = np.cumsum(in_arena_order) - in_arena_order
        self.inner_offsets = np.empty(count, dtype=np.int64)
        self.inner_offsets[self.order] = starts

    def to_arena(self, ptrs, sizes, arena: torch.Tensor, offsets) -> None:
        """Copy page i's segments (``ptrs``/``sizes`` of all pages, meta order) to slot i."""
        self._copy(ptrs, sizes, arena, offsets, to_arena=True)

    def from_arena(self, ptrs, sizes, arena: torch.Tensor, offsets) -> None:
        """Copy slot i's bytes back into page i's segments."""
        self._copy(ptrs, sizes, arena, offsets, to_arena=False)

    def _copy(self, ptrs, sizes, arena: torch.Tensor, offsets, to_arena: bool) -> None:
        offsets = as_index_array(offsets, "offsets")
        check_arena(arena)
        check_slots(offsets, self.page_bytes, arena.numel())
        if to_arena:
            check_disjoint(offsets, self.page_bytes)
        n, per_page = offsets.size, self.segments_per_page
        host = np.asarray(list(ptrs), dtype=np.int64)
        seg_sizes = np.asarray(list(sizes), dtype=np.int64)
        if host.size != n * per_page or seg_sizes.size != n * per_page:
            raise ValueError(
                f"{n} pages x {per_page} segments need {n * per_page} pointers and sizes, "
                f"got {host.size} and {seg_sizes.size}"
            )
        if n == 0:
            return
        seg_sizes = seg_sizes.reshape(n, per_page)
        mismatch = np.flatnonzero((seg_sizes != self.segment_bytes).any(axis=1))
        if mismatch.size:
            i = int(mismatch[0])
            raise ValueError(
                f"page {i} has segment sizes {seg_sizes[i].tolist()}, expected "
                f"{self.segment_bytes.tolist()}"
            )
        dst = arena.data_ptr() + offsets[:, None] + self.inner_offsets[None, :]
        order = self.order
        host_run = host.reshape(n, per_page)[:, order].ravel()
        arena_run = dst[:, order].ravel()
        size_run = seg_sizes[:, order].ravel()
        if to_arena:
            memmove_runs(arena_run, host_run, size_run)
        else:
            memmove_runs(host_run, arena_run, size_run)
