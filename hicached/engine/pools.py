"""Device pools (the engine's L1) and the allocator whose accounting the leak checks rely on.

    pool      tensors (on the engine's device)                         ids       allocator
    KVPool    MHA  kv [2, pages, layers, P, kv_heads, dim]              page id   pages
              MLA  kv [pages, layers, P, 1, k_dim + v_dim]
    (indexer) idx [pages, layers, 1, P * index_dim]   same page ids as KV (a sidecar, as SGLang)
    StatePool temporal [slots, layers, 1, h, k, v], conv [slots, layers, 1, conv_dim, K]  slots

Every buffer has exactly the geometry of hicached's ``HostPool`` (layout ``page_first_direct``
for paged pools, ``page_first`` for states), so the copy to and from the daemon's arena is the
``HostPool`` kernel. On a CPU device the host pool *is* the device buffer (no staging copy); on a
GPU the host pool is a pinned CPU mirror with the same ids, synced page by page
(``to_host`` / ``to_device``).

Accounting (``hybrid-radix-cache.md`` §6): for each allocator, at idle,

    available + evictable + protected == total          (exact, no tolerance)

where evictable / protected are the radix cache's counters (pages, or state slots). Ids a running
request holds are the fourth term ("in use"), zero when idle. ``debug=True`` makes a double free
(or freeing an id that was never handed out) raise ``DoubleFree`` at once, and lets
``leaked_ids`` name the ids nobody accounts for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import torch

from hicached.client.hostpool import HostPool
from hicached.errors import HicachedError


class PoolError(HicachedError):
    """Base class of the engine's pool errors."""

    code = "engine_pool"


class OutOfMemory(PoolError):
    """An allocation could not be satisfied, even after evicting everything evictable."""


class DoubleFree(PoolError):
    """An id was freed twice, or freed without having been allocated (debug mode)."""


class LeakDetected(PoolError):
    """The idle accounting identity does not hold: something leaked or was counted twice."""


