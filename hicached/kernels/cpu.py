"""Fast CPU page copies between a host pool's tensors and arena slots, with plain torch ops.

Every pool is described by its *page-major parts*: one ``torch.uint8`` view per part whose dim 0 is
the page number, so ``part[p]`` holds exactly the bytes that part contributes to page ``p`` in the
arena format of ``kernels/reference.py``:

    contiguous pages (page_first, page_first_direct, mamba)   [num_pages, part_bytes]
    layer_first pages (strided: one chunk per layer)          [num_pages, layers, chunk_bytes]

An arena page is the parts back to back; a batch of pages goes to slots at byte offsets:

    arena  |.. slot i: [ part 0 | part 1 ] ..| slot i+1: [ part 0 | part 1 ] ..|
           ^ offsets[i]                       ^ offsets[i] + stride (stride >= page_bytes)

``PageCopier`` cuts a batch into runs of slots ``stride`` bytes apart and per run issues, for each
part, ONE torch copy: a slice ``copy_`` when the host pages are consecutive too (memcpy speed), an
``index_select`` / ``index_copy_`` over the run when they are scattered, and a per-page ``copy_``
only for isolated slots. No Python work per token or per element. Copies release the GIL and share
no scratch state, so concurrent calls on disjoint pages are safe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import torch

# Wider element types for index ops: index_copy_ moves one element per step, so copying uint8 rows
# as 16-byte elements is ~10x faster. Only used for plain moves, never arithmetic (bits stay exact).
NUMPY_COPY_MAX = 256 * 1024  # copies (a page, a run of pages) up to this size go through numpy
SMALL_COPY = 64  # pages a copy call checks and splits into runs with plain ints (``_copy_small``)
_WIDE_DTYPES = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16))


def page_major_parts(
    kind: str, layout: str, page_size: int, buffers: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Page-major ``torch.uint8`` views (no copies) of a pool's buffers, in arena part order.

    ``buffers`` are the pool tensors in the geometry of ``kernels/reference.py`` (contiguous);
    parts with zero bytes (a conv-only Mamba's temporal state) are left out.
    """

    def contiguous_pages(tensor: torch.Tensor, num_pages: int) -> torch.Tensor:
        return tensor.reshape(num_pages, -1).view(torch.uint8)

    def layer_first_pages(tensor: torch.Tensor) -> torch.Tensor:
        # [layers, tokens, ...] -> [layers, pages, page_elems] -> [pages, layers, page_elems]
        layers, tokens = tensor.shape[0], tensor.shape[1]
        per_layer = tensor.reshape(layers, tokens // page_size, -1)
        return per_layer.permute(1, 0, 2).view(torch.uint8)

    if kind in ("mha", "mla"):
        kv = buffers[0]
        halves = [kv[0], kv[1]] if kind == "mha" else [kv]
        if layout == "layer_first":
            return [layer_first_pages(half) for half in halves]
        if layout == "page_first":
            return [contiguous_pages(half, half.shape[0] // page_size) for half in halves]
        if layout == "page_first_direct":
            return [contiguous_pages(half, half.shape[0]) for half in halves]
    elif kind == "mamba" and layout in ("page_first", "page_first_direct"):
        return [contiguous_pages(c, c.shape[0]) for c in buffers if c.numel() > 0]
    elif kind == "indexer":
        buf = buffers[0]
        if layout == "layer_first":
            return [buf.permute(1, 0, 2).view(torch.uint8)]
        if layout in ("page_first", "page_first_direct"):
            return [contiguous_pages(buf, buf.shape[0])]
    raise ValueError(f"no page-major view for pool kind {kind!r} with layout {layout!r}")


def as_index_array(values, name: str) -> np.ndarray:
    """``values`` (list, numpy array or CPU tensor of ints) as a 1-D int64 numpy array."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(array.shape)}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def check_arena(arena: torch.Tensor) -> None:
    """Raise unless ``arena`` is a 1-D contiguous ``torch.uint8`` CPU tensor."""
    if not isinstance(arena, torch.Tensor):
        raise TypeError(f"arena must be a torch.Tensor, got {type(arena).__name__}")
    if arena.dtype != torch.uint8 or arena.dim() != 1 or arena.device.type != "cpu":
        raise ValueError(
            f"arena must be a 1-D torch.uint8 CPU tensor, got {arena.dtype} "
            f"shape {tuple(arena.shape)} on {arena.device}"
        )
    if arena.numel() > 1 and arena.stride(0) != 1:
        raise ValueError(f"arena must be contiguous, got stride {arena.stride(0)}")


def check_slots(offsets: np.ndarray, page_bytes: int, arena_bytes: int) -> None:
    """Raise ValueError unless every ``[offset, offset + page_bytes)`` lies inside the arena."""
    if offsets.size == 0:
        return
    bad = np.flatnonzero((offsets < 0) | (offsets > arena_bytes - page_bytes))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"arena slot {i} at offset {int(offsets[i])} + {page_bytes} page bytes is outside "
            f"the arena of {arena_bytes} bytes"
        )


def check_disjoint(offsets: np.ndarray, page_bytes: int) -> None:
    """Raise ValueError if two destination slots ``[offset, offset + page_bytes)`` overlap."""
    if offsets.size < 2:
        return
    ordered = np.sort(offsets)
    bad = np.flatnonzero(np.diff(ordered) < page_bytes)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"arena slots at offsets {int(ordered[i])} and {int(ordered[i + 1])} "
                         f"overlap (page_bytes {page_bytes})")


def _wide_dtype(*byte_counts: int) -> torch.dtype | None:
    """The widest plain dtype whose size divides every byte count, or None (bytes only)."""
    common = 0
    for count in byte_counts:
        common = math.gcd(common, int(count))
    for size, dtype in _WIDE_DTYPES:
        if common % size == 0:
            return dtype
    return None


class PageCopier:
    """Copies pages between page-major host parts and arena slots (see the module docstring).

    ``parts``: ``torch.uint8`` views ``[num_pages, part_bytes]`` or ``[num_pages, layers,
    chunk_bytes]`` with a contiguous last dim, as built by :func:`page_major_parts`.
    """

    def __init__(self, parts: Sequence[torch.Tensor]):
        if not parts:
            raise ValueError("a page copier needs at least one part")
        self.num_pages = int(parts[0].shape[0])
        self._parts: list[tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...]]] = []
        offset = 0
        for i, part in enumerate(parts):
            if part.dtype != torch.uint8 or part.dim() not in (2, 3) or part.stride(-1) != 1:
                raise ValueError(
                    f"part {i} must be a uint8 [pages, bytes] or [pages, layers, bytes] view with "
                    f"a contiguous last dim, got {part.dtype} shape {tuple(part.shape)} "
                    f"strides {part.stride()}"
                )
            if part.shape[0] != self.num_pages:
                raise ValueError(
                    f"part {i} has {part.shape[0]} pages, part 0 has {self.num_pages}"
                )
            shape = tuple(int(s) for s in part.shape[1:])
            inner = (shape[1], 1) if len(shape) == 2 else (1,)  # C order inside the arena page
            self._parts.append((part, offset, shape, inner))
            offset += math.prod(shape)
        self.page_bytes = offset
        # numpy views of the parts for small copies (``_np_copy``): ~3 us a 4 KiB page against
        # torch's ~15 (its per-op overhead), and never split across torch's threads, which on
        # a busy node wait for a core (hundreds of us); large copies keep torch's parallel copy
        self._np_parts = None
        try:
            self._np_parts = [(part.numpy(), part_offset, shape, inner)
                              for part, part_offset, shape, inner in self._parts]
        except (RuntimeError, TypeError):  # (a view numpy cannot take: torch copies)
            pass

    def to_arena(self, pages, arena: torch.Tensor, offsets) -> None:
        """Copy host page ``pages[i]`` to ``arena[offsets[i] : offsets[i] + page_bytes]``."""
        self._copy(pages, arena, offsets, to_arena=True)

    def from_arena(self, pages, arena: torch.Tensor, offsets) -> None:
        """Copy ``arena[offsets[i] : offsets[i] + page_bytes]`` into host page ``pages[i]``.

        Two slots naming the same host page in one call leave either one's bytes there.
        """
        self._copy(pages, arena, offsets, to_arena=False)

    def copy_run(self, first_page: int, count: int, arena: torch.Tensor, offset: int,
                 stride: int, to_arena: bool) -> None:
        """Host pages ``first_page .. first_page + count - 1`` <-> the slots ``offset + k *
        stride``: the common batch (a prefix's pages in a row, its slots handed out in a row),
        checked with a few integer comparisons instead of the array checks of ``_copy`` (this
        runs between large copies, with the CPU caches cold, where each numpy call costs
        microseconds)."""
        if count <= 0:
            return
        check_arena(arena)
        last = offset + (count - 1) * stride
        if stride < self.page_bytes or offset < 0 or last > arena.numel() - self.page_bytes:
            raise ValueError(f"{count} slots from offset {offset} every {stride} bytes (page_bytes "
                             f"{self.page_bytes}) do not fit the arena of {arena.numel()} bytes")
        if first_page < 0 or first_page + count > self.num_pages:
            raise ValueError(f"pages {first_page}..{first_page + count - 1} are outside "
                             f"0..{self.num_pages - 1}")
        if count == 1:
            self._copy_one(first_page, arena, offset, to_arena)
        else:
            self._copy_run(first_page, count, arena, offset, stride, to_arena)

    def _copy(self, pages, arena: torch.Tensor, offsets, to_arena: bool) -> None:
        pages = as_index_array(pages, "pages")
        offsets = as_index_array(offsets, "offsets")
        if pages.size != offsets.size:
            raise ValueError(f"{pages.size} pages but {offsets.size} arena offsets")
        check_arena(arena)
        if 0 < pages.size <= SMALL_COPY and self._copy_small(pages.tolist(), offsets.tolist(),
                                                         arena, to_arena):
            return
        check_slots(offsets, self.page_bytes, arena.numel())
        bad = np.flatnonzero((pages < 0) | (pages >= self.num_pages))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"page {int(pages[i])} (item {i}) is outside 0..{self.num_pages - 1}")
        if to_arena:
            check_disjoint(offsets, self.page_bytes)
        if pages.size == 0 or self.page_bytes == 0:
            return
        # Slot stride of this batch: the smallest gap between slots that does not overlap a page,
        # so slots coalesce whether the allocator packs them or rounds them up (slabs.stride_for).
        # Any stride is correct (rows are exact per grid); a good one means fewer, larger copies.
        gaps = np.diff(np.sort(offsets))
        usable = gaps[gaps >= self.page_bytes]
        stride = int(usable.min()) if usable.size else self.page_bytes
        # Slots on one grid (same offset % stride, e.g. one slab) are rows of one strided view.
        residues = offsets % stride
        if (residues == residues[0]).all():
            self._copy_grid(pages, offsets, arena, stride, to_arena)
            return
        order = np.argsort(residues, kind="stable")
        bounds = np.flatnonzero(np.diff(residues[order])) + 1
        for group in np.split(order, bounds):
            self._copy_grid(pages[group], offsets[group], arena, stride, to_arena)

    def _copy_small(self, pages: list[int], offsets: list[int], arena: torch.Tensor,
                    to_arena: bool) -> bool:
        """``_copy`` of a few pages with plain ints (each numpy call costs microseconds, 16
        scattered pages ~40 of them): runs of consecutive host pages into evenly spaced slots
        as one copy, the others page by page. False, having copied nothing, when a check fails:
        ``_copy``'s array checks then raise their errors."""
        pb, n = self.page_bytes, len(pages)
        top = arena.numel() - pb
        if (min(offsets) < 0 or max(offsets) > top or min(pages) < 0
                or max(pages) >= self.num_pages):
            return False
        if to_arena and n > 1:
            ordered = sorted(offsets)
            if any(b - a < pb for a, b in pairwise(ordered)):
                return False
        if pb == 0:
            return True
        i = 0
        while i < n:
            j = i + 1
            if j < n and pages[j] == pages[i] + 1 and (stride := offsets[j] - offsets[i]) >= pb:
                j += 1
                while (j < n and pages[j] == pages[j - 1] + 1
                       and offsets[j] - offsets[j - 1] == stride):
                    j += 1
                self._copy_run(pages[i], j - i, arena, offsets[i], stride, to_arena)
            else:
                self._copy_one(pages[i], arena, offsets[i], to_arena)
            i = j
        return True

    def _copy_grid(
        self, pages: np.ndarray, offsets: np.ndarray, arena: torch.Tensor, stride: int,
        to_arena: bool,
    ) -> None:
        """Pages into slots on one grid: every offset is ``min(offsets) + row * stride``."""
        if pages.size == 1:
            self._copy_one(int(pages[0]), arena, int(offsets[0]), to_arena)
            return
        base = int(offsets.min())
        rows = (offsets - base) // stride
        host_consecutive = bool((np.diff(pages) == 1).all())
        rows_consecutive = bool((np.diff(rows) == 1).all())
        if host_consecutive and rows_consecutive:
            self._copy_run(int(pages[0]), pages.size, arena, int(offsets[0]), stride, to_arena)
        elif rows_consecutive:
            self._copy_gather(pages, arena, int(offsets[0]), stride, to_arena)
        elif host_consecutive:
            self._copy_scatter(int(pages[0]), rows, arena, base, stride, to_arena)
        else:
            # Both sides scattered: split where the slots stop being consecutive.
            cuts = np.flatnonzero(np.diff(rows) != 1) + 1
            runs = zip(np.split(pages, cuts), np.split(offsets, cuts), strict=True)
            for run_pages, run_offsets in runs:
                self._copy_grid(run_pages, run_offsets, arena, stride, to_arena)

    def _grid(self, arena: torch.Tensor, base: int, rows: int, stride: int, part_index: int):
        """Arena view [rows, *part shape] of one part in slots ``base + k * stride``."""
        _, part_offset, shape, inner = self._parts[part_index]
        return arena[base + part_offset :].as_strided((rows, *shape), (stride, *inner))

    def _np_copy(self, page: int, count: int, arena: torch.Tensor, offset: int, stride: int,
                 to_arena: bool) -> None:
        """``_copy_run`` through numpy views (the slots ``offset + k * stride``)."""
        flat = arena.numpy()
        for part, part_offset, shape, inner in self._np_parts:
            slots = np.ndarray((count, *shape), np.uint8, flat, offset + part_offset,
                               (stride, *inner))
            if to_arena:
                slots[...] = part[page:page + count]
            else:
                part[page:page + count] = slots

    def _copy_one(self, page: int, arena: torch.Tensor, offset: int, to_arena: bool) -> None:
        if self._np_parts is not None and self.page_bytes <= NUMPY_COPY_MAX:
            self._np_copy(page, 1, arena, offset, self.page_bytes, to_arena)
            return
        for part, part_offset, shape, _ in self._parts:
            start = offset + part_offset
            view = arena[start : start + math.prod(shape)].view(shape)
            if to_arena:
                view.copy_(part[page])
            else:
                part[page].copy_(view)

    def _copy_run(
        self, page: int, count: int, arena: torch.Tensor, offset: int, stride: int, to_arena: bool
    ) -> None:
        if self._np_parts is not None and count * self.page_bytes <= NUMPY_COPY_MAX:
            self._np_copy(page, count, arena, offset, stride, to_arena)
            return
        for i, (part, part_offset, shape, _) in enumerate(self._parts):
            if stride == self.page_bytes == shape[0] and part.is_contiguous():
                # one part, packed slots, contiguous host pages: a flat copy (what memcpy does;
                # a strided 2-D view splits worse across torch's threads)
                start = offset + part_offset
                view = arena[start : start + count * stride]
                host = part[page : page + count].view(-1)
                if to_arena:
                    view.copy_(host)
                else:
                    host.copy_(view)
                continue
            view = self._grid(arena, offset, count, stride, i)
            if to_arena:
                view.copy_(part[page : page + count])
            else:
                part[page : page + count].copy_(view)

    def _wide(self, part_index: int, stride: int, arena_start: int) -> torch.dtype | None:
        """Widest dtype both views of a part can take: every byte stride and start divides."""
        part, _, shape, _ = self._parts[part_index]
        return _wide_dtype(shape[-1], *part.stride()[:-1], part.storage_offset(), stride,
                           arena_start)

    def _copy_gather(
        self, pages: np.ndarray, arena: torch.Tensor, offset: int, stride: int, to_arena: bool
    ) -> None:
        """Scattered host ``pages`` <-> consecutive slots from ``offset``: one index op a part."""
        index = torch.from_numpy(pages)
        for i, (part, part_offset, *_) in enumerate(self._parts):
            view = self._grid(arena, offset, pages.size, stride, i)
            wide = self._wide(i, stride, arena.storage_offset() + offset + part_offset)
            host = part if wide is None else part.view(wide)
            view = view if wide is None else view.view(wide)
            if to_arena:
                torch.index_select(host, 0, index, out=view)
            elif wide is not None:
                host.index_copy_(0, index, view)
            else:  # uint8 index_copy_ runs at ~1 GB/s: go page by page
                for j, page in enumerate(pages.tolist()):
                    host[page].copy_(view[j])

    def _copy_scatter(
        self, first_page: int, rows: np.ndarray, arena: torch.Tensor, base: int, stride: int,
        to_arena: bool,
    ) -> None:
        """Consecutive host pages from ``first_page`` <-> slots ``base + rows * stride``."""
        index = torch.from_numpy(rows)
        count, num_rows = rows.size, int(rows.max()) + 1
        for i, (part, part_offset, *_) in enumerate(self._parts):
            grid = self._grid(arena, base, num_rows, stride, i)
            host = part[first_page : first_page + count]
            wide = self._wide(i, stride, arena.storage_offset() + base + part_offset)
            if wide is not None:
                grid, host = grid.view(wide), host.view(wide)
            if not to_arena:
                torch.index_select(grid, 0, index, out=host)
            elif wide is not None:
                grid.index_copy_(0, index, host)
            else:  # uint8 index_copy_ runs at ~1 GB/s: go page by page
                for j, row in enumerate(rows.tolist()):
                    grid[row].copy_(host[j])
