"""Qwen3-MoE (and Qwen2-MoE): per-expert ``mlp.experts.{e}.{gate,up,down}_proj`` in the
checkpoint; transformers v5 holds them fused as ``mlp.experts.gate_up_proj`` [E, 2I, H]
(gate rows, then up rows) and ``mlp.experts.down_proj`` [E, H, I]."""

from __future__ import annotations

from . import register_family
from .base import TransformerFamily


@register_family
class Qwen3MoeFamily(TransformerFamily):
    name = "qwen3_moe"
    model_types = ("qwen3_moe", "qwen2_moe")
