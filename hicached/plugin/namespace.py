"""The daemon namespace of one SGLang rank, and which pools it shares with other TP ranks.

SGLang hands a storage backend bare page hashes (SHA-256 chains over token ids). Scoping them is
the backend's job: two engines must share a page exactly when its bytes would be identical. The
namespace (fixed at the handshake; the daemon keys every table by it) therefore names everything
that shapes a page's bytes and nothing else:

    sglang|model=<served name>|rev=<revision>|kv=<dtype>[|kvfmt=<format>]|page=<tokens>
          |layout=<host layout>|bytes=<KV page bytes>|tp=<rank>of<size> (or tp=replicated)
          |pp=<rank>of<size>|cp=<rank>of<size>[|salt=<salt>]

  model    ``HiCacheStorageConfig.model_name`` (SGLang appends the host pool's storage-format tag),
           or extra_config ``model_name``
  rev      extra_config ``model_revision`` (SGLang does not know the weights revision)
  kv       dtype of the KV host pool; page: tokens per page; layout: the KV host pool's layout
  kvfmt    extra_config ``kv_cache_dtype``; for a uint8 KV pool without it, SGLang's own
           ``--kv-cache-dtype`` from its published server args (``engine_kv_cache_dtype``): an
           fp8 KV cache is stored as uint8 whatever its format (``store_dtype``), so the host
           pool cannot tell fp8_e4m3 from fp8_e5m2 pages; when neither is known it is warned
           about
           (layer_first / page_first / page_first_direct lay a page's bytes out differently);
           bytes: one KV page's size (MTP draft layers packed into the KV pool change it)
  tp       rank-sharded KV (MHA heads split across TP): one namespace per TP rank.
           Rank-replicated KV (``is_mla_model``: MLA, DeepSeek V4): ``replicated``, shared by every
           TP rank (and every TP size), as in SGLang's file backend; under decode context
           parallelism (dcp_size > 1) the DCP shard, TP size and logical page size are added
  pp, cp   pipeline stage and attention context-parallel rank: disjoint layers / token slices
  salt     extra_config ``namespace_salt``: a deployment-wide tenant boundary
           (per-request ``cache_salt`` / ``extra_key`` need nothing here: since SGLang's
           namespace-seed change (PR #38577) the first page hash of such a chain is seeded with
           ``storage_namespace_seed(extra_key, cache_salt)``, so their keys already differ)

DP-attention ranks are left out on purpose: the same prefix has the same KV on every DP replica.

Rank-sharded pools inside a replicated namespace: with MLA the KV (and the DSA indexer, DeepSeek V4's
pools) are identical on every TP rank, but Mamba states are split across TP ranks, and so are
the pages of an MHA pool (an EAGLE draft model's KV). Those pools get the rank in their wire name
(``mamba@tp0of2``), so one namespace and one daemon session hold both and a multi-pool commit
stays atomic; which pools they are is ``pools.rank_sharing``'s call (by host-pool class, per rank
when in doubt). ``is_writer`` (SGLang's ``is_storage_writer``: TP rank 0, or the DCP rank's
writer) is the only rank that writes the replicated pools; every rank writes its own
rank-sharded pools (SGLang's ``HybridCacheController.should_backup`` asks every rank for Mamba).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class RankNamespace:
    """What one rank's plugin sends to the daemon. See the module docstring."""

    namespace: str
    rank_tag: str  # "@tp0of2" in replicated namespaces, "" otherwise
    replicated: bool
    is_writer: bool

    def wire_pool(self, pool: str, rank_sharded: bool) -> str:
        """Pool name as the daemon sees it: a ``rank_sharded`` pool (its pages differ per TP
        rank) carries the rank in a replicated namespace."""
        return pool + self.rank_tag if self.replicated and rank_sharded else pool

    def writes(self, rank_sharded: bool) -> bool:
        """Whether this rank stores a pool (non-writers skip the replicated ones)."""
        return self.is_writer or (self.replicated and rank_sharded)


def clean_field(value: Any) -> str:
    """A namespace component: no separators, no surrounding space. Escaped, not replaced: two
    different salts or model names ("tenant=1", "tenant:1") must never give one namespace."""
    return str(value).strip().replace("%", "%25").replace("|", "%7C").replace("=", "%3D")


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``bfloat16``; anything else as its string."""
    return str(dtype).removeprefix("torch.") if dtype is not None else "unknown"


def _page_bytes(kv_pool: Any) -> int | str:
    """Bytes of one KV page (the same model with and without packed draft layers differs
    here only), from SGLang's host-pool surface; "unknown" where the pool cannot say."""
    try:
        page = kv_pool.get_dummy_flat_data_page()
        return int(page.numel() * page.element_size())
    except Exception:  # noqa: BLE001 - an odd pool: the other fields still separate models
        return "unknown"


