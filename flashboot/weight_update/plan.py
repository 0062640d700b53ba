"""The publish contract: a trainer's named tensors -> where each of their bytes goes in one
rank's image, by the same family rule and TP/EP slicing as pre-pack.

The trainer's tensors stand in for the checkpoint's safetensors headers: the image's family
plans the rank from their names, shapes and dtypes exactly as :func:`flashboot.prepack` planned
it from the checkpoint (:class:`~flashboot.layouts.families.base.PlanContext`, ``check_plan``,
``compute_layout``), and the layout that comes out must be the image's, tensor by tensor (name,
offset, shape, dtype). Anything else is refused before a byte is written, naming the tensor.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping

from ..errors import LayoutError


class PublishError(LayoutError):
    """Tensors that do not fit the image they are published for; names the tensor and both sides."""


@dataclass(frozen=True)
class PackPiece:
    """A box of trainer tensor ``source`` (one (start, stop) per dim) whose C-order bytes land at
    byte ``dst_offset`` of the image, back to back."""

    source: str
    box: tuple[tuple[int, int], ...]
    dst_offset: int
    itemsize: int


@dataclass(frozen=True)
class PackPlan:
    """One rank's image filled from a trainer's tensors: ``pieces`` in image order, the
    ``sources`` they read (name -> (dtype, shape)) and the image ``metadata`` (the contract)."""

    metadata: Any
    sources: dict[str, tuple[str, tuple[int, ...]]]
    pieces: tuple[PackPiece, ...]
    skipped: dict[str, str]
    aliases: dict[str, str] = field(default_factory=dict)
    """Names given that are another name of an image tensor (tied weights) -> that tensor's name:
    not packed; :func:`check_aliases` makes sure they are that tensor."""

    @property
    def nbytes(self) -> int:
        """Tensor bytes packed (padding excluded)."""
        return sum(math.prod(b - a for a, b in p.box) * p.itemsize for p in self.pieces)


def dtype_name(tensor: Any) -> str:
    """The image vocabulary's name of a torch tensor's dtype (``torch.bfloat16`` -> ``bfloat16``)."""
    return str(tensor.dtype).removeprefix("torch.")


def _config_for(metadata, config: Mapping[str, Any] | None, where: str) -> dict:
    """The model config the family plans with: ``config``, else the checkpoint's ``config.json``
    recorded at pre-pack; either must hash to the image key's ``config_hash``."""
    from flashboot.layouts.checkpoint import Checkpoint, read_config

    if config is None:
        path = Path(metadata.source.path) / "config.json"
        if not path.is_file():
            raise PublishError(f"{where}: the image was pre-packed from {metadata.source.path}, whose config.json is "
                               "not here; pass config= (the model's config as a dict)")
        try:
            config = read_config(path)
        except LayoutError as exc:
            raise PublishError(f"{where}: {exc}") from None
    if not isinstance(config, Mapping):  # a transformers config object had been a raw ValueError of dict()
        raise PublishError(f"{where}: config must be the model's config.json as a dict, got a {type(config).__name__} "
                           "(pass json.load of the config.json the image was pre-packed from)")
    found = Checkpoint(Path("."), dict(config), {}, []).config_hash
    if found != metadata.key.config_hash:
        # not always another model: PretrainedConfig.to_dict() adds every default to config.json's keys
        recorded, diff = Path(metadata.source.path) / "config.json", ""
        with contextlib.suppress(LayoutError):  # the hint only: the mismatch is the error
            packed = read_config(recorded)
            keys = sorted(k for k in set(packed) | set(config) if packed.get(k, ...) != config.get(k, ...))
            diff = f"; keys that differ from {recorded}: {keys[:8]}{' ...' if len(keys) > 8 else ''}"
        raise PublishError(f"{where}: the config given hashes to {found[:19]}, the image was pre-packed from "
                           f"{metadata.key.config_hash[:19]} (another model, or not the config.json it was "
                           f"pre-packed from{diff})")
    return dict(config)