class IdAllocator:
    """A free list over ids ``[0, total)``: pages of a paged pool, or state slots.

    ``alloc`` hands out the oldest free ids first (FIFO, so freed ids are reused late and a
    use-after-free shows up as wrong data rather than hiding). Without ``debug`` a double free
    silently grows the free list (``available`` then over-reports, which the identity catches).
    """

    def __init__(self, total: int, name: str, *, debug: bool = False):
        if total < 1:
            raise ValueError(f"{name}: a pool needs at least 1 id, got {total}")
        self.total, self.name, self.debug = int(total), name, debug
        self._free: deque[int] = deque(range(self.total))
        self._held: set[int] | None = set() if debug else None

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` ids, or None (nothing taken) when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} ids")
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        if self._held is not None:
            dup = self._held.intersection(ids)
            if dup or len(set(ids)) != n:
                raise DoubleFree(f"{self.name}: ids {sorted(dup or ids)} handed out twice "
                                 f"(a double free happened earlier)")
            self._held.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Give ``ids`` back. Debug mode: raises DoubleFree naming the first bad id."""
        ids = [int(i) for i in ids]
        if self._held is not None:
            seen: set[int] = set()
            for i in ids:
                if i in seen or i not in self._held:
                    raise DoubleFree(f"{self.name}: id {i} freed twice or never allocated "
                                     f"({len(self._held)} held, {len(self._free)} free)")
                seen.add(i)
            self._held.difference_update(ids)
        self._free.extend(ids)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def leaked_ids(self, accounted: Iterable[int]) -> tuple[list[int], list[int]]:
        """(ids neither free nor in ``accounted``, ids counted twice) — for leak reports."""
        counts: dict[int, int] = {}
        for i in (*self._free, *accounted):
            counts[i] = counts.get(i, 0) + 1
        missing = [i for i in range(self.total) if i not in counts]
        twice = sorted(i for i, c in counts.items() if c > 1)
        return missing, twice


def check_identity(alloc: IdAllocator, evictable: int, protected: int, in_use: int = 0,
                   accounted: Sequence[int] | None = None) -> None:
    """Raise LeakDetected unless available + evictable + protected + in_use == total."""
    got = alloc.available + evictable + protected + in_use
    if got == alloc.total:
        return
    detail = ""
    if accounted is not None:
        missing, twice = alloc.leaked_ids(accounted)
        detail = f"; leaked ids {missing[:20]}, counted twice {twice[:20]}"
    kind = "deficit (leak)" if got < alloc.total else "excess (double count or double free)"
    raise LeakDetected(
        f"{alloc.name}: available {alloc.available} + evictable {evictable} + protected "
        f"{protected} + in use {in_use} = {got} != total {alloc.total}: {kind} of "
        f"{abs(alloc.total - got)}{detail}")


class DevicePool:
    """Buffers on the device with hicached's host geometry, and their host pool.

    ``page_axis[i]`` is the axis of ``buffers[i]`` that indexes pages (or slots).
    """

    def __init__(self, kind: str, layout: str, page_size: int, buffers: Sequence[torch.Tensor],
                 page_axis: Sequence[int]):
        self.buffers = list(buffers)
        self.page_axis = list(page_axis)
        self.device = self.buffers[0].device
        self.mirrored = self.device.type != "cpu"
        if self.mirrored:
            host = [torch.empty(b.shape, dtype=b.dtype, pin_memory=torch.cuda.is_available())
                    for b in self.buffers]
        else:
            host = self.buffers
        self.host = HostPool(kind, layout, page_size, host)

    def to_host(self, ids: Sequence[int]) -> None:
        """Make the host pool hold the device's bytes of pages/slots ``ids`` (GPU: a copy)."""
        if not self.mirrored or not ids:
            return
        idx = torch.as_tensor(list(ids), dtype=torch.long)
        dev_idx = idx.to(self.device)
        for b, h, ax in zip(self.buffers, self.host.buffers, self.page_axis):
            h.index_copy_(ax, idx, b.index_select(ax, dev_idx).cpu())

    def to_device(self, ids: Sequence[int]) -> None:
        """Copy pages/slots ``ids`` of the host pool onto the device (GPU; no-op on CPU)."""
        if not self.mirrored or not ids:
            return
        idx = torch.as_tensor(list(ids), dtype=torch.long)
        dev_idx = idx.to(self.device)
        for b, h, ax in zip(self.buffers, self.host.buffers, self.page_axis):
            b.index_copy_(ax, dev_idx, h.index_select(ax, idx).to(self.device, non_blocking=True))


class KVPool(DevicePool):
    """Paged attention KV for the model's attention layers (see the module table), with the
    page allocator (shared by the indexer pool, whose pages have the same ids)."""

    def __init__(self, kind: str, num_pages: int, page_size: int, layers: int, heads: int,
                 k_dim: int, v_dim: int, dtype: torch.dtype, device: torch.device,
                 *, debug: bool = False):
        self.kind, self.page_size, self.layers = kind, page_size, layers
        self.allocator = IdAllocator(num_pages, "kv pages", debug=debug)
        self.k_dim, self.v_dim = k_dim, v_dim
        if kind == "mha":
            kv = torch.zeros((2, num_pages, layers, page_size, heads, k_dim), dtype=dtype,
                             device=device)
            super().__init__("mha", "page_first_direct", page_size, [kv], [1])
        else:
            kv = torch.zeros((num_pages, layers, page_size, 1, k_dim + v_dim), dtype=dtype,
                             device=device)
            super().__init__("mla", "page_first_direct", page_size, [kv], [0])
        self.kv = kv

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store n tokens: token j goes to page ``pages[j]`` at ``offsets[j]``.
        ``k``: [n, heads, k_dim], ``v``: [n, heads, v_dim] (MLA: heads == 1)."""
        if self.kind == "mha":
            self.kv[0, pages, layer, offsets] = k
            self.kv[1, pages, layer, offsets] = v
        else:
            self.kv[pages, layer, offsets] = torch.cat((k, v), dim=-1)

    def read(self, layer: int, pages: Sequence[int], num_tokens: int, capacity: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[0, num_tokens)`` of the page list as HF tensors [1, heads, T, dim]; with
        ``capacity``, views [1, heads, C, dim] of buffers laid out token-major [C, heads, dim]
        (C >= capacity and the pages' tokens) whose first T tokens hold them: an MHA layer's
        pages are gathered straight into them, with no transposing copy."""
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=self.device)
        if self.kind == "mha":
            srcs = [self.kv[i, :, layer] for i in (0, 1)]  # [pages, P, heads, dim] views
            if capacity:  # each page's rows straight into the buffers
                n, (_, ps, heads, dim) = len(idx), srcs[0].shape
                out = [token_major(srcs[0], heads, dim, max(capacity, n * ps)) for _ in srcs]
                for src, buf in zip(srcs, out):
                    torch.index_select(src, 0, idx,
                                       out=buf[0].transpose(0, 1)[: n * ps].view(n, ps, heads, dim))
                return out[0], out[1]
            k, v = (x.index_select(0, idx).flatten(0, 1)[:num_tokens] for x in srcs)
        else:
            lat = self.kv[:, layer].index_select(0, idx).flatten(0, 1)[:num_tokens]
            k, v = lat[..., : self.k_dim], lat[..., self.k_dim :]  # [T, 1, k_dim + v_dim]
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if not capacity:
            return k.contiguous(), v.contiguous()
        out = [token_major(x, x.shape[1], x.shape[3], max(capacity, num_tokens)) for x in (k, v)]
        for x, buf in zip((k, v), out):
            buf[:, :, :num_tokens].copy_(x)
        return out[0], out[1]


def token_major(like: torch.Tensor, heads: int, dim: int, tokens: int) -> torch.Tensor:
    """An empty [1, heads, tokens, dim] view (``like``'s dtype and device) of a buffer laid out
    token-major, [tokens, heads, dim]: a request's reserved attention KV (``cache_io``)."""
    return like.new_empty((1, max(tokens, 1), heads, dim)).transpose(1, 2)


class IndexerPool(DevicePool):
    """DSA indexer keys per KV page (same page ids as the KV pool)."""

    def __init__(self, num_pages: int, page_size: int, layers: int, dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.page_size, self.dim = page_size, dim
        buf = torch.zeros((num_pages, layers, 1, page_size * dim), dtype=dtype, device=device)
        super().__init__("indexer", "page_first_direct", page_size, [buf], [0])
        self.view = buf.view(num_pages, layers, page_size, dim)

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor,
              keys: torch.Tensor) -> None:
        """``keys``: [n, dim] for tokens at (pages[j], offsets[j])."""
        self.view[pages, layer, offsets] = keys

    def read(self, layer: int, pages: Sequence[int], num_tokens: int) -> torch.Tensor:
        """Indexer keys of tokens ``[0, num_tokens)`` as [1, T, dim]."""
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=self.device)
        return self.view[idx, layer].flatten(0, 1)[:num_tokens].unsqueeze(0).contiguous()


class StatePool(DevicePool):
    """Recurrent (Mamba / gated-delta-net) states, one slot per state, with its allocator.

    ``views(slot, layer)`` are the HF-shaped (conv, recurrent) tensors of one layer of a slot:
    a running request's cache points at its private slot, so the model updates it in place.
    """

    def __init__(self, num_slots: int, layers: int, conv_shape: Sequence[int],
                 recurrent_shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                 *, conv_dtype: torch.dtype | None = None, debug: bool = False):
        temporal = torch.zeros((num_slots, layers, *recurrent_shape), dtype=dtype, device=device)
        conv = torch.zeros((num_slots, layers, *conv_shape), dtype=conv_dtype or dtype,
                           device=device)
        super().__init__("mamba", "page_first", 1, [temporal, conv], [0, 0])
        self.temporal, self.conv = temporal, conv
        self.allocator = IdAllocator(num_slots, "state slots", debug=debug)

    def views(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[slot, layer], self.temporal[slot, layer]

    def copy(self, src: int, dst: int) -> None:
        """Copy every layer's state of slot ``src`` into ``dst`` (copy-on-write of a match)."""
        self.temporal[dst].copy_(self.temporal[src])
        self.conv[dst].copy_(self.conv[src])

    def zero(self, slot: int) -> None:
        self.temporal[slot].zero_()
        self.conv[slot].zero_()
