"""Dense Llama-style decoders (Llama, Mistral, Qwen2, Qwen3): no experts; attention and MLP
split for tensor parallelism with the shared transformer rules."""

from __future__ import annotations

from . import register_family
from .base import TransformerFamily


@register_family
class LlamaFamily(TransformerFamily):
    name = "llama"
    model_types = ("llama", "mistral", "qwen2", "qwen3")
    expert_re = None
