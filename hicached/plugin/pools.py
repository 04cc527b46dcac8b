"""Which SGLang host pools the plugin serves, which of them TP ranks share, and zero-byte anchors.

The daemon is pool-agnostic (a pool is a name and a page size; the hit policy comes with each
query), so the plugin serves every pool SGLang registers, under its own name. What it must get
right per pool is whether its pages are the same on every TP rank. That only matters in a
rank-replicated namespace (SGLang's ``is_mla_model``: MLA and DeepSeek V4 KV): a pool whose pages
differ per rank then gets the rank in its wire name (``namespace.RankNamespace.wire_pool``).
Sharing a page that differs per rank would be wrong reuse, so a pool is shared only when its
host-pool class is known to hold rank-replicated data; any other class stays per rank.

SGLang 0.5.23's pools (``PoolName``), what holds them and what their pages are across TP ranks
(in a per-rank namespace, i.e. any MHA model, every pool is per rank anyway):

    pool                      policy in exists   host pool class                 TP ranks
    kv                        (the anchor)       MHA* / MLA / LogicalHostPool    the namespace
    mamba                     trailing_pages     MambaPoolHost                   per rank
    swa                       trailing_pages     MHA* | MLA | DeepSeekV4Paged    by class
    auxiliary_swa             (no producer in 0.5.23: never registered)         by class
    indexer, draft_indexer    all_pages          DSAIndexerPoolHost              shared
                                                 QSAIndexerPoolHost, MHA K-only  per rank
    draft                     all_pages          MLA | MHA*                      by class
    draft_swa                 all / trailing     MHA* | MLA | DeepSeekV4Paged    by class
    deepseek_v4_c{1,2,4,128}[_rope|_indexer|_indexer_scale]
                              all_pages          DeepSeekV4PagedHostPool         shared
    deepseek_v4_c4[_indexer]_state              trailing_pages  DeepSeekV4StateHostPool  shared
    deepseek_v4_c128_state    (listed as a sidecar, never registered: no host pool)

"MHA*": ``MHATokenToKVPoolHost`` and its subclasses (heads are split across TP ranks). MLA latent
KV, the DSA indexer keys (``ReplicatedLinear`` wk) and DeepSeek V4's compressed rows and
compressor states (``ReplicatedLinear`` weights) are computed identically on every rank, which is
why SGLang stores them from the writer rank only. SGLang stores Mamba on every rank (TP-sharded
heads), and nothing else: an MHA pool (say an EAGLE draft) of an MLA model is written by TP rank 0
alone, so under this plugin's per-rank rule its other ranks miss it.

DeepSeek V4's KV anchor (``LogicalHostPool``) holds no bytes: its pages only say "this prefix was
stored", which gates the exists of every other pool. The daemon has no zero-byte pages, so such a
pool is registered as ``MarkerPages``, one byte per page, as SGLang's own NIXL backend does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hicached.client.hostpool import HostPool
from hicached.kernels.cpu import check_arena, check_slots
from hicached.kernels.pageio import PageIO

# Host-pool classes (any class in the pool's MRO, nearest first) whose pages are the same on
# every TP rank of a rank-replicated model, and classes whose pages are not. A class in neither
# set (or a pool whose class cannot be told) is kept per rank.
REPLICATED_HOST_POOLS = frozenset({
    "MLATokenToKVPoolHost",
    "DSAIndexerPoolHost",
    "DeepSeekV4PagedHostPool",
    "DeepSeekV4StateHostPool",
    "LogicalHostPool",
})
RANK_SHARDED_HOST_POOLS = frozenset({
    "MHATokenToKVPoolHost",
    "MHATokenToKOnlyPoolHost",
    "MambaPoolHost",
    "QSAIndexerPoolHost",  # a DeepSeekV4PagedHostPool subclass of MHA models: not known shared
})
_HOSTPOOL_REPLICATED_KINDS = ("mla", "indexer")  # hicached's own HostPool stand-ins
ALWAYS_PER_RANK = frozenset({"mamba"})  # SGLang stores these on every TP rank


def rank_sharing(name: str, host_pool: Any) -> tuple[bool, str]:
    """(whether ``host_pool``'s pages differ per TP rank, the class that decided) for the pool
    registered as ``name``; ``name`` "kv" is never sharded here (the namespace decides)."""
    if name == "kv":
        return False, "anchor"
    if name in ALWAYS_PER_RANK:
        return True, name
    if isinstance(host_pool, HostPool):
        return host_pool.kind not in _HOSTPOOL_REPLICATED_KINDS, f"HostPool({host_pool.kind})"
    for cls in type(host_pool).__mro__:
        if cls.__name__ in RANK_SHARDED_HOST_POOLS:
            return True, cls.__name__
        if cls.__name__ in REPLICATED_HOST_POOLS:
            return False, cls.__name__
    return True, f"unknown {type(host_pool).__name__}"


def holds_no_bytes(host_pool: Any) -> bool:
    """Whether ``host_pool``'s pages are empty (SGLang's ``LogicalHostPool``)."""
    if isinstance(host_pool, (HostPool, PageIO)):
        return False
    dummy = getattr(host_pool, "get_dummy_flat_data_page", None)
    if not callable(dummy):
        return False
    try:
        return dummy().numel() == 0
    except Exception:  # noqa: BLE001 - a pool that cannot say: make_page_io will tell
        return False


class MarkerPages(PageIO):
    """A pool whose pages hold no bytes, stored as one marker byte per page (its presence is
    all there is to restore: a get reads nothing back). Indices are checked as for any pool."""

    path = "marker"
    page_bytes = 1
    MARK = 1

    def __init__(self, host_pool: Any):
        self.host_pool = host_pool
        self.page_size = int(host_pool.page_size)
        size = getattr(host_pool, "size", None)
        self.capacity_tokens = int(size) if isinstance(size, (int, np.integer)) else None

    def to_arena(self, token_starts: Sequence[int], arena: torch.Tensor,
                 offsets: Sequence[int]) -> None:
        _, offs = self._check(token_starts, offsets)
        check_arena(arena)
        check_slots(offs, self.page_bytes, arena.numel())
        if offs.size:
            arena[torch.from_numpy(offs)] = self.MARK

    def from_arena(self, token_starts: Sequence[int], arena: torch.Tensor,
                   offsets: Sequence[int]) -> None:
        _, offs = self._check(token_starts, offsets)
        check_arena(arena)
        check_slots(offs, self.page_bytes, arena.numel())


def page_source(host_pool: Any) -> Any:
    """What to register with the client for ``host_pool``: the pool itself, or its
    ``MarkerPages`` when its pages hold no bytes."""
    return MarkerPages(host_pool) if holds_no_bytes(host_pool) else host_pool