def plan_pack(metadata, headers: Mapping[str, tuple[str, tuple[int, ...]]], *,
              config: Mapping[str, Any] | None = None, where: str = "publish") -> PackPlan:
    """Plan packing tensors with ``headers`` (name -> (dtype name, shape)) into the image of
    ``metadata`` (an :class:`~flashboot.layouts.ImageMetadata`).

    Raises PublishError naming the tensor for a name the image lacks, a shape or dtype that
    differs from the image's, or an image tensor no given tensor fills; LayoutError from the
    family for a layout it cannot produce (indivisible shapes, missing experts).
    """
    from flashboot.layouts.checkpoint import SourceTensor
    from flashboot.layouts.families import PlanContext, check_plan, get_family
    from flashboot.layouts.format import DTYPES, compute_layout

    cfg = _config_for(metadata, config, where)
    sources = {}
    for name, (dtype, shape) in headers.items():
        if dtype not in DTYPES:
            raise PublishError(f"{where}: tensor {name!r} is {dtype}, which no image holds "
                               f"(supported: {', '.join(DTYPES)})")
        shape = tuple(int(s) for s in shape)
        sources[name] = SourceTensor(name, "<trainer>", dtype, shape, 0, math.prod(shape) * DTYPES[dtype].itemsize)
    family = get_family(metadata.family.name)
    try:
        plan = family.plan(PlanContext(cfg, sources, metadata.parallel, metadata.target))
        check_plan(plan, sources, family.name)
    except LayoutError as exc:
        raise PublishError(f"{where}: {exc}") from None
    image = metadata.tensors
    # in the image's order: a family that plans in source order (generic) would otherwise lay the
    # trainer's tensors out in the order given, not the checkpoint's, and refuse every offset
    # (an empty tensor shares its offset with the next one, placed after it: empty ones first)
    at = dict(zip(image.names, zip(image.offsets.tolist(), image.nbytes.tolist())))
    planned = sorted(plan.tensors, key=lambda t: at.get(t.name, (metadata.image_nbytes, 0)))
    layout = compute_layout([t.slot() for t in planned], tensor_alignment=metadata.tensor_alignment)
    feeds = {t.name: sorted({p.source for p in t.pieces}) for t in plan.tensors}
    extra = [t.name for t in plan.tensors if t.name not in image]
    if extra:
        names = sorted({s for n in extra for s in feeds[n]})
        raise PublishError(f"{where}: tensor(s) {', '.join(map(repr, names[:5]))}{' ...' if len(names) > 5 else ''} "
                           f"are not in the manifest of {metadata.key.model_id} rank {metadata.parallel.rank} "
                           f"(they would make image tensor {extra[0]!r}); nothing was written")
    for t in plan.tensors:
        want, got = image[t.name], layout.tensors[t.name]
        if (want.dtype, tuple(want.shape)) != (got.dtype, tuple(got.shape)):
            raise PublishError(f"{where}: tensor {t.name!r} (from {', '.join(map(repr, feeds[t.name]))}) is "
                               f"{got.dtype} {list(got.shape)} from the tensors given, {want.dtype} "
                               f"{list(want.shape)} in the image; nothing was written")
    missing = [n for n in image.names if n not in layout.tensors]
    if missing:
        raise PublishError(f"{where}: image tensor(s) {', '.join(map(repr, missing[:5]))}"
                           f"{' ...' if len(missing) > 5 else ''} get no bytes: their source tensors are missing "
                           f"from the {len(sources)} tensors given; nothing was written")
    for t in plan.tensors:  # same names, shapes and dtypes, so the same offsets; checked, being the contract
        if image[t.name].offset != layout.tensors[t.name].offset:
            raise PublishError(f"{where}: tensor {t.name!r} lands at offset {layout.tensors[t.name].offset:,}, the "
                               f"image has it at {image[t.name].offset:,}; nothing was written")
    pieces = []
    for t in planned:  # PackPlan.pieces are in image order
        entry = image[t.name]
        itemsize = DTYPES[t.dtype].itemsize
        pieces += [PackPiece(p.source, p.box, entry.offset + p.dst_elem * itemsize, itemsize)
                   for p in t.pieces if p.numel]
    used = {p.source for t in plan.tensors for p in t.pieces}  # an empty tensor's too: it has no bytes to pack
    unused = [n for n in sources if n not in used and n not in plan.skipped]
    if unused:  # another rank's slice (an expert it holds) is no stranger: ask every rank's plan
        for other in type(metadata.parallel).all_ranks(metadata.parallel.tp_size, metadata.parallel.ep_size):
            if other.rank != metadata.parallel.rank and unused:
                theirs = family.plan(PlanContext(cfg, sources, other, metadata.target))
                used_there = {p.source for t in theirs.tensors for p in t.pieces}
                unused = [n for n in unused if n not in used_there]
    if unused:
        raise PublishError(f"{where}: tensor {unused[0]!r} is not in the manifest of {metadata.key.model_id} rank "
                           f"{metadata.parallel.rank} ({len(unused)} such); nothing was written")
    return PackPlan(metadata, {n: (s.dtype, s.shape) for n, s in sources.items()}, tuple(pieces), dict(plan.skipped))


def _c_order(shape, stride) -> bool:
    """Whether a tensor of ``shape`` and element ``stride`` is laid out in C order (size-1 dims aside)."""
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


