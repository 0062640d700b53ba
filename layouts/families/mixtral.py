"""Mixtral: per-expert ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate/up/down) in the
checkpoint. transformers v5 renames ``block_sparse_moe`` to ``mlp`` and fuses w1|w3 into
``mlp.experts.gate_up_proj`` [E, 2I, H] and w2 into ``mlp.experts.down_proj`` [E, H, I];
SGLang keeps ``block_sparse_moe`` and names them ``experts.w13_weight``/``experts.w2_weight``."""

from __future__ import annotations

import re

from . import register_family
from .base import TransformerFamily


@register_family
class MixtralFamily(TransformerFamily):
    name = "mixtral"
    model_types = ("mixtral",)
    expert_re = re.compile(
        r"^(?P<prefix>.+\.block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<proj>w1|w2|w3)\.(?P<suffix>[A-Za-z0-9_]+)$")
    expert_projs = {"w1": "gate", "w3": "up", "w2": "down"}
    transformers_renames = [(r"\.block_sparse_moe\.", ".mlp.")]
    tp_rules = TransformerFamily.tp_rules + [(r"\.block_sparse_moe\.gate\.", "replicate")]
