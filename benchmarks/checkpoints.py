"""Synthetic MoE checkpoints for the load benchmark: A (few large tensors) and B (many small ones).

Both follow ``make_ckpt`` of ../shared/reference/probe_hw.py, the generator behind the baseline
figures in ../shared/hardware.md:

* A: 3,170 bf16 tensors, 13.76 GB in 4 safetensors files (16 layers x 64 experts x 3 of 4 MB,
  plus attention, norms, router, embeddings);
* B: 18,722 bf16 tensors, 11.76 GB in 8 files (48 layers x 128 experts x 3 of 0.5 MB, ...).

About the same bytes, 6x the tensors: per-tensor loaders slow down, one bulk copy does not.
``scale`` shrinks every matrix (both dimensions by ``sqrt(scale)``) and keeps the tensor count,
so tests can make the same structure in a few hundred kilobytes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace

from flashboot.errors import FlashBootError

MANIFEST = "flashboot-synthetic.json"
"""Written beside the shards: the spec, names, shapes and per-tensor checksums of the source."""


@dataclass(frozen=True)
class CheckpointSpec:
    """Shape of a synthetic MoE checkpoint. All sizes in elements; dtype bf16."""

    name: str
    layers: int
    experts: int
    expert_rows: int  # w1/w3 are (rows, cols), w2 is (cols, rows)
    expert_cols: int
    hidden: int
    vocab: int
    shards: int

    def __post_init__(self):
        for field in ("layers", "experts", "expert_rows", "expert_cols", "hidden", "vocab", "shards"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise FlashBootError(f"checkpoint {self.name}: {field} must be a positive int, got {value!r}")

    def scaled(self, scale: float) -> "CheckpointSpec":
        """The same structure (same tensor count) with about ``scale`` times the bytes."""
        if not (scale > 0):
            raise FlashBootError(f"scale must be positive, got {scale!r}")
        if scale == 1:
            return self
        f = math.sqrt(scale)

        def dim(d: int) -> int:  # multiples of 4 elements keep every bf16 tensor 8-byte sized
            return max(4, int(round(d * f / 4)) * 4)

        return replace(self, name=f"{self.name}@{scale:g}", expert_rows=dim(self.expert_rows),
                       expert_cols=dim(self.expert_cols), hidden=dim(self.hidden), vocab=dim(self.vocab))

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` in file order, the names transformers-style MoE checkpoints use."""
        h, r, c = self.hidden, self.expert_rows, self.expert_cols
        out: list[tuple[str, tuple[int, ...]]] = []
        for layer in range(self.layers):
            for e in range(self.experts):
                for w in ("w1", "w2", "w3"):
                    out.append((f"model.layers.{layer}.mlp.experts.{e}.{w}.weight", (c, r) if w == "w2" else (r, c)))
            for w, shape in (("self_attn.q_proj.weight", (2 * h, h)), ("self_attn.kv_proj.weight", (h // 2, h)),
                             ("self_attn.o_proj.weight", (h, 2 * h)), ("input_layernorm.weight", (h,)),
                             ("post_attention_layernorm.weight", (h,)), ("mlp.gate.weight", (self.experts, h))):
                out.append((f"model.layers.{layer}.{w}", shape))
        out.append(("model.embed_tokens.weight", (self.vocab, h)))
        out.append(("lm_head.weight", (self.vocab, h)))
        return out

    @property
    def tensor_count(self) -> int:
        return self.layers * (3 * self.experts + 6) + 2

    @property
    def nbytes(self) -> int:
        return sum(2 * math.prod(shape) for _, shape in self.tensors())


CHECKPOINT_A = CheckpointSpec("A", layers=16, experts=64, expert_rows=2048, expert_cols=1024, hidden=2048,
                              vocab=32000, shards=4)
"""3,170 tensors, 13.76 GB, 4 files."""

CHECKPOINT_B = CheckpointSpec("B", layers=48, experts=128, expert_rows=128, expert_cols=2048, hidden=2048,
                              vocab=32000, shards=8)
"""18,722 tensors, 11.76 GB, 8 files."""

CHECKPOINT_C = CheckpointSpec("C", layers=52, experts=256, expert_rows=64, expert_cols=384, hidden=1024,
                              vocab=32000, shards=8)
"""40,250 tensors, 2.61 GB, 8 files: the many-experts shape where per-tensor costs dominate."""

CHECKPOINTS = {"A": CHECKPOINT_A, "B": CHECKPOINT_B, "C": CHECKPOINT_C}


@dataclass
class SyntheticCheckpoint:
    """A generated checkpoint on disk: its directory, files and the source tensors' checksums."""

    root: str
    spec: CheckpointSpec
    files: list[str]
    nbytes: int
    tensor_count: int
    checksums: dict[str, int]  # name -> checksum of the tensor's bytes (flashboot.kernels.checksum)

    def expected_digest(self) -> int:
        """The digest :func:`tensors_digest` must return for a correct load of every tensor."""
        return combine_digests(self.checksums)


def combine_digests(checksums: dict[str, int]) -> int:
    """One 64-bit digest of a name -> checksum table. Each tensor's checksum is weighted by an odd
    number derived from its position in name order, so a swapped or renamed tensor changes it."""
    total = 0
    for i, name in enumerate(sorted(checksums)):
        total = (total + checksums[name] * (2 * i + 1)) & ((1 << 64) - 1)
    return total


_SMALL_HOST_BYTES = 1 << 20
"""Below this, host tensors are hashed by the numpy reference: numba's parallel loop costs ~1.6 ms
per call to start on two cores, which dominates 18,722 tiny tensors (same digest by definition)."""


def tensor_checksum(t) -> int:
    """Checksum of a tensor's bytes wherever it lives (GPU: Triton kernel; host: numba or numpy)."""
    import torch

    from flashboot.kernels.checksum import checksum
    from flashboot.kernels.checksum_spec import checksum_reference

    if not t.is_contiguous():
        t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    if raw.device.type == "cpu" and raw.numel() < _SMALL_HOST_BYTES:
        return int(checksum_reference(raw.numpy()))
    return int(checksum(raw))


def tensors_digest(tensors: dict) -> int:
    """:func:`combine_digests` over the checksums of loaded tensors (name -> torch tensor)."""
    return combine_digests({name: tensor_checksum(t) for name, t in tensors.items()})


def make_checkpoint(root: str, spec: CheckpointSpec, *, seed: int = 0, device: str | None = None,
                    progress=None) -> SyntheticCheckpoint:
    """Write ``spec`` as safetensors shards into ``root`` (plus config.json and a manifest).

    Values are standard-normal bf16 drawn on ``device`` (default: cuda:0 where present, else the
    CPU; the GPU draws 14 GB in seconds). One shard is in host memory at a time. If ``root``
    already holds a complete checkpoint of the same spec and seed, it is reused.
    """
    import torch
    from safetensors.torch import save_file

    existing = open_checkpoint(root)
    if existing is not None and existing.spec == spec and _manifest(root).get("seed") == seed:
        return existing
    if device is None:
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    os.makedirs(root, exist_ok=True)
    names = spec.tensors()
    per = -(-len(names) // spec.shards)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    files, checksums, total = [], {}, 0
    for s in range(spec.shards):
        part = {}
        for name, shape in names[s * per:(s + 1) * per]:
            t = torch.randn(shape, dtype=torch.bfloat16, device=device, generator=gen)
            checksums[name] = tensor_checksum(t)
            part[name] = t.cpu()
            total += t.numel() * 2
        path = os.path.join(root, f"model-{s + 1:05d}-of-{spec.shards:05d}.safetensors")
        save_file(part, path + ".tmp", metadata={"format": "pt"})
        os.replace(path + ".tmp", path)
        files.append(path)
        if progress is not None:
            progress(s + 1, spec.shards)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({"model_type": "flashboot_synthetic_moe", "torch_dtype": "bfloat16",
                   "num_hidden_layers": spec.layers, "num_experts": spec.experts, "hidden_size": spec.hidden,
                   "vocab_size": spec.vocab}, f, indent=1)
    manifest = {"spec": asdict(spec), "seed": seed, "files": [os.path.basename(p) for p in files],
                "nbytes": total, "tensor_count": len(names), "checksums": {k: f"{v:016x}" for k, v in checksums.items()}}
    tmp = os.path.join(root, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
    os.replace(tmp, os.path.join(root, MANIFEST))  # written last: its presence means complete
    return SyntheticCheckpoint(root, spec, files, total, len(names), checksums)


def make_small_image(root: str, shape: str, scale: float = 0.002) -> str:
    """Shape ``shape``'s checkpoint at ``scale`` of its bytes, its tensor count kept (what per-tensor
    costs such as the views depend on), drawn on the CPU into ``root/ckpt`` and pre-packed into
    ``root/img``; returns the image's directory. For probes of per-tensor costs."""
    import flashboot

    make_checkpoint(f"{root}/ckpt", CHECKPOINTS[shape].scaled(scale), device="cpu")
    flashboot.prepack(f"{root}/ckpt", f"{root}/img", progress=False)
    return f"{root}/img"


def _manifest(root: str) -> dict:
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def open_checkpoint(root: str) -> SyntheticCheckpoint | None:
    """The checkpoint previously written into ``root``, or None when there is none (or it is partial)."""
    m = _manifest(root)
    if not m:
        return None
    files = [os.path.join(root, n) for n in m["files"]]
    if not all(os.path.exists(p) for p in files):
        return None
    spec = CheckpointSpec(**m["spec"])
    return SyntheticCheckpoint(root, spec, files, m["nbytes"], m["tensor_count"],
                               {k: int(v, 16) for k, v in m["checksums"].items()})


__all__ = [
    "CheckpointSpec", "CHECKPOINT_A", "CHECKPOINT_B", "CHECKPOINT_C", "CHECKPOINTS", "SyntheticCheckpoint", "make_checkpoint", "make_small_image",
    "open_checkpoint", "combine_digests", "tensor_checksum", "tensors_digest",
]