DERIVED = "derived by the engine's post-processing after the copy"
"""``PackPlan.skipped`` reason of an engine image's tensor attribute left to the engine."""


def plan_engine_pack(metadata, headers: Mapping[str, tuple[str, tuple[int, ...]]], aliases: Mapping[str, str],
                     derived: Collection[str] = (), *, raw: Mapping[str, Mapping[str, Any]] | None = None,
                     where: str = "publish") -> PackPlan:
    """Plan packing tensors with ``headers`` (name -> (dtype name, shape)) into an engine image
    (:mod:`flashboot.integrations.engine_dump`: an engine's own post-processed tensors, named as
    the engine names them). No family rule re-plans them (the engine did, before the dump): each
    tensor is given whole, by the image's name, dtype and shape. ``aliases`` (another name of an
    image tensor -> that tensor: tied weights, shared rotary caches) are accepted when their dtype
    and shape are that tensor's, and not packed (``PackPlan.aliases``: :func:`check_aliases`
    checks they are that tensor). ``raw``: the engine section's record of tensors the image
    stores as bytes (a dtype the image format does not name, e.g. float8_e8m0fnu scales): name ->
    the engine's ``dtype``, ``shape``, ``stride``; such a tensor is given in the engine's dtype and
    shape and packed byte for byte.

    Raises PublishError naming the tensor for a name the image lacks, another dtype or shape, an
    image tensor stored strided (its bytes are the engine's layout, not a C-order tensor), or a
    non-empty image tensor no given tensor fills, unless it is in ``derived`` (tensor attributes
    the engine's post-processing derives from the others, MLA's ``w_kc``: left out, they are in
    ``skipped`` and the engine derives them after the copy)."""
    import torch

    from flashboot.layouts.format import DTYPES

    image = metadata.tensors
    raw = dict(raw or {})
    model = f"{metadata.key.model_id} rank {metadata.parallel.rank}"

    def engine_view(name: str) -> tuple[str, tuple[int, ...], tuple[int, ...], int]:
        """(dtype, shape, stride, itemsize) of image tensor ``name`` as the engine holds it."""
        entry, info = image[name], raw.get(name)
        if info is None:
            return entry.dtype, tuple(entry.shape), tuple(entry.stride), DTYPES[entry.dtype].itemsize
        dtype = getattr(torch, str(info["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise PublishError(f"{where}: image tensor {name!r} is {info['dtype']}, which this torch does not have")
        return str(info["dtype"]), tuple(info["shape"]), tuple(info["stride"]), dtype.itemsize

    pieces, skipped, given_aliases = [], {}, {}
    for name, (dtype, shape) in headers.items():
        shape = tuple(int(s) for s in shape)
        if name not in image:
            if name in aliases:
                want_dtype, want_shape = engine_view(aliases[name])[:2]
                if (dtype, shape) != (want_dtype, want_shape):
                    raise PublishError(f"{where}: tensor {name!r} is {dtype} {list(shape)} from the tensors given; in "
                                       f"the image it is another name of {aliases[name]!r}, {want_dtype} "
                                       f"{list(want_shape)} (tied when pre-packed, not in the tensors given); "
                                       "nothing was written")
                skipped[name] = f"another name of image tensor {aliases[name]!r}"
                given_aliases[name] = aliases[name]
                continue
            raise PublishError(f"{where}: tensor {name!r} is not in the manifest of {model} (an engine image: "
                               "tensors are named as the engine names them); nothing was written")
        entry = image[name]
        want_dtype, want_shape, want_stride, itemsize = engine_view(name)
        as_bytes = name in raw and (dtype, shape) == (entry.dtype, tuple(entry.shape))  # its bytes, given as stored
        if as_bytes:
            want_shape, want_stride, itemsize = tuple(entry.shape), tuple(entry.stride), DTYPES[entry.dtype].itemsize
        elif (dtype, shape) != (want_dtype, want_shape):
            raise PublishError(f"{where}: tensor {name!r} is {dtype} {list(shape)} from the tensors given, "
                               f"{want_dtype} {list(want_shape)} in the image; nothing was written")
        if entry.numel and not _c_order(want_shape, want_stride):
            raise PublishError(f"{where}: image tensor {name!r} is stored strided (shape {list(want_shape)}, stride "
                               f"{list(want_stride)}): publish fills C-order tensors only; nothing was written")
        if entry.numel:
            pieces.append(PackPiece(name, tuple((0, s) for s in shape), entry.offset, itemsize))
    derived = set(derived)
    for n in image.names:
        if n in derived and n not in headers and image[n].numel:
            skipped[n] = DERIVED
    missing = [n for n in image.names if n not in headers and n not in skipped and image[n].numel]
    if missing:
        twin = {c: a for a, c in given_aliases.items()}  # a trainer's dict names a tied tensor by its other name
        tied = [f"; {twin[n]!r}, given, is another name of {n!r}: give it as {n!r}" for n in missing if n in twin]
        raise PublishError(f"{where}: image tensor(s) {', '.join(map(repr, missing[:5]))}"
                           f"{' ...' if len(missing) > 5 else ''} get no bytes: they are missing from the "
                           f"{len(headers)} tensors given (an engine image is published whole: parameters and "
                           f"buffers){tied[0] if tied else ''}; nothing was written")
    pieces.sort(key=lambda p: p.dst_offset)
    sources = {n: (d, tuple(int(s) for s in shape)) for n, (d, shape) in headers.items() if n not in skipped}
    return PackPlan(metadata, sources, tuple(pieces), skipped, given_aliases)


def check_aliases(plan: PackPlan, tensors: Mapping[str, Any], where: str = "publish") -> None:
    """Every alias given (``plan.aliases``) is its image tensor: the same tensor (one storage, one
    layout) or equal to it. Anything else is an untied copy the image cannot hold: PublishError."""
    import torch

    for alias, canonical in plan.aliases.items():
        a, c = tensors[alias], tensors.get(canonical)
        if c is None or a is c:
            continue  # its canonical tensor's absence is the plan's "get no bytes"
        same = (a.device == c.device and a.data_ptr() == c.data_ptr() and a.stride() == c.stride()
                and a.shape == c.shape and a.dtype == c.dtype)
        if not same and (a.device != c.device or a.shape != c.shape or a.dtype != c.dtype or not torch.equal(a, c)):
            raise PublishError(f"{where}: tensor {alias!r} is another name of image tensor {canonical!r} (tied when "
                               f"pre-packed), but the tensors given differ: an untied {alias!r} has no place in this "
                               "image; nothing was written")


def box_runs(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, box, src_addr: int,
             dst_offset: int, what: str) -> list[tuple[int, int, int, int, int]]:
    """A box of a strided tensor (element ``strides``) at ``src_addr`` as table rows
    ``(dst_offset, src_addr, nbytes, run_bytes, src_run_stride)``: each row is ``nbytes //
    run_bytes`` runs of ``run_bytes`` read every ``src_run_stride`` bytes and written back to back.

    Inner dimensions the box covers whole and the tensor stores contiguously merge into one run,
    the next one out strides; any further outer ones become rows of their own (a 3-D slice).
    PublishError for a tensor whose last dimension is not contiguous (``what`` names it)."""
    from itertools import product

    nd = len(shape)
    if nd == 0:
        return [(dst_offset, src_addr, itemsize, itemsize, itemsize)]
    if strides[-1] != 1 and shape[-1] > 1:
        raise PublishError(f"{what}: its last dimension has stride {strides[-1]}, not 1; pass it .contiguous()")
    # a dim of size 1 is only ever read at index 0: its stride is any number torch kept (a column
    # viewed as (n, 1) has strides (10, 10)); as the C-order one it merges right, as is it merged wrong
    strides = list(strides)
    for j in reversed(range(nd)):
        if shape[j] == 1:
            strides[j] = shape[j + 1] * strides[j + 1] if j + 1 < nd else 1
    k = nd - 1
    while k > 0 and tuple(box[k]) == (0, shape[k]) and strides[k - 1] == shape[k] * strides[k]:
        k -= 1
    run_bytes = math.prod(b - a for a, b in box[k:]) * itemsize
    if run_bytes == 0:
        return []
    if k == 0:
        return [(dst_offset, src_addr + box[0][0] * strides[0] * itemsize, run_bytes, run_bytes, run_bytes)]
    r = k - 1
    n_runs = box[r][1] - box[r][0]
    nbytes = n_runs * run_bytes
    inner = sum(box[j][0] * strides[j] for j in range(r, nd)) * itemsize
    rows = []
    for i, outer in enumerate(product(*(range(a, b) for a, b in box[:r]))):
        src = src_addr + inner + sum(o * s for o, s in zip(outer, strides)) * itemsize
        if n_runs == 1:
            rows.append((dst_offset + i * nbytes, src, nbytes, nbytes, nbytes))
        else:
            rows.append((dst_offset + i * nbytes, src, nbytes, run_bytes, strides[r] * itemsize))
    return rows


__all__ = ["DERIVED", "PackPiece", "PackPlan", "PublishError", "box_runs", "check_aliases", "dtype_name",
           "plan_engine_pack", "plan_pack"]
