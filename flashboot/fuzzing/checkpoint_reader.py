"""Readers of a Hugging Face checkpoint, bytes a user downloads from anywhere, as pre-pack reads
them (:func:`~flashboot.layouts.checkpoint.open_checkpoint`):

* a safetensors shard, then its bytes through :class:`~flashboot.layouts.checkpoint.ShardReader`.
  The invariant is safetensors' own reading: a shard pre-pack accepts must be one safetensors
  opens, with the same names, dtypes and shapes, and every tensor's bytes as pre-pack read them
  equal to the tensor safetensors returns (else an image of weights no engine loads);
* the shard index (``model.safetensors.index.json``) of a two-shard checkpoint. The invariant:
  an accepted checkpoint reads exactly the shards the index names (inside the checkpoint), holds
  every tensor of those shards as their headers list it, and each tensor the index maps is in
  the shard it names.
"""

from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path

from .campaign import LeakProbe, Reader
from .mutate import mutate_bytes, mutate_document

SHARD = "model.safetensors"


def _seed_shard() -> bytes:
    """A small shard of the dtypes and shapes checkpoints hold: matrices, a bias, a scalar, an
    empty tensor, bf16 / int8 / bool, and ``__metadata__``."""
    import torch
    from safetensors.torch import save

    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(4, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.bias": torch.randn(4, generator=g).to(torch.float16),
        "model.embed_tokens.weight": torch.randint(-128, 127, (6, 4), generator=g, dtype=torch.int8),
        "model.mask": torch.tensor([True, False, True]),
        "model.scale": torch.tensor(0.5),
        "model.empty": torch.zeros(0, 4),
    }
    return save(tensors, metadata={"format": "pt"})


def _split(data: bytes) -> tuple[bytes, bytes] | None:
    if len(data) < 8:
        return None
    n = struct.unpack("<Q", data[:8])[0]
    return (data[8:8 + n], data[8 + n:]) if n <= len(data) - 8 else None


def mutate_shard(seed: bytes, rng: random.Random) -> bytes:
    """Mostly the header's JSON mutated and its length prefix kept true (what gets past the first
    check), sometimes the prefix or the data changed too, sometimes plain byte-level damage."""
    parts = _split(seed)
    r = rng.random()
    if parts is None or r < 0.15:
        return mutate_bytes(seed, rng)
    header, body = parts
    header = mutate_document(header, rng)
    if r > 0.9:
        body = mutate_bytes(body, rng) if body else body
    prefix = len(header)
    if 0.85 < r <= 0.9:
        prefix = rng.choice((0, 1, prefix - 1, prefix + 1, prefix + 8, len(header) + len(body), 1 << 40))
    return struct.pack("<Q", prefix & ((1 << 64) - 1)) + header + body


def checkpoint_reader(work: Path) -> Reader:
    from flashboot.layouts.checkpoint import ShardReader, open_checkpoint, plan_reads

    ckpt_dir = work / "checkpoint"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    shard = ckpt_dir / SHARD

    def feed(data: bytes):
        shard.write_bytes(data)
        ckpt = open_checkpoint(ckpt_dir)
        names = sorted(ckpt.tensors, key=lambda n: (ckpt.tensors[n].file, ckpt.tensors[n].data_start))
        read = {}
        with ShardReader(ckpt_dir, "buffered", expect=ckpt.identities) as reader:
            for batch in plan_reads(ckpt, names):
                buf = reader.read(batch)
                for name in batch.names:
                    t = ckpt.tensors[name]
                    read[name] = bytes(buf[t.data_start - batch.start:t.data_start - batch.start + t.nbytes])
            reader.check_unchanged()
        return ckpt, read

    def check(parsed, data: bytes) -> str | None:
        import torch
        from safetensors import safe_open

        ckpt, read = parsed
        try:
            with safe_open(str(shard), framework="pt") as f:
                theirs = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:  # noqa: BLE001 - safetensors' own refusal is the finding
            return f"pre-pack accepted a shard safetensors refuses: {type(exc).__name__}: {str(exc)[:200]}"
        if set(theirs) != set(ckpt.tensors):
            return f"names differ: pre-pack {sorted(ckpt.tensors)[:5]}, safetensors {sorted(theirs)[:5]}"
        for name, t in theirs.items():
            src = ckpt.tensors[name]
            if tuple(t.shape) != src.shape:
                return f"{name!r}: shape {src.shape}, safetensors {tuple(t.shape)}"
            ours = read[name]
            raw = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
            if ours != raw:
                return f"{name!r}: {len(ours)} bytes read differ from safetensors' {len(raw)}"
        return None

    return Reader("checkpoint shard (open_checkpoint + reads)", [_seed_shard()], feed, check, mutate_shard,
                  LeakProbe(str(ckpt_dir)))


def index_reader(work: Path) -> Reader:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from flashboot.layouts.checkpoint import open_checkpoint

    ckpt_dir = work / "checkpoint-index"
    (ckpt_dir / "sub").mkdir(parents=True, exist_ok=True)
    (ckpt_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    shards = {"model-00001-of-00002.safetensors": ("a.weight", "a.bias"),
              "sub/model-00002-of-00002.safetensors": ("b.weight", "c")}
    import torch

    for fname, names in shards.items():
        save_file({n: torch.full((2, 3), float(i)) for i, n in enumerate(names)}, str(ckpt_dir / fname))
    headers = {}
    for fname in shards:
        with safe_open(str(ckpt_dir / fname), framework="pt") as f:
            headers[os.path.normpath(fname)] = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    weight_map = {n: fname for fname, names in shards.items() for n in names}
    seed = json.dumps({"metadata": {"total_size": 96}, "weight_map": weight_map}).encode()
    index = ckpt_dir / "model.safetensors.index.json"
    root = ckpt_dir.resolve()

    def feed(data: bytes):
        index.write_bytes(data)
        return open_checkpoint(ckpt_dir), json.loads(data)

    def check(parsed, data: bytes) -> str | None:
        ckpt, doc = parsed
        named = sorted({os.path.normpath(v) for v in doc["weight_map"].values()})
        if sorted(ckpt.files) != named:
            return f"read shards {ckpt.files}, the index names {named}"
        for fname in named:
            if root not in (ckpt_dir / fname).resolve().parents:
                return f"read shard {fname!r}, outside the checkpoint"
        want = {n: shape for fname in named for n, shape in headers.get(fname, {}).items()}
        have = {n: t.shape for n, t in ckpt.tensors.items()}
        if have != want:
            return f"tensors {sorted(have)} differ from the named shards' headers {sorted(want)}"
        for name, fname in doc["weight_map"].items():
            if ckpt.tensors[name].file != os.path.normpath(fname):
                return f"{name!r} read from {ckpt.tensors[name].file}, the index maps it to {fname}"
        return None

    return Reader("checkpoint index (open_checkpoint)", [seed], feed, check, leaks=LeakProbe(str(ckpt_dir)))
