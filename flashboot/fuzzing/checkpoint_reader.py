"""Reader of a Hugging Face checkpoint's safetensors shard: bytes a user downloads from anywhere,
read by pre-pack (:func:`~flashboot.layouts.checkpoint.open_checkpoint`, then the shard's bytes
through :class:`~flashboot.layouts.checkpoint.ShardReader`, as pre-pack reads them).

The invariant is safetensors' own reading: a shard pre-pack accepts must be one safetensors
opens, with the same names, dtypes and shapes, and every tensor's bytes as pre-pack read them
equal to the tensor safetensors returns. A shard accepted here that safetensors refuses, or read
as other bytes, would be pre-packed into an image of weights no engine loads.
"""

from __future__ import annotations

import json
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
