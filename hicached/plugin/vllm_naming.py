"""What the vLLM connector calls things in the daemon: its namespace, pools and page keys.

Kept apart from ``plugin/vllm.py`` (which imports vLLM) so that it is plain data in, strings out.

**Keys.** A page is one vLLM block of one KV-cache group, and its key is the hex of vLLM's own
block hash at the block's last token (``Request.block_hashes`` are chained: a block's hash covers
every token before it, plus what vLLM folds in: ``cache_salt``, multimodal hashes, the LoRA
name). With several groups of different block sizes vLLM hashes every ``hash_block_size`` tokens;
the key of a ``block_size`` block is then the hash at its end. Those hashes are the same in every
process only when their chain's seed is: vLLM's default ``sha256`` / ``sha256_cbor`` start from a
fixed seed; the ``xxhash`` algorithms start from random bytes per process unless
``PYTHONHASHSEED`` is set (``vllm/v1/core/kv_cache_utils.py``, ``resolve_none_hash_seed``), and the
connector refuses them then (``check_hash_algo``): every key would be new, and worse, xxhash is not
collision resistant across tenants.

**Namespace.** Everything that shapes a page's bytes, by the SGLang plugin's rules
(``namespace.py``: same escaping, same ``RankNamespace``)::

    vllm|model=<served name>|rev=<revision>|cfg=<config digest>|dtype=<model dtype>
        |kv=<kv cache dtype>|block=<tokens>|hash=<algo>|layout=<groups>|tp=<rank>of<size>
        |pp=<rank>of<size>[|salt=<salt>]

``cfg`` is a digest of the model's Hugging Face config (architecture, sizes, rope, ...), not of
the weights (minutes for a large model): two checkpoints of one architecture and config need a
``model_revision`` or a different name to be told apart. ``layout`` names each group's kind, layer
count and block bytes, so another attention backend's block shape never shares a page.

**Pools.** Group ``i`` of vLLM's KV-cache config is pool ``kv`` when it is the first full-attention
group (the anchor of every hit), else ``kv.<i>`` (other full-attention groups, all pages needed),
``swa.<i>`` (sliding window: only the blocks inside the window at the hit's end) or ``mamba.<i>``
(recurrent state: only the block at the hit's end). A hit is the longest prefix every pool can
restore, as in the v2 API.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicached.plugin.namespace import RankNamespace, clean_field, dtype_name
from hicached.types import PoolHitPolicy, key_list

log = logging.getLogger(__name__)

REPRODUCIBLE_HASHES = ("sha256", "sha256_cbor")
KINDS = ("attention", "sliding", "state")
# Hugging Face config keys that name where a config came from, not what the model computes
_CONFIG_NOISE = ("_name_or_path", "transformers_version", "_commit_hash", "name_or_path")


@dataclass(frozen=True)
class GroupSpec:
    """One vLLM KV-cache group as the connector stores it."""

    index: int  # the group's position in vLLM's KVCacheConfig.kv_cache_groups
    kind: str  # one of KINDS
    block_size: int  # tokens per block of this group
    layers: int
    page_bytes: int  # bytes of one block over the group's layers
    window_blocks: int = 1  # sliding: blocks a hit at its end needs (state: 1)

    @property
    def hit_policy(self) -> PoolHitPolicy:
        return PoolHitPolicy.ALL_PAGES if self.kind == "attention" else \
            PoolHitPolicy.TRAILING_PAGES


def pool_names(groups: Sequence[GroupSpec]) -> dict[int, str]:
    """Group index -> pool name (see the module docstring); ValueError without an attention
    group (a model of states only: vLLM does no prefix caching for it)."""
    anchor = next((g.index for g in groups if g.kind == "attention"), None)
    if anchor is None:
        raise ValueError("the model has no full-attention KV-cache group, which every hit is "
                         f"anchored on; its groups: {[g.kind for g in groups]}")
    prefix = {"attention": "kv", "sliding": "swa", "state": "mamba"}
    return {g.index: "kv" if g.index == anchor else f"{prefix[g.kind]}.{g.index}"
            for g in groups}


def load_async(extra: dict, groups: int) -> bool:
    """``kv_connector_extra_config["load_async"]`` (default true). Several KV-cache groups load
    asynchronously whatever it says: vLLM takes a failed load of such a model only as a failed
    asynchronous receive (block ids are per group), and raises on the other kind."""
    value = extra.get("load_async", True)
    if not isinstance(value, bool):
        raise ValueError(  # noqa: TRY004 - vLLM reports a ValueError of a connector
            f"hicached extra_config load_async must be true or false, got {value!r}")
    if not value and groups > 1:
        log.warning("hicached: load_async is false, but this model has %d KV-cache groups, "
                    "whose failed loads vLLM takes only asynchronously: loads are asynchronous",
                    groups)
    return value or groups > 1


COPY_PATHS = ("auto", "pointer", "device")


def copy_path(extra: dict) -> str:
    """``kv_connector_extra_config["copy_path"]``: how blocks are copied. ``auto`` (default):
    ``memmove`` of host blocks (``BlockPool``), device gathers for KV caches on a GPU;
    ``device``: the device gathers on a CPU KV cache too (to check that path without a GPU);
    ``pointer``: host blocks only (a GPU group is then not stored)."""
    value = extra.get("copy_path", "auto")
    if value not in COPY_PATHS:
        raise ValueError(f"hicached extra_config copy_path must be one of {COPY_PATHS}, got "
                         f"{value!r}")
    return value


def check_hash_algo(algo: str, env: Mapping[str, str]) -> None:
    """ValueError when vLLM's block hashes under ``algo`` differ per process (see above)."""
    if algo in REPRODUCIBLE_HASHES:
        return
    if algo.startswith("xxhash") and env.get("PYTHONHASHSEED") is not None:
        return
    raise ValueError(
        f"hicached: prefix_caching_hash_algo={algo!r} gives block hashes that differ per "
        "process (vLLM seeds its non-cryptographic hashes with random bytes unless "
        "PYTHONHASHSEED is set), so no page could ever be shared; use the default 'sha256' "
        "(or 'sha256_cbor'), or set PYTHONHASHSEED to one value for every vLLM process of the "
        "node")


