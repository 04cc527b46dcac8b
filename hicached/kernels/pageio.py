"""``PageIO``: the interface of one page path, a pool's pages copied to and from arena slots.

Both sides of it import this module: the client's host-pool paths (``client/hostpool.py``:
native, pointer, flat; ``client/flatpages.py``; ``plugin/pools.py``) and the device path
(``kernels/cuda.py``) implement it, and the client's calls (``client/get.py``, ``sets.py``) use
it. It lives here, under the kernels, so that ``kernels/`` never imports ``client/``
(``tests/test_layout.py`` holds that).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hicached.kernels.cpu import as_index_array


class PageIO(abc.ABC):
    """One registered host pool as the client copies it.

    ``page_size``: tokens per page, the granularity of ``token_starts`` (1 for Mamba).
    ``page_bytes``: bytes of one page in the arena (its parts back to back, in part order).
    ``capacity_tokens``: tokens the pool holds (None when the pool does not say).
    Calls on disjoint pages may run concurrently (no shared scratch state).
    """

    page_size: int
    page_bytes: int
    capacity_tokens: int | None = None
    path: str = ""  # "native" | "pointer" | "flat", for logs and metrics

    @abc.abstractmethod
    def to_arena(self, token_starts: Sequence[int], arena: torch.Tensor,
                 offsets: Sequence[int]) -> None:
        """Copy the page starting at token ``token_starts[i]`` into
        ``arena[offsets[i] : offsets[i] + page_bytes]`` (``arena``: 1-D uint8 CPU tensor).

        Raises ValueError (numbers in the message) on length mismatch, a token start that is not
        a page start of the pool, a slot outside the arena, or two overlapping slots.
        """

    @abc.abstractmethod
    def from_arena(self, token_starts: Sequence[int], arena: torch.Tensor,
                   offsets: Sequence[int]) -> None:
        """Copy ``arena[offsets[i] : offsets[i] + page_bytes]`` into the page at token
        ``token_starts[i]``. Same checks as ``to_arena`` (slots may repeat: reads only); two items
        naming the same host page leave either one's bytes there."""

    def _check(self, token_starts: Any, offsets: Any) -> tuple[np.ndarray, np.ndarray]:
        """Validated (token_starts, offsets) as int64 arrays; raises ValueError with the numbers."""
        starts = as_index_array(token_starts, "token_starts")
        offs = as_index_array(offsets, "offsets")
        if starts.size != offs.size:
            raise ValueError(f"{starts.size} token starts but {offs.size} arena offsets")
        bad = np.flatnonzero(starts % self.page_size != 0)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"token start {int(starts[i])} (item {i}) is not a multiple of "
                             f"page_size {self.page_size}")
        limit = self.capacity_tokens
        outside = starts < 0
        if limit is not None:
            outside |= starts > limit - self.page_size
        bad = np.flatnonzero(outside)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"token start {int(starts[i])} (item {i}) is outside the pool of "
                             f"{limit} tokens (page_size {self.page_size})")
        return starts, offs
