"""Any safetensors model: every tensor verbatim, all in the non-expert region, one rank."""

from __future__ import annotations

from flashboot.errors import LayoutError

from . import register_family
from .base import Family, PlanContext, RankPlan, verbatim


@register_family
class GenericFamily(Family):
    """Tensors exactly as the checkpoint names and stores them. Knows no sharding, so tp > 1
    and ep > 1 are refused; the names bind a module only where the checkpoint's names are
    that module's parameter names."""

    name = "generic"
    model_types = ()

    def plan(self, ctx: PlanContext) -> RankPlan:
        p = ctx.parallel
        if p.world_size > 1:
            raise LayoutError(f"family generic has no sharding rules: tp={p.tp_size}, ep={p.ep_size} refused "
                              "(pre-pack at tp=1, ep=1, or add a family rule for this model type)")
        return RankPlan(p, [verbatim(src) for src in ctx.sources.values()])
