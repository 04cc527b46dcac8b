"""Real hybrid architectures from ``transformers`` (pinned 5.23.0), built tiny and seeded.

No hub access: a model is built from a tiny config with ``torch.manual_seed(seed)``, written with
``save_pretrained`` into a directory and loaded back with ``from_pretrained`` (the real loading
path), so every process that builds the same (arch, seed, overrides) gets bit-identical weights.
The checkpoint digest (SHA-256 of config.json and the safetensors bytes) is part of the cache
namespace: the same weights under another config (a RoPE base or scaling, say) write other KV.

    arch           cache per layer (transformers' DynamicCache)           hicached pools
    qwen3_next     full attention: K/V [1, kv_heads, T, head_dim]          kv (MHA)
                   gated delta net: conv [1, conv_dim, K], rec [1,h,k,v]   mamba (one state)
    deepseek_v32   MLA latent: keys [1, 1, T, kv_lora], values [1,1,T,rope] kv (MLA)
                   DSA indexer keys [1, T, index_head_dim]                indexer

The cache geometry is read from a probe forward rather than derived from config formulas, so it
is exactly what the model writes. On CPU the GDN / causal-conv kernels fall back to transformers'
torch references (prefill: chunked rule; decode: recurrent rule), which are continuation-exact.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from hicached.extras import install_hint

log = logging.getLogger(__name__)

ARCHS = ("qwen3_next", "deepseek_v32")

# Tiny shapes: hidden 64, few layers, vocab 256; dense MLPs (MoE routing adds nothing to caching
# and near-tie expert choices would make fp-level differences visible). Override per call.
_TINY: dict[str, dict[str, Any]] = {
    "qwen3_next": {
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "mlp_only_layers": [0, 1, 2, 3],
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "max_position_embeddings": 16384,
    },
    "deepseek_v32": {
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
        "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "qk_nope_head_dim": 16, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 2, "index_topk": 16, "index_head_dim": 16, "index_n_heads": 2,
        "max_position_embeddings": 16384,
    },
}


class ModelUnavailable(ImportError):
    """transformers (the ``engine`` extra) is missing or has the wrong version."""


def _transformers():
    try:
        import transformers
        from transformers.utils import logging as hf_logging
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ModelUnavailable("the reference engine needs transformers: "
                               + install_hint("engine")) from e
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # kernel fallback notices are expected on CPU
    return transformers


@dataclass(frozen=True)
class CacheGeometry:
    """What one token / one state of a model's cache is, per pool.

    ``kind``: "mha" (K and V of ``kv_heads`` x ``k_dim``) or "mla" (one latent per token: keys
    [1, k_dim] and rope values [1, v_dim] stored side by side). ``attn_layers``: model layer ids
    with a KV cache, in pool-layer order; ``linear_layers`` likewise for recurrent states, whose
    per-layer shapes (batch dim 1 included) are ``conv_shape`` and ``recurrent_shape``;
    ``indexer_dim`` > 0 when the attention layers also keep DSA indexer keys.
    """

    kind: str
    attn_layers: tuple[int, ...]
    kv_heads: int
    k_dim: int
    v_dim: int
    kv_dtype: torch.dtype
    linear_layers: tuple[int, ...] = ()
    conv_shape: tuple[int, ...] = ()
    recurrent_shape: tuple[int, ...] = ()
    state_dtype: torch.dtype = torch.float32  # recurrent state
    conv_dtype: torch.dtype = torch.float32
    indexer_dim: int = 0
    indexer_dtype: torch.dtype = torch.float32

    @property
    def hybrid(self) -> bool:
        """True when the model has recurrent states (the radix cache then needs them to match)."""
        return bool(self.linear_layers)

    @property
    def has_indexer(self) -> bool:
        return self.indexer_dim > 0

    @property
    def conv_kernel(self) -> int:
        return self.conv_shape[-1]


def _probe_geometry(model, config) -> CacheGeometry:
    """Run two tokens through a fresh DynamicCache and read what each layer stored."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer, LinearAttentionLayer

    cache = DynamicCache(config=config)
    device = next(model.parameters()).device
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.long, device=device), past_key_values=cache,
              use_cache=True)
    attn, linear, k, v, conv, rec, idx = [], [], None, None, None, None, None
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionLayer):
            linear.append(i)
            conv, rec = layer.conv_states[0], layer.recurrent_states[0]
        if isinstance(layer, DynamicLayer):
            attn.append(i)
            k, v = layer.keys, layer.values
            if isinstance(layer, DynamicIndexedLayer):
                idx = layer.indexer_keys
    if k is None:
        raise ValueError(f"{type(model).__name__} has no attention layer with a KV cache")
    kind = "mla" if getattr(config, "kv_lora_rank", None) else "mha"
    if kind == "mha" and k.shape[-1] != v.shape[-1]:
        raise ValueError(f"MHA pools need equal K/V head dims, got {k.shape[-1]} and "
                         f"{v.shape[-1]}")
    return CacheGeometry(
        kind=kind, attn_layers=tuple(attn), kv_heads=int(k.shape[1]), k_dim=int(k.shape[-1]),
        v_dim=int(v.shape[-1]), kv_dtype=k.dtype, linear_layers=tuple(linear),
        conv_shape=tuple(conv.shape) if conv is not None else (),
        recurrent_shape=tuple(rec.shape) if rec is not None else (),
        state_dtype=rec.dtype if rec is not None else torch.float32,
        conv_dtype=conv.dtype if conv is not None else torch.float32,
        indexer_dim=int(idx.shape[-1]) if idx is not None else 0,
        indexer_dtype=idx.dtype if idx is not None else torch.float32)