def config_digest(config: Mapping[str, Any]) -> str:
    """16 hex digits of SHA-256 over the model config (see the module docstring)."""
    clean = {k: v for k, v in config.items() if k not in _CONFIG_NOISE}
    text = json.dumps(clean, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_vllm_namespace(*, model: str, config: str, dtype: Any, kv_cache_dtype: str,
                         block_size: int, hash_algo: str, groups: Sequence[GroupSpec],
                         tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                         revision: str = "", salt: str = "") -> RankNamespace:
    """The namespace of one vLLM worker rank (the scheduler uses rank 0's)."""
    layout = ",".join(f"{g.index}:{g.kind}:{g.layers}x{g.page_bytes}:{g.block_size}"
                      for g in groups)
    parts = [
        "vllm",
        f"model={clean_field(model or 'unnamed')}",
        f"rev={clean_field(revision)}",
        f"cfg={clean_field(config)}",
        f"dtype={dtype_name(dtype)}",
        f"kv={clean_field(kv_cache_dtype or 'auto')}",
        f"block={int(block_size)}",
        f"hash={clean_field(hash_algo)}",
        f"layout={clean_field(layout)}",
        f"tp={int(tp_rank)}of{int(tp_size)}",
        f"pp={int(pp_rank)}of{int(pp_size)}",
    ]
    if salt:
        parts.append(f"salt={clean_field(salt)}")
    return RankNamespace("|".join(parts), "", False, True)


def page_keys(block_hashes: Sequence[bytes], hash_block_size: int, block_size: int,
              count: int) -> list[str]:
    """Keys of the first ``count`` blocks of ``block_size`` tokens (fewer when the request has
    fewer hashed tokens). ``block_hashes`` given as one ``bytes`` (or ``str``) raises
    ``InvalidArgument``: its items would be byte values, each made a key."""
    if isinstance(block_hashes, (str, bytes, bytearray, memoryview)):
        key_list(block_hashes, "block_hashes")  # (raises; a list is not copied here)
    if block_size % hash_block_size:
        raise ValueError(f"block size {block_size} is not a multiple of the hash block size "
                         f"{hash_block_size}")
    step = block_size // hash_block_size
    count = min(count, len(block_hashes) // step)
    return [_hex(block_hashes[(i + 1) * step - 1]) for i in range(count)]


def _hex(h: Any) -> str:
    """A block hash as a key: bytes (vLLM's ``BlockHash``) as hex; an int (older vLLMs) as
    16+ hex digits."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h).hex()
    if isinstance(h, int):
        return f"{h & (2**256 - 1):064x}"
    raise TypeError(f"unexpected vLLM block hash type {type(h).__name__}")


def chunk_alignment_warning(core_block: int, block: int, groups: Sequence[GroupSpec]
                            ) -> str | None:
    """What to tell an operator when vLLM's engine core aligns prefill chunks to
    ``core_block`` tokens while its KV-cache groups took ``block`` (vLLM 0.32 on CPU sizes
    the groups' blocks to fit an fp32 state, 384 tokens, while its scheduler goes on chunking
    on the configured 128): a state is stored only where a chunk ended on a block end
    (``HicachedConnector._only_end_state``), so most prompts store none. None when all is
    well."""
    if not core_block or core_block == block or not any(g.kind == "state" for g in groups):
        return None
    return (f"vLLM's scheduler aligns prefill chunks to {core_block}-token blocks while its "
            f"KV-cache groups use {block}-token blocks: hicached stores a state only where a "
            f"chunk ended on a block end, so most prompts store none (no hits, never wrong "
            f"ones); pass --block-size {block} to vLLM for a state at every prompt's last "
            f"full block")


def _group_kind(spec: Any) -> str | None:
    names = {c.__name__ for c in type(spec).__mro__}
    if "MambaSpec" in names:
        return "state"
    if names & {"SlidingWindowSpec", "ChunkedLocalAttentionSpec", "SlidingWindowMLASpec"}:
        return "sliding"
    if "FullAttentionSpec" in names:
        return "attention"
    return None


def group_specs(kv_cache_config: Any) -> list[GroupSpec]:
    """The transferable groups of vLLM's ``KVCacheConfig`` as ``GroupSpec``; ValueError for a
    group kind this connector does not know (vLLM then refuses to start, naming it)."""
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    groups = kv_cache_config.kv_cache_groups
    out = []
    for i in ids if ids is not None else range(len(groups)):
        g = groups[i]
        spec = g.kv_cache_spec
        kind = _group_kind(spec)
        if kind is None:
            raise ValueError(f"KV-cache group {i} is a {type(spec).__name__}, which hicached "
                             "does not store")
        window = 1
        if kind == "sliding":
            w = int(getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size",
                                                                     0) or 0)
            window = max(1, -(-(w - 1) // spec.block_size) + 1)
        out.append(GroupSpec(i, kind, int(spec.block_size), len(g.layer_names),
                             int(spec.page_size_bytes) * len(g.layer_names), window))
    return out
