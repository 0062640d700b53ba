"""What a family rule produces, and the shared machinery of the transformer families.

A family turns the checkpoint's tensors into one rank's image tensors. Each image tensor is a
:class:`PlannedTensor`: name, dtype, shape, region, and the :class:`Piece` list that fills
it. A piece is a box of one source tensor (a start:stop per source dimension) whose
C-contiguous bytes land at an element offset of the image tensor. Fusing gate|up, cutting
a tensor-parallel shard and picking an expert-parallel block are all just pieces, so the
writer needs no per-family code and :func:`check_plan` can verify any family's plan against
the source headers.
"""

from __future__ import annotations

import itertools
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flashboot.errors import LayoutError

from ..checkpoint import SourceTensor
from ..format import ExpertMap, LayoutSlot, ParallelLayout, Part, Split, natural_key


@dataclass(frozen=True)
class Piece:
    """Source tensor ``source`` restricted to ``box`` (one (start, stop) per source dim), its
    bytes written C-contiguously from element ``dst_elem`` of the image tensor."""

    source: str
    box: tuple[tuple[int, int], ...]
    dst_elem: int

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in self.box)


@dataclass
class PlannedTensor:
    """One tensor of one rank's image and how to fill it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    region: str
    pieces: list[Piece]
    shard: tuple[Split, ...] = ()
    parts: tuple[Part, ...] = ()

    def slot(self) -> LayoutSlot:
        return LayoutSlot(self.name, self.dtype, self.shape, self.region, self.shard, self.parts)


@dataclass
class PlanContext:
    """What a family sees: the config, the source headers, the rank, the target engine."""

    config: dict[str, Any]
    sources: dict[str, SourceTensor]
    parallel: ParallelLayout
    target: str


@dataclass
class RankPlan:
    """One rank's image tensors plus what the family decided not to write and why."""

    parallel: ParallelLayout
    tensors: list[PlannedTensor]
    experts: ExpertMap | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    """Source name -> reason it is not in the image."""
    warnings: list[str] = field(default_factory=list)


class Family(ABC):
    """A family rule: registered under ``name`` for the config ``model_type`` values it lists."""

    name: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    """Engine naming targets this family can produce."""
    targets: ClassVar[tuple[str, ...]] = ("transformers", "sglang")

    @abstractmethod
    def plan(self, ctx: PlanContext) -> RankPlan:
        """The image tensors of ``ctx.parallel.rank``. Raises LayoutError for a layout the
        family cannot produce (indivisible shapes, missing experts, unknown tensors at tp>1)."""


def full_box(src: SourceTensor) -> tuple[tuple[int, int], ...]:
    return tuple((0, n) for n in src.shape)


def verbatim(src: SourceTensor, name: str | None = None, region: str = "non_experts") -> PlannedTensor:
    """The source tensor unchanged."""
    return PlannedTensor(name or src.name, src.dtype, src.shape, region, [Piece(src.name, full_box(src), 0)])


def split_range(size: int, index: int, count: int, what: str) -> tuple[int, int]:
    """Piece ``index`` of ``size`` cut in ``count`` equal pieces; LayoutError if indivisible."""
    if size % count:
        raise LayoutError(f"{what}: dimension of size {size} does not split into {count} equal shards")
    n = size // count
    return index * n, (index + 1) * n


