"""Flat page tensors as a page IO: SGLang's generic (v0) storage path.

SGLang's v0 path hands a storage backend one flat CPU tensor per page (``get_data_page`` to
store, ``get_dummy_flat_data_page`` to fill) instead of host indices; ``Client.batch_set_pages`` /
``batch_get_pages`` wrap them in a ``TensorPages`` so they take the same reserve / lease path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicached.kernels.cpu import check_arena, check_disjoint, check_slots
from hicached.kernels.pageio import PageIO


class TensorPages(PageIO):
    """Flat page tensors standing in for a host pool: item i is ``pages[i]``.

    SGLang's generic (v0) path hands the backend one flat CPU tensor per page
    (``get_data_page`` to store, ``get_dummy_flat_data_page`` to fill) instead of host indices.
    Each tensor must hold exactly ``page_bytes`` bytes; tensors filled by ``from_arena`` must be
    contiguous (their bytes are written in place).
    """

    path = "tensors"

    def __init__(self, pages: Sequence[torch.Tensor], page_bytes: int):
        self.page_size, self.page_bytes, self.capacity_tokens = 1, page_bytes, len(pages)
        self._bytes: list[torch.Tensor] = []
        for i, page in enumerate(pages):
            if not isinstance(page, torch.Tensor) or page.device.type != "cpu":
                raise ValueError(f"page {i} must be a CPU tensor, got {type(page).__name__}")
            if not page.is_contiguous():
                raise ValueError(f"page {i} is not contiguous (strides {page.stride()})")
            data = page.reshape(-1).view(torch.uint8)
            if data.numel() != page_bytes:
                raise ValueError(f"page {i} has {data.numel()} bytes, pages of this pool have "
                                 f"{page_bytes}")
            self._bytes.append(data)

    def to_arena(self, token_starts, arena, offsets) -> None:
        starts, offs = self._check(token_starts, offsets)
        check_arena(arena)
        check_slots(offs, self.page_bytes, arena.numel())
        check_disjoint(offs, self.page_bytes)
        for i, o in zip(starts.tolist(), offs.tolist(), strict=True):
            arena[o : o + self.page_bytes].copy_(self._bytes[i])

    def from_arena(self, token_starts, arena, offsets) -> None:
        starts, offs = self._check(token_starts, offsets)
        check_arena(arena)
        check_slots(offs, self.page_bytes, arena.numel())
        for i, o in zip(starts.tolist(), offs.tolist(), strict=True):
            self._bytes[i].copy_(arena[o : o + self.page_bytes])
