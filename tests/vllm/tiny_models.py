"""Tiny models for the vLLM tests, built locally from seeded configs, with a locally trained
tokenizer: nothing comes from a model hub. ``build(out, arch)`` takes a few seconds.

Weights are drawn with a large ``initializer_range`` so that greedy outputs depend on the whole
prompt (small random weights make every prompt decode to one repeated token, and a comparison of
cached and uncached outputs would then prove nothing).
"""

from __future__ import annotations

import os

CORPUS = [f"the quick brown fox {i} jumps over the lazy dog number {i * 7} and cache page {i % 13}"
          for i in range(2000)]


def build(out: str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """Write model ``arch`` ("llama", "qwen3_next", "granitemoehybrid") to ``out``; returns
    ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(out)
    common = dict(vocab_size=1024, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                  max_position_embeddings=8192, tie_word_embeddings=True, initializer_range=0.3)
    if arch == "llama":
        kw = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    elif arch == "qwen3_next":
        # the CPU gated-delta-net kernel takes linear head dims of 128 only
        kw = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  full_attention_interval=2, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=64, shared_expert_intermediate_size=64,
                  linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, decoder_sparse_step=1,
                  tie_word_embeddings=False)  # vLLM's Qwen3-Next leaves a tied lm_head at 0
    elif arch == "granitemoehybrid":  # Granite-4 hybrid: Mamba2 / attention / Mamba2 / attention
        kw = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, shared_intermediate_size=128,
                  layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=4,
                  mamba_n_groups=1, mamba_d_state=16, mamba_d_head=64, mamba_d_conv=4,
                  mamba_expand=2, mamba_chunk_size=64, position_embedding_type="rope")
    else:
        raise ValueError(f"unknown arch {arch!r}")
    kw = {**common, **kw}
    kw.update(overrides)
    cfg = AutoConfig.for_model(arch, **kw)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


def build_all(specs: dict[str, tuple[str, dict]]) -> None:
    """``build(out, arch, **overrides)`` for each ``out: (arch, overrides)``."""
    for out, (arch, overrides) in specs.items():
        build(out, arch, **overrides)