def check_plan(plan: RankPlan, sources: dict[str, SourceTensor], family: str) -> None:
    """Verify a family's plan independently of the family: every piece reads inside its source,
    has the image tensor's dtype, and the pieces tile the image tensor exactly once."""
    names = set()
    for t in plan.tensors:
        where = f"family {family}, rank {plan.parallel.rank}: tensor {t.name!r}"
        if t.name in names:
            raise LayoutError(f"{where}: produced twice")
        names.add(t.name)
        numel = math.prod(t.shape)
        ranges = []
        for p in t.pieces:
            src = sources.get(p.source)
            if src is None:
                raise LayoutError(f"{where}: piece reads unknown source tensor {p.source!r}")
            if src.dtype != t.dtype:
                raise LayoutError(f"{where}: piece from {p.source!r} is {src.dtype}, the tensor is {t.dtype}")
            if len(p.box) != src.ndim or any(not 0 <= a <= b <= n for (a, b), n in zip(p.box, src.shape)):
                raise LayoutError(f"{where}: piece box {p.box} is outside {p.source!r} of shape {list(src.shape)}")
            ranges.append((p.dst_elem, p.dst_elem + p.numel, p.source))
        ranges.sort()
        cursor = 0
        for a, b, s in ranges:
            if a != cursor:
                raise LayoutError(f"{where}: pieces leave elements {cursor}..{a} unfilled or overlap at "
                                  f"{a} (piece from {s!r})")
            cursor = b
        if cursor != numel:
            raise LayoutError(f"{where}: pieces fill {cursor} of {numel} elements")


# ------------------------------------------------------------------------ transformer families
_TP_KINDS = ("q_heads", "kv_heads", "column", "row", "replicate")


