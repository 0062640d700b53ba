"""DeepSeek-V3-style models (DeepSeek-V2/V3, Kimi-K2 layouts): MLA attention, the first
``first_k_dense_replace`` layers dense, the rest MoE with ``n_routed_experts`` routed experts
(``mlp.experts.{e}.{gate,up,down}_proj``), shared experts, a router with
``e_score_correction_bias``. Checkpoint layers at or past ``num_hidden_layers`` (the
multi-token-prediction module) are not part of the served model and are skipped, as
transformers skips them.

Tensor parallelism: ``q_b_proj``/``q_proj`` and ``kv_b_proj`` split on heads, ``o_proj`` by
rows (its input dim); ``q_a_proj``, ``kv_a_proj_with_mqa`` and the layernorms replicated;
dense and shared-expert MLPs column/row; routed experts split on the intermediate dim.
For SGLang, ``q_a_proj|kv_a_proj_with_mqa`` are stacked into ``fused_qkv_a_proj_with_mqa``
and gate|up into ``gate_up_proj``; the engine still derives ``w_kc``/``w_vc`` from
``kv_b_proj`` after loading (not in the image).
"""

from __future__ import annotations

from . import register_family
from .base import TransformerFamily, layer_index


@register_family
class DeepseekV3Family(TransformerFamily):
    name = "deepseek_v3"
    model_types = ("deepseek_v3", "deepseek_v2", "kimi_k2")
    num_experts_keys = ("n_routed_experts", "num_local_experts", "num_experts")
    tp_rules = [
        (r"(^|\.)(embed_tokens|lm_head)\.", "replicate"),
        (r"norm\.(weight|bias)$", "replicate"),
        (r"\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.", "replicate"),
        (r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj)\.", "q_heads"),
        (r"\.self_attn\.o_proj\.", "row"),
        (r"\.(mlp|shared_experts)\.(gate_proj|up_proj)\.", "column"),
        (r"\.(mlp|shared_experts)\.down_proj\.", "row"),
        (r"\.mlp\.gate\.(weight|bias|e_score_correction_bias)$", "replicate"),
    ]
    sglang_fusions = TransformerFamily.sglang_fusions + [
        (r"^(?P<m>.+\.self_attn)\.(?P<p>q_a_proj|kv_a_proj_with_mqa)\.(?P<s>[A-Za-z0-9_]+)$",
         ["q_a_proj", "kv_a_proj_with_mqa"], "{m}.fused_qkv_a_proj_with_mqa.{s}"),
    ]

    def skip_reason(self, name: str, config: dict) -> str | None:
        n_layers = config.get("num_hidden_layers")
        layer = layer_index(name)
        if isinstance(n_layers, int) and layer is not None and layer >= n_layers:
            return (f"layer {layer} >= num_hidden_layers={n_layers} (multi-token-prediction weights; "
                    "transformers does not load them)")
        return None