def _digest(path: str) -> str:
    """Digest of a checkpoint: its config and its weights. Both shape the cache: the same
    weights loaded under another RoPE base or scaling write other KV for the same tokens."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name == "config.json" or name.endswith(".safetensors"):
            h.update(f"{name}\0".encode())
            with open(os.path.join(path, name), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


class LoadedModel:
    """A causal LM plus what the engine needs to cache it: geometry, identity, forward."""

    def __init__(self, arch: str, model, path: str | None, device: torch.device,
                 dtype: torch.dtype):
        self.arch, self.model, self.path = arch, model, path
        self.device, self.dtype = device, dtype
        self.config = model.config
        self.vocab_size = int(self.config.vocab_size)
        self.weights_digest = _digest(path)
        self.geometry = _probe_geometry(model, self.config)

    @property
    def identity(self) -> str:
        """Architecture and shape, e.g. ``qwen3_next-h64-l4-v256``."""
        c = self.config
        return f"{self.arch}-h{c.hidden_size}-l{c.num_hidden_layers}-v{c.vocab_size}"

    def new_cache(self):
        """An empty ``DynamicCache`` laid out for this model's layer types."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def forward(self, token_ids, cache) -> torch.Tensor:
        """Logits [len(token_ids), vocab] (float32) of one chunk appended to ``cache``."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device)[None]
        with torch.no_grad():
            out = self.model(ids, past_key_values=cache, use_cache=True)
        return out.logits[0].float()


    def warmup(self, page_size: int = 16) -> None:
        """Run every kernel path once (chunked prefill, continuation, decode) so the first
        timed request does not pay for lazy initialisation."""
        cache = self.new_cache()
        for start in (0, page_size):
            self.forward(range(start, start + page_size), cache)
        self.forward([1], cache)


def tiny_config(arch: str, **overrides):
    """The tiny config of ``arch`` with ``overrides`` applied (no hub access)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; valid: {list(ARCHS)}")
    _transformers()
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig as Config
    else:
        from transformers.models.deepseek_v32 import DeepseekV32Config as Config
    kw = {**_TINY[arch], **overrides}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides and arch == "qwen3_next":
        n = overrides["num_hidden_layers"]
        kw["layer_types"] = ["linear_attention" if i % 2 == 0 else "full_attention"
                             for i in range(n)]
        kw["mlp_only_layers"] = list(range(n))
    if arch == "deepseek_v32" and "num_hidden_layers" in overrides:
        kw.setdefault("first_k_dense_replace", overrides["num_hidden_layers"])
        kw["first_k_dense_replace"] = max(kw["first_k_dense_replace"],
                                          overrides["num_hidden_layers"])
    return Config(**kw)


def load_model(arch: str, *, seed: int = 0, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, path: str | None = None,
               **overrides) -> LoadedModel:
    """Build ``arch`` tiny with seeded weights, save it to ``path`` and load it back with
    ``from_pretrained``. A ``path`` that already holds weights is loaded as is (a second process
    reusing the first one's checkpoint). Without ``path`` the checkpoint lives in a temporary
    directory that is gone when this returns (``LoadedModel.path`` is then None)."""
    if path is None:
        with tempfile.TemporaryDirectory(prefix=f"hicached-{arch}-") as tmp:
            lm = load_model(arch, seed=seed, device=device, dtype=dtype, path=tmp, **overrides)
        lm.path = None
        return lm
    transformers = _transformers()
    device = torch.device(device)
    if not os.path.exists(os.path.join(path, "config.json")):
        config = tiny_config(arch, **overrides)
        torch.manual_seed(seed)
        built = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        built.save_pretrained(path)
        del built
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device).eval()
    return LoadedModel(arch, model, path, device, dtype)


# ------------------------------------------------------------------ oracles


def live_logits(lm: LoadedModel, prompt, page_size: int, decode_ids=()) -> list[torch.Tensor]:
    """Logits [vocab] at the end of ``prompt`` and after each of ``decode_ids``, computed through
    one live cache the way the engine computes them (prompt page by page, then one token per
    step): what any cached continuation must reproduce."""
    cache = lm.new_cache()
    logits = None
    for start in range(0, len(prompt), page_size):
        logits = lm.forward(prompt[start : start + page_size], cache)
    out = [logits[-1]]
    for token in decode_ids:
        out.append(lm.forward([token], cache)[-1])
    return out


def recompute_logits(lm: LoadedModel, token_ids) -> torch.Tensor:
    """Last-position logits [vocab] of ``token_ids`` in one forward without any cache."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=lm.device)[None]
    with torch.no_grad():
        return lm.model(ids, use_cache=False).logits[0, -1].float()