def engine_kv_cache_dtype() -> str:
    """``--kv-cache-dtype`` of the SGLang process this runs in (its published server args), or
    "" outside SGLang, before it published them, or when it is "auto". Never imports SGLang."""
    context = sys.modules.get("sglang.srt.runtime_context")
    try:
        value = getattr(context.get_server_args(), "kv_cache_dtype", None) if context else None
    except Exception:  # noqa: BLE001 - an SGLang without it, or args not published yet
        return ""
    # "auto": SGLang resolves it later from the checkpoint; not a format (the warning stays)
    return value if isinstance(value, str) and value != "auto" else ""


def build_namespace(storage_config: Any, kv_pool: Any, *, model_name: str = "",
                    model_revision: str = "", namespace_salt: str = "",
                    kv_cache_dtype: str = "") -> RankNamespace:
    """The namespace of this rank from SGLang's ``HiCacheStorageConfig`` and its KV host pool.

    Fields newer SGLang added (dcp_*, logical_page_size, is_storage_writer, attn_cp_*) are read
    with defaults, so older configs work too.
    """
    cfg = storage_config
    model = model_name or getattr(cfg, "model_name", None) or ""
    if not model:
        log.warning("hicached: SGLang gave no model name and extra_config has no model_name; "
                    "pages are only separated from other unnamed models by their geometry")
        model = "unnamed"
    tp_rank, tp_size = int(getattr(cfg, "tp_rank", 0)), int(getattr(cfg, "tp_size", 1))
    pp_rank, pp_size = int(getattr(cfg, "pp_rank", 0)), int(getattr(cfg, "pp_size", 1))
    cp_rank = int(getattr(cfg, "attn_cp_rank", 0) or 0)
    cp_size = int(getattr(cfg, "attn_cp_size", 1) or 1)
    dcp_rank = int(getattr(cfg, "dcp_rank", 0) or 0)
    dcp_size = int(getattr(cfg, "dcp_size", 1) or 1)
    replicated = bool(getattr(cfg, "is_mla_model", False))
    writer = getattr(cfg, "is_storage_writer", None)
    if not isinstance(writer, bool):  # older SGLang: TP rank 0 writes MLA
        writer = not replicated or tp_rank == 0
    if getattr(cfg, "should_split_heads", False):
        log.warning("hicached: heterogeneous-TP head splitting (tp_lcm_size) is not supported; "
                    "pages stay per TP rank, so ranks of different TP sizes share nothing")

    kv_dtype = dtype_name(getattr(kv_pool, "dtype", None))
    if kv_dtype == "uint8" and not kv_cache_dtype:
        kv_cache_dtype = engine_kv_cache_dtype()
        if not kv_cache_dtype:
            log.warning("hicached: the KV host pool stores uint8 (an fp8 KV cache): its fp8 "
                        "format is not visible here; set extra_config kv_cache_dtype to the "
                        "engine's --kv-cache-dtype so that engines of another fp8 format never "
                        "take these pages")
    rank = f"tp{tp_rank}of{tp_size}"
    if replicated:
        tp_part = "replicated"
        if dcp_size > 1:
            page = getattr(cfg, "logical_page_size", None)
            tp_part += f",dcp{dcp_rank}of{dcp_size},tp{tp_size},lp{page}"
    else:
        tp_part = rank
    parts = [
        "sglang",
        f"model={clean_field(model)}",
        f"rev={clean_field(model_revision)}",
        f"kv={kv_dtype}",
        *([f"kvfmt={clean_field(kv_cache_dtype)}"] if kv_cache_dtype else []),
        f"page={int(getattr(kv_pool, 'page_size', 1))}",
        f"layout={clean_field(getattr(kv_pool, 'layout', 'unknown'))}",
        f"bytes={_page_bytes(kv_pool)}",  # e.g. MTP layers packed in: another page size
        f"tp={tp_part}",
        f"pp={pp_rank}of{pp_size}",
        f"cp={cp_rank}of{cp_size}",
    ]
    if namespace_salt:
        parts.append(f"salt={clean_field(namespace_salt)}")
    return RankNamespace("|".join(parts), f"@{rank}" if replicated else "", replicated, writer)
