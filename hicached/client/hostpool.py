"""Host pools as the client copies them: hicached's own ``HostPool`` and ``make_page_io``.

``HostPool`` wraps plain CPU tensors in SGLang's host-pool geometries (MHA, MLA, Mamba, DSA
indexer; layouts in ``kernels/reference.py``) and speaks SGLang's host-pool surface, so tests and
the reference engine can stand it in for SGLang's pools. ``make_page_io(pool)`` turns any pool
into a ``PageIO`` (``kernels/pageio.py``), picking the fastest path the object offers:

    1. HostPool                    -> NativePageIO   torch copies over page-major views (cpu.py)
    2. has get_page_buffer_meta    -> PointerPageIO  memmove of (ptr, size) segments (pointers.py)
    3. has the flat page accessors -> FlatPageIO     get_data_page / set_from_flat_data_page

All three put a page into the arena in the same byte order (the pool's flat data page), so a page
written through one path reads back correctly through any other.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hicached.kernels import reference
from hicached.kernels.cpu import (
    PageCopier,
    as_index_array,
    check_arena,
    check_disjoint,
    check_slots,
    page_major_parts,
)
from hicached.kernels.pageio import PageIO
from hicached.kernels.pointers import SegmentPlan, segment_order

log = logging.getLogger(__name__)

__all__ = ["PATHS", "FlatPageIO", "HostPool", "NativePageIO", "PageIO", "PointerPageIO",
           "make_page_io"]

PATHS = ("native", "pointer", "flat")
_FLAT_METHODS = ("get_data_page", "set_from_flat_data_page", "get_dummy_flat_data_page")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


class HostPool:
    """A host pool built from CPU tensors (see ``kernels/reference.py`` for the geometries).

    ``kind``: "mha" | "mla" | "mamba" | "indexer". ``buffers``: the pool tensors (one, or the Mamba
    components: temporal/SSM state first, then conv_0..n). Indices are token-granular as in SGLang:
    a page is named by the token index of its start (a multiple of ``page_size``).
    """

    def __init__(self, kind: str, layout: str, page_size: int, buffers: Sequence[torch.Tensor]):
        _require(kind in reference.KINDS, f"unknown pool kind {kind!r}; valid: {reference.KINDS}")
        _require(layout in reference.LAYOUTS,
                 f"unknown layout {layout!r}; valid: {reference.LAYOUTS}")
        _require(page_size >= 1, f"page_size must be >= 1, got {page_size}")
        _require(len(buffers) >= 1, "a pool needs at least one buffer, got 0")
        for i, buf in enumerate(buffers):
            _require(
                isinstance(buf, torch.Tensor) and buf.device.type == "cpu" and buf.is_contiguous(),
                f"buffer {i} must be a contiguous CPU tensor",
            )
        self.kind, self.layout, self.page_size = kind, layout, int(page_size)
        self.buffers = list(buffers)
        self.size = self._check_geometry()  # tokens (Mamba: slots)
        self.page_num = self.size // self.page_size
        # SGLang's Mamba pool reports the conv dtype; its flat pages are bytes.
        self.dtype = self.buffers[-1].dtype
        self.page_parts = page_major_parts(kind, layout, self.page_size, self.buffers)
        self.page_bytes = sum(int(np.prod(p.shape[1:])) for p in self.page_parts)
        _require(self.page_bytes > 0, f"a {kind} pool with 0 bytes per page is not copyable")
        if kind in ("mha", "mla"):
            self.kv_buffer = self.buffers[0]
            # layers sit after [K/V,] then tokens (page_first) or pages (page_first_direct)
            layer_dim = (0 if layout == "layer_first" else 1) + (kind == "mha")
            self.layer_num = int(self.kv_buffer.shape[layer_dim])
            if kind == "mha":
                self.k_buffer, self.v_buffer = self.kv_buffer[0], self.kv_buffer[1]
        elif kind == "mamba":
            self.temporal_buffer, self.conv_buffer = self.buffers[0], self.buffers[1:]
            self.layer_num = int(self.buffers[0].shape[1])
        else:
            self.index_k_with_scale_buffer = self.buffers[0]
            self.layer_num = int(self.buffers[0].shape[0 if layout == "layer_first" else 1])

    def _check_geometry(self) -> int:
        kind, layout, p, first = self.kind, self.layout, self.page_size, self.buffers[0]
        shape, ndim = tuple(first.shape), first.dim()
        if kind == "mamba":
            _require(layout != "layer_first", "mamba pools need page_first or page_first_direct")
            _require(p == 1, f"mamba pools have page_size 1 (one slot per state), got {p}")
            for i, comp in enumerate(self.buffers):
                _require(comp.dim() >= 2 and comp.shape[0] == shape[0],
                         f"mamba component {i} has shape {tuple(comp.shape)}; need "
                         f"[{shape[0]} slots, mamba_layers, *state]")
            return shape[0]
        _require(len(self.buffers) == 1, f"a {kind} pool has one buffer, got {len(self.buffers)}")
        if kind == "indexer":
            want = 3 if layout == "layer_first" else 4
            _require(ndim == want and (layout == "layer_first" or shape[2] == 1),
                     f"indexer {layout} buffer must be "
                     + ("[layers, pages, page_elems]" if want == 3 else
                        "[pages, layers, 1, page_elems]") + f", got {shape}")
            return shape[1 if layout == "layer_first" else 0] * p
        lead = (2,) if kind == "mha" else ()
        want = len(lead) + (5 if layout == "page_first_direct" else 4)
        _require(ndim == want and shape[: len(lead)] == lead,
                 f"{kind} {layout} buffer must have {want} dims"
                 + (" with dim 0 == 2 (K, V)" if lead else "") + f", got {shape}")
        body = shape[len(lead):]
        if layout == "page_first_direct":
            _require(body[2] == p, f"page_first_direct dim of page_size is {body[2]}, not {p}")
            return body[0] * p
        tokens = body[1] if layout == "layer_first" else body[0]
        _require(tokens % p == 0, f"{tokens} tokens is not a multiple of page_size {p}")
        return tokens

    # ------------------------------------------------------------ constructors

    @classmethod
    def mha(cls, kv_buffer: torch.Tensor, layout: str, page_size: int) -> HostPool:
        """MHA pool over ``kv_buffer``: layer_first [2, layers, tokens, heads, dim],
        page_first [2, tokens, layers, heads, dim],
        page_first_direct [2, pages, layers, page_size, heads, dim]."""
        return cls("mha", layout, page_size, [kv_buffer])

    @classmethod
    def mla(cls, kv_buffer: torch.Tensor, layout: str, page_size: int) -> HostPool:
        """MLA pool: [layers, tokens, 1, kv_dim] / [tokens, layers, 1, kv_dim] /
        [pages, layers, page_size, 1, kv_dim]."""
        return cls("mla", layout, page_size, [kv_buffer])

    @classmethod
    def mamba(cls, components: Sequence[torch.Tensor], layout: str = "page_first") -> HostPool:
        """Mamba state pool (page_size 1): components [slots, mamba_layers, *state_shape], the
        temporal/SSM state first, then conv_0..n; dtypes may differ per component."""
        return cls("mamba", layout, 1, list(components))

    @classmethod
    def indexer(cls, buffer: torch.Tensor, layout: str, page_size: int) -> HostPool:
        """DSA indexer pool (SGLang's geometry; uint8 in SGLang, any dtype here): layer_first
        [layers, pages, page_elems], page_first(_direct) [pages, layers, 1, page_elems]."""
        return cls("indexer", layout, page_size, [buffer])

    @classmethod
    def allocate_mha(cls, num_pages: int, page_size: int, layers: int, heads: int, head_dim: int,
                     layout: str = "page_first", dtype: torch.dtype = torch.bfloat16) -> HostPool:
        """A zeroed MHA pool of ``num_pages`` pages."""
        tokens, body = num_pages * page_size, (heads, head_dim)
        shape = {"layer_first": (2, layers, tokens, *body),
                 "page_first": (2, tokens, layers, *body),
                 "page_first_direct": (2, num_pages, layers, page_size, *body)}[layout]
        return cls.mha(torch.zeros(shape, dtype=dtype), layout, page_size)

    @classmethod
    def allocate_mla(cls, num_pages: int, page_size: int, layers: int, kv_dim: int,
                     layout: str = "page_first", dtype: torch.dtype = torch.bfloat16) -> HostPool:
        """A zeroed MLA pool of ``num_pages`` pages."""
        tokens = num_pages * page_size
        shape = {"layer_first": (layers, tokens, 1, kv_dim),
                 "page_first": (tokens, layers, 1, kv_dim),
                 "page_first_direct": (num_pages, layers, page_size, 1, kv_dim)}[layout]
        return cls.mla(torch.zeros(shape, dtype=dtype), layout, page_size)

    @classmethod
    def allocate_mamba(cls, num_slots: int, mamba_layers: int, temporal_shape: Sequence[int],
                       conv_shapes: Sequence[Sequence[int]],
                       temporal_dtype: torch.dtype = torch.float32,
                       conv_dtype: torch.dtype = torch.bfloat16,
                       layout: str = "page_first") -> HostPool:
        """A zeroed Mamba pool, components [slots, mamba_layers, 1, *shape] as in SGLang."""
        lead = (num_slots, mamba_layers, 1)
        comps = [torch.zeros((*lead, *temporal_shape), dtype=temporal_dtype)]
        comps += [torch.zeros((*lead, *shape), dtype=conv_dtype) for shape in conv_shapes]
        return cls.mamba(comps, layout)

    @classmethod
    def allocate_indexer(cls, num_pages: int, page_size: int, layers: int, page_elems: int,
                         layout: str = "page_first", dtype: torch.dtype = torch.uint8) -> HostPool:
        """A zeroed DSA indexer pool (``page_elems`` elements per page per layer)."""
        shape = ((layers, num_pages, page_elems) if layout == "layer_first"
                 else (num_pages, layers, 1, page_elems))
        return cls.indexer(torch.zeros(shape, dtype=dtype), layout, page_size)

    # ------------------------------------------------------------ SGLang host-pool surface

    def _page_index(self, index: Any) -> int:
        return int(self._page_starts([int(index)])[0])

    def _page_starts(self, token_starts: Any) -> np.ndarray:
        """``token_starts`` as int64, each checked to be a page start inside the pool."""
        starts = as_index_array(token_starts, "indices")
        bad = np.flatnonzero((starts % self.page_size != 0) | (starts < 0)
                             | (starts > self.size - self.page_size))
        if bad.size:
            raise ValueError(f"token index {int(starts[bad[0]])} is not a page start of this pool "
                             f"(page_size {self.page_size}, {self.size} tokens)")
        return starts

    def _sglang_page(self, t: int) -> torch.Tensor:
        """The page at token ``t`` shaped as SGLang's ``get_data_page(flat=False)`` (a view)."""
        buf, tokens = self.buffers[0], slice(t, t + self.page_size)
        pages = slice(t // self.page_size, t // self.page_size + 1)
        if self.kind == "indexer":
            return buf[:, pages] if self.layout == "layer_first" else buf[pages]
        lead = (slice(None),) if self.kind == "mha" else ()  # MHA keeps its K/V dim
        if self.layout == "layer_first":
            return buf[(*lead, slice(None), tokens)]
        return buf[(*lead, tokens if self.layout == "page_first" else pages)]

    def get_data_page(self, index: Any, flat: bool = True) -> torch.Tensor:
        """The page at token ``index``: a view (flat: 1-D, pool dtype; a copy when strided).
        Mamba pages are a new 1-D uint8 tensor of the components' bytes, as in SGLang."""
        t = self._page_index(index)
        if self.kind == "mamba":
            return reference.read_page(self.kind, self.layout, 1, self.buffers, t)
        page = self._sglang_page(t)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zeroed flat page (pool dtype; uint8 for Mamba)."""
        if self.kind == "mamba":
            return torch.zeros(self.page_bytes, dtype=torch.uint8)
        return torch.zeros(self.page_bytes // self.dtype.itemsize, dtype=self.dtype)

    def set_from_flat_data_page(self, index: Any, data_page: torch.Tensor) -> None:
        """Scatter a flat page (pool dtype, or its raw uint8 bytes) into the page at ``index``."""
        t = self._page_index(index)
        nbytes = data_page.numel() * data_page.element_size()
        _require(nbytes == self.page_bytes,
                 f"flat page has {nbytes} bytes, pages of this pool have {self.page_bytes}")
        flat = data_page.contiguous().reshape(-1)
        if self.kind == "mamba":
            reference.write_page(self.kind, self.layout, 1, self.buffers, t, flat.view(torch.uint8))
            return
        page = self._sglang_page(t)
        page.copy_(flat.view(self.dtype).reshape(page.shape))

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        """SGLang's zero-copy meta: per page (``indices`` token-granular, ``page_size`` per page)
        the (pointer, bytes) segments. Page layouts: one per part ([k, v] for MHA; temporal then
        conv for Mamba); layer_first: one per layer per part (``k_l, v_l`` interleaved for MHA)."""
        idx = as_index_array(indices, "indices")
        _require(idx.size % self.page_size == 0,
                 f"{idx.size} indices is not a multiple of page_size {self.page_size}")
        pages = self._page_starts(idx[:: self.page_size]) // self.page_size
        columns: list[np.ndarray] = []
        sizes: list[int] = []
        layered = self.page_parts[0].dim() == 3
        for layer in range(self.layer_num if layered else 1):
            for part in self.page_parts:
                base = part.data_ptr() + (layer * part.stride(1) if layered else 0)
                columns.append(base + pages * part.stride(0))
                sizes.append(int(part.shape[-1]))
        ptrs = np.stack(columns, axis=1).reshape(-1).tolist() if columns else []
        return ptrs, sizes * pages.size

    def get_size_per_token(self) -> int:
        """Bytes per token (per slot for Mamba), all layers and parts."""
        return self.page_bytes // self.page_size

    def get_ksize_per_token(self) -> int:
        """Bytes per token of the K part (half of MHA; the whole for the others)."""
        return self.get_size_per_token() // (2 if self.kind == "mha" else 1)

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        """The tensors to register with an RDMA layer ([K, V] for MHA)."""
        if self.kind == "mha":
            return [self.k_buffer, self.v_buffer]
        return [b for b in self.buffers if b.numel() > 0]


class NativePageIO(PageIO):
    """A ``HostPool`` copied with torch ops over its page-major views (``kernels/cpu.py``)."""

    path = "native"

    def __init__(self, pool: HostPool):
        self.pool = pool
        self.page_size, self.capacity_tokens = pool.page_size, pool.size
        self._copier = PageCopier(pool.page_parts)
        self.page_bytes = self._copier.page_bytes

    def to_arena(self, token_starts, arena, offsets) -> None:
        if not self._in_a_row(token_starts, arena, offsets, True):
            starts, offs = self._check(token_starts, offsets)
            self._copier.to_arena(starts // self.page_size, arena, offs)

    def from_arena(self, token_starts, arena, offsets) -> None:
        if not self._in_a_row(token_starts, arena, offsets, False):
            starts, offs = self._check(token_starts, offsets)
            self._copier.from_arena(starts // self.page_size, arena, offs)

    def _in_a_row(self, token_starts, arena, offsets, to_arena: bool) -> bool:
        """Copy and return True when both sides run in a row (lists of pages one after the other
        into slots one stride apart), the client's usual call; else False (the general path)."""
        if type(token_starts) is not list or type(offsets) is not list:
            return False
        n, ps = len(token_starts), self.page_size
        if n < 2 or len(offsets) != n:
            return False
        s0, o0, o1 = token_starts[0], offsets[0], offsets[1]
        if type(s0) is not int or type(o0) is not int or type(o1) is not int:
            return False
        stride, end = o1 - o0, s0 + n * ps
        if (stride < self.page_bytes
                or s0 < 0 or s0 % ps or end > (self.capacity_tokens or end)
                or token_starts != list(range(s0, end, ps))
                or offsets != list(range(o0, o0 + n * stride, stride))):
            return False  # the general path checks (and names) whatever is wrong
        self._copier.copy_run(s0 // ps, n, arena, o0, stride, to_arena)
        return True


def _flat_page_bytes(pool: Any) -> int | None:
    """Bytes of the pool's flat data page (``get_dummy_flat_data_page``), None without one."""
    page = pool.get_dummy_flat_data_page() if hasattr(pool, "get_dummy_flat_data_page") else None
    return int(page.numel() * page.element_size()) if isinstance(page, torch.Tensor) else None


def _capacity(pool: Any) -> int | None:
    size = getattr(pool, "size", None)
    return int(size) if isinstance(size, (int, np.integer)) else None


class PointerPageIO(PageIO):
    """A pool exposing SGLang's ``get_page_buffer_meta``: memmove per segment (``pointers.py``).

    Probes the meta of page 0 once to learn the segments; raises ValueError if the pool refuses
    (e.g. an unsupported layout) or its segments do not add up to its flat data page (else, if
    it has none, to ``get_size_per_token() * page_size``: not per token in every SGLang pool).
    """

    path = "pointer"

    def __init__(self, pool: Any):
        self.pool = pool
        self.page_size, self.capacity_tokens = int(pool.page_size), _capacity(pool)
        meta = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        if meta is None:
            raise ValueError(f"{type(pool).__name__}.get_page_buffer_meta returned None")
        ptrs, sizes = meta
        self._plan = SegmentPlan(list(sizes), segment_order(pool, len(ptrs)))
        self.page_bytes = self._plan.page_bytes
        per_token = getattr(pool, "get_size_per_token", None)
        expected = _flat_page_bytes(pool) or (per_token() * self.page_size if callable(per_token)
                                               else None)
        if isinstance(expected, int) and expected != self.page_bytes:
            raise ValueError(f"meta segments cover {self.page_bytes} bytes per page, the pool "
                             f"says {expected}")

    def _meta(self, starts: np.ndarray) -> tuple[list[int], list[int]]:
        indices = (starts[:, None] + np.arange(self.page_size, dtype=np.int64)).reshape(-1)
        return self.pool.get_page_buffer_meta(torch.from_numpy(indices))

    def to_arena(self, token_starts, arena, offsets) -> None:
        starts, offs = self._check(token_starts, offsets)
        if starts.size:
            self._plan.to_arena(*self._meta(starts), arena, offs)

    def from_arena(self, token_starts, arena, offsets) -> None:
        starts, offs = self._check(token_starts, offsets)
        if starts.size:
            self._plan.from_arena(*self._meta(starts), arena, offs)


class FlatPageIO(PageIO):
    """A pool with only SGLang's flat page accessors: one ``get_data_page`` /
    ``set_from_flat_data_page`` per page (the slowest path: a staging copy per page)."""

    path = "flat"

    def __init__(self, pool: Any):
        self.pool = pool
        self.page_size, self.capacity_tokens = int(pool.page_size), _capacity(pool)
        dummy = pool.get_dummy_flat_data_page()
        self.dtype = dummy.dtype
        self.page_bytes = dummy.numel() * dummy.element_size()

    def to_arena(self, token_starts, arena, offsets) -> None:
        starts, offs = self._check(token_starts, offsets)
        check_arena(arena)
        check_slots(offs, self.page_bytes, arena.numel())
        check_disjoint(offs, self.page_bytes)
        for t, o in zip(starts.tolist(), offs.tolist(), strict=True):
            page = self.pool.get_data_page(t, flat=True)
            data = page.contiguous().reshape(-1).view(torch.uint8)
            if data.numel() != self.page_bytes:
                raise ValueError(f"page at token {t} has {data.numel()} bytes, "
                                 f"expected {self.page_bytes}")
            arena[o : o + self.page_bytes].copy_(data)

    def from_arena(self, token_starts, arena, offsets) -> None:
        starts, offs = self._check(token_starts, offsets)
        check_arena(arena)
        check_slots(offs, self.page_bytes, arena.numel())
        itemsize = self.dtype.itemsize
        for t, o in zip(starts.tolist(), offs.tolist(), strict=True):
            data = arena[o : o + self.page_bytes]
            if (arena.storage_offset() + o) % itemsize:  # a dtype view needs an aligned start
                data = data.clone()
            self.pool.set_from_flat_data_page(t, data.view(self.dtype))


def make_page_io(host_pool: Any, *, path: str | None = None) -> PageIO:
    """The ``PageIO`` for ``host_pool``: the fastest path it offers, or ``path`` if given
    ("native" needs a HostPool, "pointer" ``get_page_buffer_meta``, "flat" the flat accessors).

    Raises TypeError naming the missing methods when the object offers no path.
    """
    if isinstance(host_pool, PageIO) and path is None:
        return host_pool  # already a page path (e.g. kernels.cuda.DevicePageIO)
    if path is not None:
        if path not in PATHS:
            raise ValueError(f"unknown page path {path!r}; valid: {list(PATHS)}")
        if path == "native":
            if not isinstance(host_pool, HostPool):
                raise TypeError(f"the native path needs a HostPool, got {type(host_pool).__name__}")
            return NativePageIO(host_pool)
        return PointerPageIO(host_pool) if path == "pointer" else FlatPageIO(host_pool)
    if isinstance(host_pool, HostPool):
        return NativePageIO(host_pool)
    name = type(host_pool).__name__
    has_flat = all(callable(getattr(host_pool, m, None)) for m in _FLAT_METHODS)
    if not hasattr(host_pool, "page_size"):
        raise TypeError(f"{name} is not a host pool: it has no page_size")
    if callable(getattr(host_pool, "get_page_buffer_meta", None)):
        try:
            return PointerPageIO(host_pool)
        except (ValueError, AssertionError, NotImplementedError) as e:
            if not has_flat:
                raise
            log.info("%s: pointer path unavailable (%s); using the flat page path", name, e)
    if has_flat:
        return FlatPageIO(host_pool)
    missing = [m for m in _FLAT_METHODS if not callable(getattr(host_pool, m, None))]
    raise TypeError(f"{name} offers no page path: it lacks get_page_buffer_meta and "
                    f"{', '.join(missing)}")