class TransformerFamily(Family):
    """Rules shared by decoder-only transformer families (Llama-style attention and MLP, and
    MoE experts stored per expert as ``...experts.{e}.{gate,up,down}...``).

    Subclasses set data, not code:

    - ``expert_re``: regex with groups ``prefix``, ``e``, ``proj``, ``suffix`` for per-expert
      tensors; ``expert_projs`` maps the checkpoint's projection names to gate/up/down.
    - ``num_experts_keys``: config keys holding the routed expert count.
    - ``tp_rules``: ``(regex, kind)`` for every non-expert tensor, first match wins; kinds:
      ``q_heads``/``kv_heads`` (column split on head boundaries; kv heads are replicated when
      tp exceeds them), ``column`` (dim 0), ``row`` (dim 1; 1-D tensors replicate), ``replicate``.
    - ``transformers_renames``: ``(regex, replacement)`` from checkpoint to module names.
    - ``sglang_fusions``: ``(regex with groups m, p, s, [members in order], fused name)``.
    """

    expert_re: ClassVar[re.Pattern | None] = re.compile(
        r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<suffix>[A-Za-z0-9_]+)$")
    expert_projs: ClassVar[dict[str, str]] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    fused_expert_re: ClassVar[re.Pattern] = re.compile(
        r"^(?P<prefix>.+)\.experts\.(?P<kind>gate_up_proj|down_proj)(?P<sfx>(?:_[a-z_]+)?)$")
    num_experts_keys: ClassVar[tuple[str, ...]] = ("num_experts", "num_local_experts", "n_routed_experts")
    heads_key: ClassVar[str] = "num_attention_heads"
    kv_heads_key: ClassVar[str] = "num_key_value_heads"
    tp_rules: ClassVar[list[tuple[str, str]]] = [
        (r"(^|\.)(embed_tokens|lm_head|wte|wpe)\.", "replicate"),
        (r"norm\.(weight|bias)$", "replicate"),
        (r"\.self_attn\.q_proj\.", "q_heads"),
        (r"\.self_attn\.(k_proj|v_proj)\.", "kv_heads"),
        (r"\.self_attn\.o_proj\.", "row"),
        (r"\.(mlp|shared_experts?)\.(gate_proj|up_proj)\.", "column"),
        (r"\.(mlp|shared_experts?)\.down_proj\.", "row"),
        (r"\.mlp\.gate\.(weight|bias|e_score_correction_bias)$", "replicate"),
        (r"\.shared_expert_gate\.", "replicate"),
    ]
    transformers_renames: ClassVar[list[tuple[str, str]]] = []
    sglang_fusions: ClassVar[list[tuple[str, list[str], str]]] = [
        (r"^(?P<m>.+\.self_attn)\.(?P<p>q_proj|k_proj|v_proj)\.(?P<s>[A-Za-z0-9_]+)$",
         ["q_proj", "k_proj", "v_proj"], "{m}.qkv_proj.{s}"),
        (r"^(?P<m>.+\.(?:mlp|shared_experts?))\.(?P<p>gate_proj|up_proj)\.(?P<s>[A-Za-z0-9_]+)$",
         ["gate_proj", "up_proj"], "{m}.gate_up_proj.{s}"),
    ]

    # --------------------------------------------------------------------------------- hooks
    def skip_reason(self, name: str, config: dict) -> str | None:
        """Why a source tensor is not part of the served model (None: it is)."""
        return None

    def num_experts(self, config: dict) -> int | None:
        for key in self.num_experts_keys:
            v = config.get(key)
            if isinstance(v, int) and v > 0:
                return v
        return None

    def rename(self, name: str, target: str) -> str:
        if target == "transformers":
            for pattern, repl in self.transformers_renames:
                name = re.sub(pattern, repl, name)
        return name

    # ---------------------------------------------------------------------------------- plan
    def plan(self, ctx: PlanContext) -> RankPlan:
        if ctx.target not in self.targets:
            raise LayoutError(f"family {self.name} cannot produce target {ctx.target!r}; it knows "
                              f"{', '.join(self.targets)}")
        plan = RankPlan(ctx.parallel, [])
        per_expert: dict[tuple[str, str], dict[str, dict[int, SourceTensor]]] = {}
        fused: list[tuple[re.Match, SourceTensor]] = []
        others: list[SourceTensor] = []
        for name in sorted(ctx.sources, key=natural_key):
            src = ctx.sources[name]
            reason = self.skip_reason(name, ctx.config)
            if reason:
                plan.skipped[name] = reason
                continue
            m = self.expert_re.match(name) if self.expert_re else None
            if m and m.group("proj") in self.expert_projs:
                group = per_expert.setdefault((m.group("prefix"), m.group("suffix")), {})
                experts = group.setdefault(self.expert_projs[m.group("proj")], {})
                e = int(m.group("e"))
                if e in experts:  # experts.7 and experts.07: one would be dropped unseen
                    raise LayoutError(f"family {self.name}: {experts[e].name!r} and {name!r} are both expert {e}")
                experts[e] = src
                continue
            m = self.fused_expert_re.match(name)
            if m and src.ndim == 3:
                fused.append((m, src))
                continue
            others.append(src)
        if plan.skipped:
            plan.warnings.append(f"family {self.name}: {len(plan.skipped)} checkpoint tensor(s) not written: "
                                 f"{next(iter(plan.skipped.values()))} (e.g. {next(iter(plan.skipped))})")
        if per_expert or fused:
            n_experts = self._expert_count(ctx, per_expert, fused)
            p = ctx.parallel
            start, stop = split_range(n_experts, p.ep_rank, p.ep_size, f"{n_experts} experts over ep={p.ep_size}")
            plan.experts = ExpertMap(n_experts, start, stop - start)
            for (prefix, suffix), projs in per_expert.items():
                plan.tensors += self._plan_experts(ctx, prefix, suffix, projs, range(start, stop))
            for m, src in fused:
                plan.tensors.append(self._plan_fused_experts(ctx, m, src, range(start, stop)))
        plan.tensors += self._plan_non_experts(ctx, others)
        return plan

    # ------------------------------------------------------------------------------ experts
    def _expert_count(self, ctx, per_expert, fused) -> int:
        n = self.num_experts(ctx.config)
        if n is None:
            raise LayoutError(f"family {self.name}: the checkpoint has expert tensors but config.json has none of "
                              f"{', '.join(self.num_experts_keys)}")
        for (prefix, suffix), projs in per_expert.items():
            for proj in ("gate", "up", "down"):
                have = projs.get(proj, {})
                extra = sorted(e for e in have if not 0 <= e < n)
                if extra or len(have) != n:  # distinct keys: n of them, all in range, are range(n)
                    # only as many as the message shows: a config may claim 10^12 experts
                    missing = list(itertools.islice((e for e in range(n) if e not in have), 9))
                    raise LayoutError(f"family {self.name}: {prefix}.experts.*.{proj} ({suffix}): config says {n:,} "
                                      f"experts, the checkpoint has {len(have) - len(extra):,} of them; missing "
                                      f"{missing[:8]}{'...' if len(missing) > 8 else ''}"
                                      f"{', unexpected ' + str(extra[:8]) if extra else ''}")
        for m, src in fused:
            if src.shape[0] != n:
                raise LayoutError(f"family {self.name}: {src.name} holds {src.shape[0]} experts, config says {n}")
        return n

    def _expert_names(self, ctx, prefix: str, suffix: str) -> tuple[str, str]:
        if ctx.target == "sglang":
            return f"{prefix}.experts.w13_{suffix}", f"{prefix}.experts.w2_{suffix}"
        sfx = "" if suffix == "weight" else "_" + suffix.removeprefix("weight_")
        return (self.rename(f"{prefix}.experts.gate_up_proj{sfx}", ctx.target),
                self.rename(f"{prefix}.experts.down_proj{sfx}", ctx.target))

    def _plan_experts(self, ctx, prefix, suffix, projs, local: range) -> list[PlannedTensor]:
        """gate|up fused into one [E_local, 2*I/moe_tp, ...] tensor, down into [E_local, H, I/moe_tp]:
        transformers' ``gate_up_proj``/``down_proj`` and SGLang's ``w13_*``/``w2_*`` (same bytes)."""
        p = ctx.parallel
        gate0, up0, down0 = projs["gate"][0], projs["up"][0], projs["down"][0]
        where = f"family {self.name}: {prefix}.experts.*.({suffix})"
        for proj, first in (("gate", gate0), ("up", up0), ("down", down0)):
            for e, src in projs[proj].items():
                if src.shape != first.shape or src.dtype != first.dtype:
                    raise LayoutError(f"{where}: expert {e} {proj} is {list(src.shape)} {src.dtype}, expert 0 is "
                                      f"{list(first.shape)} {first.dtype}")
        if gate0.shape != up0.shape or gate0.dtype != up0.dtype or gate0.dtype != down0.dtype:
            raise LayoutError(f"{where}: gate {list(gate0.shape)} {gate0.dtype}, up {list(up0.shape)} {up0.dtype} and "
                              f"down {down0.dtype} cannot be fused")
        if gate0.ndim == 0:
            raise LayoutError(f"{where}: per-tensor (0-d) expert tensors are not supported")
        w13_name, w2_name = self._expert_names(ctx, prefix, suffix)
        # gate/up: [I, ...] split on dim 0 (the intermediate dim) moe_tp ways.
        r0, r1 = split_range(gate0.shape[0], p.moe_tp_rank, p.moe_tp_size, f"{where} gate/up rows")
        rows, rest = r1 - r0, gate0.shape[1:]
        block = rows * math.prod(rest)
        w13_pieces = []
        for j, e in enumerate(local):
            for k, proj in enumerate(("gate", "up")):
                src = projs[proj][e]
                box = ((r0, r1),) + tuple((0, n) for n in rest)
                w13_pieces.append(Piece(src.name, box, (2 * j + k) * block))
        w13_shard = []
        if p.ep_size > 1:
            w13_shard.append(Split(0, p.ep_rank, p.ep_size))
        if p.moe_tp_size > 1:
            w13_shard.append(Split(1, p.moe_tp_rank, p.moe_tp_size, blocks=2))
        w13 = PlannedTensor(w13_name, gate0.dtype, (len(local), 2 * rows) + tuple(rest), "experts",
                            w13_pieces, tuple(w13_shard))
        # down: [H, I] split on dim 1 (1-D down tensors, e.g. a bias over H, are not split).
        w2_shard = [Split(0, p.ep_rank, p.ep_size)] if p.ep_size > 1 else []
        if down0.ndim >= 2:
            c0, c1 = split_range(down0.shape[1], p.moe_tp_rank, p.moe_tp_size, f"{where} down columns")
            if p.moe_tp_size > 1:
                w2_shard.append(Split(2, p.moe_tp_rank, p.moe_tp_size))
        else:
            c0, c1 = 0, 0
        w2_pieces, w2_shape = [], None
        for j, e in enumerate(local):
            src = projs["down"][e]
            box = list(full_box(src))
            if src.ndim >= 2:
                box[1] = (c0, c1)
            piece = Piece(src.name, tuple(box), 0)
            w2_pieces.append(Piece(src.name, piece.box, j * piece.numel))
            w2_shape = tuple(b - a for a, b in box)
        w2 = PlannedTensor(w2_name, down0.dtype, (len(local),) + w2_shape, "experts", w2_pieces, tuple(w2_shard))
        return [w13, w2]

    def _plan_fused_experts(self, ctx, m: re.Match, src: SourceTensor, local: range) -> PlannedTensor:
        """A checkpoint that already stores experts fused ([E, 2I, H] gate|up or [E, H, I] down)."""
        p = ctx.parallel
        kind, sfx = m.group("kind"), m.group("sfx")
        if ctx.target == "sglang":
            sglang_sfx = "weight" if not sfx else "weight" + sfx
            name = f"{m.group('prefix')}.experts.{'w13' if kind == 'gate_up_proj' else 'w2'}_{sglang_sfx}"
        else:
            name = self.rename(src.name, ctx.target)
        shard = [Split(0, p.ep_rank, p.ep_size)] if p.ep_size > 1 else []
        E, d1, d2 = src.shape
        pieces = []
        if kind == "gate_up_proj":
            inter = d1 // 2
            if d1 % 2:
                raise LayoutError(f"family {self.name}: {src.name} has odd gate|up dimension {d1}")
            r0, r1 = split_range(inter, p.moe_tp_rank, p.moe_tp_size, f"{src.name} intermediate")
            rows = r1 - r0
            for j, e in enumerate(local):
                for k in range(2):
                    pieces.append(Piece(src.name, ((e, e + 1), (k * inter + r0, k * inter + r1), (0, d2)),
                                        (2 * j + k) * rows * d2))
            shape = (len(local), 2 * rows, d2)
            if p.moe_tp_size > 1:
                shard.append(Split(1, p.moe_tp_rank, p.moe_tp_size, blocks=2))
        else:
            c0, c1 = split_range(d2, p.moe_tp_rank, p.moe_tp_size, f"{src.name} intermediate")
            for j, e in enumerate(local):
                pieces.append(Piece(src.name, ((e, e + 1), (0, d1), (c0, c1)), j * d1 * (c1 - c0)))
            shape = (len(local), d1, c1 - c0)
            if p.moe_tp_size > 1:
                shard.append(Split(2, p.moe_tp_rank, p.moe_tp_size))
        return PlannedTensor(name, src.dtype, shape, "experts", pieces, tuple(shard))

    # -------------------------------------------------------------------------- non-experts
    def tp_kind(self, name: str) -> str | None:
        for pattern, kind in self.tp_rules:
            if re.search(pattern, name):
                return kind
        return None

    def _head_split(self, ctx, src: SourceTensor, heads_key: str, replicate_ok: bool) -> Split:
        tp, r = ctx.parallel.tp_size, ctx.parallel.tp_rank
        heads = ctx.config.get(heads_key)
        if heads is None and heads_key == self.kv_heads_key:
            # transformers' default (Llama, Mistral, Qwen, Mixtral configs): no key, or null, means
            # one KV head per attention head; older configs (LLaMA-1 conversions) have none
            heads = ctx.config.get(self.heads_key)
        if not isinstance(heads, int) or heads < 1:
            raise LayoutError(f"family {self.name}: {src.name} is split by heads but config.json has no {heads_key}")
        if heads % tp == 0:
            return Split(0, r, tp)
        if replicate_ok and tp % heads == 0:
            # More ranks than KV heads: each head is replicated on tp/heads consecutive ranks.
            return Split(0, r // (tp // heads), heads)
        raise LayoutError(f"family {self.name}: {src.name}: {heads_key}={heads} does not split over tp={tp}")

    def _shard_non_expert(self, ctx, src: SourceTensor) -> tuple[tuple[tuple[int, int], ...], Split | None]:
        """The box of ``src`` this rank holds and the split it records (None: whole tensor)."""
        if ctx.parallel.tp_size == 1:
            return full_box(src), None
        kind = self.tp_kind(src.name)
        if kind is None:
            raise LayoutError(f"family {self.name}: no tensor-parallel rule for {src.name!r} "
                              f"(shape {list(src.shape)}); tp={ctx.parallel.tp_size} refused")
        split = None
        if kind == "q_heads" and src.ndim >= 1:
            split = self._head_split(ctx, src, self.heads_key, replicate_ok=False)
        elif kind == "kv_heads" and src.ndim >= 1:
            split = self._head_split(ctx, src, self.kv_heads_key, replicate_ok=True)
        elif kind == "column" and src.ndim >= 1:
            split = Split(0, ctx.parallel.tp_rank, ctx.parallel.tp_size)
        elif kind == "row" and src.ndim >= 2:
            split = Split(1, ctx.parallel.tp_rank, ctx.parallel.tp_size)
        box = list(full_box(src))
        if split is not None:
            box[split.dim] = split_range(src.shape[split.dim], split.index, split.count,
                                         f"family {self.name}: {src.name} dim {split.dim}")
        return tuple(box), split

    def _plan_non_experts(self, ctx, sources: list[SourceTensor]) -> list[PlannedTensor]:
        planned: dict[str, tuple[SourceTensor, PlannedTensor, Split | None]] = {}
        for src in sources:
            box, split = self._shard_non_expert(ctx, src)
            shape = tuple(b - a for a, b in box)
            t = PlannedTensor(self.rename(src.name, ctx.target), src.dtype, shape, "non_experts",
                              [Piece(src.name, box, 0)], (split,) if split else ())
            planned[src.name] = (src, t, split)
        if ctx.target == "sglang":
            return self._fuse_sglang(planned)
        return [t for _, t, _ in planned.values()]

    def _fuse_sglang(self, planned) -> list[PlannedTensor]:
        """Stack q|k|v and gate|up (dim 0) as SGLang's QKVParallelLinear/MergedColumnParallelLinear
        hold them, where every member is present; anything else stays as it is."""
        groups: dict[tuple[int, str], dict[str, str]] = {}
        for name in planned:
            for i, (pattern, members, fused_fmt) in enumerate(self.sglang_fusions):
                m = re.match(pattern, name)
                if m:
                    fused_name = fused_fmt.format(**m.groupdict())
                    groups.setdefault((i, fused_name), {})[m.group("p")] = name
                    break
        consumed: dict[str, PlannedTensor] = {}
        for (i, fused_name), by_member in groups.items():
            members = self.sglang_fusions[i][1]
            if set(by_member) != set(members):
                continue
            ts = [planned[by_member[mb]][1] for mb in members]
            first = ts[0]
            if any(t.dtype != first.dtype or t.shape[1:] != first.shape[1:] or not t.shape for t in ts):
                raise LayoutError(f"family {self.name}: cannot stack {', '.join(by_member[mb] for mb in members)} "
                                  f"into {fused_name}: shapes {[list(t.shape) for t in ts]}, dtypes "
                                  f"{sorted({t.dtype for t in ts})}")
            row_elems = math.prod(first.shape[1:])
            pieces, parts, row = [], [], 0
            for mb, t in zip(members, ts):
                piece = t.pieces[0]
                pieces.append(Piece(piece.source, piece.box, row * row_elems))
                parts.append(Part(by_member[mb], row, row + t.shape[0], t.shard))
                row += t.shape[0]
            fused = PlannedTensor(fused_name, first.dtype, (row,) + tuple(first.shape[1:]), "non_experts",
                                  pieces, (), tuple(parts))
            for mb in members:
                consumed[by_member[mb]] = fused
        out, emitted = [], set()
        for name, (_, t, _) in planned.items():
            f = consumed.get(name)
            if f is None:
                out.append(t)
            elif f.name not in emitted:
                emitted.add(f.name)
                out.append(f)
        return out


def layer_index(name: str) -> int | None:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None
