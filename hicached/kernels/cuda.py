"""Device page copies: engine tensors on a GPU <-> arena slots, DMA straight into the shared arena.

The client registers the mapped arena with CUDA (``cudaHostRegister`` through
``torch.cuda.cudart()``), so a copy between a GPU tensor and arena bytes is one DMA transfer: no
pageable-memory staging in the driver and no host bounce buffer. A batch's pages are gathered (or
scattered) on the device, in the arena page format of ``kernels/reference.py``:

    to_arena    parts (device) --index_select--> image [run, page_bytes] (device)
                image --copy_(non_blocking)--> arena[offset : offset + run * page_bytes]
    from_arena  arena run --copy_(non_blocking)--> image (device) --index_copy_--> parts (device)

A *run* is a set of slots whose byte ranges touch (slots of one slab whose page size is a multiple
of the 64-byte slot alignment); each run is one transfer, any other slot its own page-sized
transfer. Bytes between slots are never written: they may be another page's.

The device buffers have the host-pool geometries of ``kernels/reference.py`` (MHA layer_first /
page_first / page_first_direct, MLA, Mamba, DSA indexer), on any one device. The code is
device-agnostic: on CPU tensors it runs the same gathers without registration or streams, which
is how the CPU-only tests cover it. Every call waits for its transfers before it returns (the
client commits or releases the slots right after), and only this module imports CUDA state:
``hicached.kernels`` does not import it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hicached.errors import ArenaError
from hicached.kernels import reference
from hicached.kernels.cpu import (
    as_index_array,
    check_arena,
    check_disjoint,
    check_slots,
    page_major_parts,
)
from hicached.kernels.pageio import PageIO


class HostRegistration:
    """``cudaHostRegister`` of one CPU tensor's memory, undone by ``close()``.

    Holds a reference to the tensor, so the mapping it views stays alive while registered (a
    mapping unmapped while still registered would stay pinned until the process ends).
    """

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("only a contiguous CPU tensor can be registered with CUDA")
        self.tensor = tensor
        self.ptr = tensor.data_ptr()
        self.nbytes = tensor.numel() * tensor.element_size()
        rc = int(torch.cuda.cudart().cudaHostRegister(self.ptr, self.nbytes, 0))
        if rc != 0:
            raise ArenaError(f"cudaHostRegister of {self.nbytes} bytes at {self.ptr:#x} failed "
                             f"(cudaError {rc})")
        self.closed = False

    def covers(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes lie inside the registered range."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return not self.closed and self.ptr <= start and end <= self.ptr + self.nbytes

    def close(self) -> None:
        """Unregister (idempotent)."""
        if not self.closed:
            self.closed = True
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self.tensor = None


def contiguous_runs(offsets: np.ndarray, page_bytes: int) -> list[np.ndarray]:
    """Item indices grouped into runs of touching slots, each run in arena order."""
    if offsets.size == 0:
        return []
    order = np.argsort(offsets, kind="stable")
    cuts = np.flatnonzero(np.diff(offsets[order]) != page_bytes) + 1
    return np.split(order, cuts)


class DeviceCopier:
    """Copies pages between device tensors in a host-pool geometry and arena slots.

    ``kind`` / ``layout`` / ``page_size`` / ``buffers`` as in ``kernels/reference.py``;
    ``buffers`` contiguous, all on one device. Pages are named by page number (token start //
    page_size). Safe to call from several threads on disjoint pages (no shared scratch).
    """

    def __init__(self, kind: str, layout: str, page_size: int, buffers: Sequence[torch.Tensor]):
        if not buffers:
            raise ValueError("a pool needs at least one buffer, got 0")
        self.device = buffers[0].device
        for i, buf in enumerate(buffers):
            if buf.device != self.device or not buf.is_contiguous():
                raise ValueError(f"buffer {i} must be contiguous and on {self.device}, got "
                                 f"{buf.device} strides {buf.stride()}")
        # uint8 views, no copies
        self._set_parts(page_major_parts(kind, layout, page_size, buffers))

    @classmethod
    def from_parts(cls, parts: Sequence[torch.Tensor]) -> DeviceCopier:
        """A copier of page-major ``torch.uint8`` views given as they are (``[pages, ...]``,
        one device, any strides: e.g. vLLM's layer tensors with their block dimension moved
        first, ``plugin/vllm_blocks.py``)."""
        if not parts:
            raise ValueError("a pool needs at least one part, got 0")
        self = cls.__new__(cls)
        self.device = parts[0].device
        for i, part in enumerate(parts):
            if part.device != self.device or part.dtype != torch.uint8 \
                    or part.shape[0] != parts[0].shape[0]:
                raise ValueError(f"part {i} must be uint8 with {parts[0].shape[0]} pages on "
                                 f"{self.device}, got {part.dtype} {tuple(part.shape)} on "
                                 f"{part.device}")
        self._set_parts(list(parts))
        return self

    def _set_parts(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts
        self.num_pages = int(self.parts[0].shape[0])
        self._layout: list[tuple[torch.Tensor, int, int]] = []  # (part, offset, bytes)
        offset = 0
        for part in self.parts:
            nbytes = math.prod(part.shape[1:])
            self._layout.append((part, offset, nbytes))
            offset += nbytes
        self.page_bytes = offset
        self._cuda = self.device.type == "cuda"

    def _check(self, pages: Any, arena: torch.Tensor, offsets: Any, writing: bool
               ) -> tuple[np.ndarray, np.ndarray]:
        pages, offsets = as_index_array(pages, "pages"), as_index_array(offsets, "offsets")
        if pages.size != offsets.size:
            raise ValueError(f"{pages.size} pages but {offsets.size} arena offsets")
        check_arena(arena)
        check_slots(offsets, self.page_bytes, arena.numel())
        if writing:
            check_disjoint(offsets, self.page_bytes)
        bad = np.flatnonzero((pages < 0) | (pages >= self.num_pages))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"page {int(pages[i])} (item {i}) is outside 0..{self.num_pages - 1}")
        return pages, offsets

    def _index(self, pages: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(pages)).to(self.device, non_blocking=False)

    def _wait(self) -> None:
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def to_arena(self, pages: Any, arena: torch.Tensor, offsets: Any) -> None:
        """Copy device page ``pages[i]`` to ``arena[offsets[i] : offsets[i] + page_bytes]``;
        returns once the bytes are in the arena."""
        pages, offsets = self._check(pages, arena, offsets, writing=True)
        images = []  # keep every image alive until the transfers are done
        for run in contiguous_runs(offsets, self.page_bytes):
            index = self._index(pages[run])
            image = torch.empty((run.size, self.page_bytes), dtype=torch.uint8,
                                device=self.device)
            for part, start, nbytes in self._layout:
                image[:, start:start + nbytes].copy_(part.index_select(0, index).reshape(
                    run.size, nbytes))
            base = int(offsets[run[0]])
            arena[base:base + run.size * self.page_bytes].copy_(image.view(-1), non_blocking=True)
            images.append(image)
        self._wait()

    def from_arena(self, pages: Any, arena: torch.Tensor, offsets: Any) -> None:
        """Copy ``arena[offsets[i] : offsets[i] + page_bytes]`` into device page ``pages[i]``;
        returns once the device pages hold the bytes (two items naming one page: either)."""
        pages, offsets = self._check(pages, arena, offsets, writing=False)
        for run in contiguous_runs(offsets, self.page_bytes):
            base = int(offsets[run[0]])
            image = torch.empty((run.size, self.page_bytes), dtype=torch.uint8,
                                device=self.device)
            image.view(-1).copy_(arena[base:base + run.size * self.page_bytes], non_blocking=True)
            index = self._index(pages[run])
            for part, start, nbytes in self._layout:
                rows = image[:, start:start + nbytes].reshape(run.size, *part.shape[1:])
                part.index_copy_(0, index, rows)
        self._wait()


class DevicePageIO(PageIO):
    """A device-resident pool as the client copies it (``Client.register_mem_host_pool_v2``
    accepts it like a host pool). Registers the client's arena with CUDA on first use and again
    after the client maps a new arena (daemon restart); ``release_arena()`` unregisters."""

    path = "device"

    def __init__(self, kind: str, layout: str, page_size: int, buffers: Sequence[torch.Tensor]):
        if kind not in reference.KINDS:
            raise ValueError(f"unknown pool kind {kind!r}; valid: {reference.KINDS}")
        self._use(DeviceCopier(kind, layout, page_size, buffers), page_size)

    @classmethod
    def from_parts(cls, parts: Sequence[torch.Tensor], page_size: int) -> DevicePageIO:
        """A pool of the page-major views ``parts`` (``DeviceCopier.from_parts``) whose pages
        hold ``page_size`` tokens each."""
        self = cls.__new__(cls)
        self._use(DeviceCopier.from_parts(parts), page_size)
        return self

    def _use(self, copier: DeviceCopier, page_size: int) -> None:
        self.copier = copier
        self.page_size = int(page_size)
        self.page_bytes = self.copier.page_bytes
        self.capacity_tokens = self.copier.num_pages * self.page_size
        self._registration: HostRegistration | None = None
        self._lock = threading.Lock()  # client threads copy at once; one registration

    def _register(self, arena: torch.Tensor) -> None:
        if not self.copier._cuda:
            return
        reg = self._registration
        if reg is not None and reg.covers(arena):
            return
        with self._lock:
            reg = self._registration
            if reg is not None and reg.covers(arena):
                return
            if reg is not None:  # the client mapped a new arena: the old one goes
                reg.close()
            self._registration = HostRegistration(arena)

    def release_arena(self) -> None:
        """Unregister the arena (before the client unmaps it). Idempotent."""
        with self._lock:
            if self._registration is not None:
                self._registration.close()
                self._registration = None

    def to_arena(self, token_starts, arena, offsets) -> None:
        starts, offs = self._check(token_starts, offsets)
        self._register(arena)
        self.copier.to_arena(starts // self.page_size, arena, offs)

    def from_arena(self, token_starts, arena, offsets) -> None:
        starts, offs = self._check(token_starts, offsets)
        self._register(arena)
        self.copier.from_arena(starts // self.page_size, arena, offs)
