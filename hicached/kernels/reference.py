"""Plain-torch, one-page-at-a-time reference for the arena page format.

This module is the specification the fast paths (``kernels/cpu.py``, ``kernels/pointers.py``) are
tested against. It indexes the pool's raw tensors exactly the way SGLang's host pools slice a page
(``get_data_page``), one part at a time, and moves bytes with ``torch.cat`` / ``copy_``; it is slow
and obviously right.

Arena page format (``page_bytes`` = sum of the parts' bytes, parts back to back in this order;
P = page_size, t = token start of the page, buffers of one dtype except Mamba's components):

    kind     layout              buffers                                parts of the page at t
    mha      layer_first         kv [2, layers, tokens, heads, dim]     kv[0, :, t:t+P], kv[1, ...]
    mha      page_first          kv [2, tokens, layers, heads, dim]     kv[0, t:t+P], kv[1, t:t+P]
    mha      page_first_direct   kv [2, pages, layers, P, heads, dim]   kv[0, t//P], kv[1, t//P]
    mla      layer_first         kv [layers, tokens, 1, kv_dim]         kv[:, t:t+P]
    mla      page_first          kv [tokens, layers, 1, kv_dim]         kv[t:t+P]
    mla      page_first_direct   kv [pages, layers, P, 1, kv_dim]       kv[t//P]
    mamba    page_first(_direct) comp_i [slots, mamba_layers, *state]   comp_0[t], comp_1[t], ...
    indexer  layer_first         buf [layers, pages, page_elems]        buf[:, t//P]
    indexer  page_first(_direct) buf [pages, layers, 1, page_elems]     buf[t//P]

(Mamba has P = 1 and one slot per page; each part's bytes are the C-order bytes of
the sliced view, so e.g. an MHA layer_first K part is [layers, P, heads, dim].)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KINDS = ("mha", "mla", "mamba", "indexer")
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def page_parts(
    kind: str, layout: str, page_size: int, buffers: Sequence[torch.Tensor], token_start: int
) -> list[torch.Tensor]:
    """Views of the parts of the page starting at ``token_start``, in arena order.

    Each view keeps the pool's dtype and its native in-page order (see the module table); views
    of layer_first pages are strided. ``buffers`` are the pool's tensors as listed in the table.
    """
    t, p = token_start, page_size
    if kind == "mha":
        (kv,) = buffers
        if layout == "layer_first":
            return [kv[0, :, t : t + p], kv[1, :, t : t + p]]
        if layout == "page_first":
            return [kv[0, t : t + p], kv[1, t : t + p]]
        if layout == "page_first_direct":
            return [kv[0, t // p], kv[1, t // p]]
    elif kind == "mla":
        (kv,) = buffers
        if layout == "layer_first":
            return [kv[:, t : t + p]]
        if layout == "page_first":
            return [kv[t : t + p]]
        if layout == "page_first_direct":
            return [kv[t // p]]
    elif kind == "mamba":
        if layout in ("page_first", "page_first_direct"):
            return [component[t] for component in buffers]
    elif kind == "indexer":
        (buf,) = buffers
        if layout == "layer_first":
            return [buf[:, t // p]]
        if layout in ("page_first", "page_first_direct"):
            return [buf[t // p]]
    else:
        raise ValueError(f"unknown pool kind {kind!r}; valid: {list(KINDS)}")
    raise ValueError(f"pool kind {kind!r} has no layout {layout!r}")


def _as_bytes(part: torch.Tensor) -> torch.Tensor:
    """C-order bytes of ``part`` as a 1-D uint8 tensor (a copy when ``part`` is strided)."""
    flat = part.contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return flat.view(torch.uint8)


def read_page(
    kind: str, layout: str, page_size: int, buffers: Sequence[torch.Tensor], token_start: int
) -> torch.Tensor:
    """The page's arena bytes: 1-D ``torch.uint8`` of ``page_bytes`` (a new tensor)."""
    parts = page_parts(kind, layout, page_size, buffers, token_start)
    return torch.cat([_as_bytes(part) for part in parts])


def write_page(
    kind: str,
    layout: str,
    page_size: int,
    buffers: Sequence[torch.Tensor],
    token_start: int,
    data: torch.Tensor,
) -> None:
    """Scatter ``data`` (1-D ``torch.uint8`` of ``page_bytes``) into the page's parts."""
    start = 0
    for part in page_parts(kind, layout, page_size, buffers, token_start):
        nbytes = part.numel() * part.element_size()
        chunk = data[start : start + nbytes]
        start += nbytes
        if nbytes:
            # clone: a dtype view of arena bytes needs an aligned start; the reference need not care
            part.copy_(chunk.clone().view(part.dtype).reshape(part.shape))
    if start != data.numel():
        raise ValueError(f"page data has {data.numel()} bytes, the page has {start}")


def to_arena(
    kind: str,
    layout: str,
    page_size: int,
    buffers: Sequence[torch.Tensor],
    token_starts: Sequence[int],
    arena: torch.Tensor,
    offsets: Sequence[int],
) -> None:
    """Copy page ``token_starts[i]`` to ``arena[offsets[i] : offsets[i] + page_bytes]``."""
    for token_start, offset in zip(token_starts, offsets, strict=True):
        data = read_page(kind, layout, page_size, buffers, int(token_start))
        arena[int(offset) : int(offset) + data.numel()].copy_(data)


def from_arena(
    kind: str,
    layout: str,
    page_size: int,
    buffers: Sequence[torch.Tensor],
    token_starts: Sequence[int],
    arena: torch.Tensor,
    offsets: Sequence[int],
) -> None:
    """Copy ``arena[offsets[i] : offsets[i] + page_bytes]`` into page ``token_starts[i]``."""
    page_bytes = sum(
        part.numel() * part.element_size()
        for part in page_parts(kind, layout, page_size, buffers, 0)
    )
    for token_start, offset in zip(token_starts, offsets, strict=True):
        data = arena[int(offset) : int(offset) + page_bytes]
        write_page(kind, layout, page_size, buffers, int(token_start), data)
