"""Tiny checkpoints for tests, demos and benchmarks: real transformers architectures with a
hidden size of 64 and two layers, random weights, saved with ``save_pretrained``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TINY_MODEL_TYPES = ("qwen3_moe", "mixtral", "deepseek_v3", "llama")


def tiny_config(model_type: str, **overrides: Any):
    """A small transformers config of ``model_type`` (hidden 64, 2 layers, 4-8 experts)."""
    import transformers as tf

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if model_type == "qwen3_moe":
        kw = dict(common, intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=2, head_dim=16,
                  num_experts=8, num_experts_per_tok=2)
        cls = tf.Qwen3MoeConfig
    elif model_type == "mixtral":
        kw = dict(common, intermediate_size=32, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                  num_experts_per_tok=2)
        cls = tf.MixtralConfig
    elif model_type == "deepseek_v3":
        kw = dict(common, intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                  q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
        cls = tf.DeepseekV3Config
    elif model_type == "llama":
        kw = dict(common, intermediate_size=128, num_key_value_heads=2, head_dim=16)
        cls = tf.LlamaConfig
    else:
        raise ValueError(f"no tiny config for {model_type!r}; known: {', '.join(TINY_MODEL_TYPES)}")
    kw.update(overrides)
    return cls(**kw)


def save_tiny_model(model_type: str, path: str | os.PathLike, *, seed: int = 0, dtype=None,
                    max_shard_size: str | None = None, **overrides: Any):
    """Build ``model_type`` from :func:`tiny_config` with random weights (``seed``), cast to
    ``dtype`` if given, ``save_pretrained`` it (safetensors) into ``path``; return the model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    with torch.no_grad():
        # Norm weights start at exactly 1.0 and biases at 0: randomise them so a misplaced
        # tensor cannot pass a comparison by accident.
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b))
    if dtype is not None:
        model = model.to(dtype)
    Path(path).mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model
