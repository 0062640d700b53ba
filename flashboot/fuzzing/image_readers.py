"""Readers of image files: ``metadata.json``, an image directory, a lone rank, ``prepack.json``,
``.ready``; and the tiny Qwen3-MoE image they start from."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path

from .campaign import LeakProbe, Reader
from .mutate import mutate_document


def fuzz_work_dir() -> Path:
    """A fresh working directory, in /dev/shm where there is one: the readers rewrite a file per
    input, 3-5x slower on a disk-backed /tmp (measured: 2.1 s vs 0.35 s per 1,000 .ready files)."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="flashboot-fuzz-", dir=shm if shm.is_dir() else None))


def make_seed_image(root: str | os.PathLike) -> Path:
    """A tiny Qwen3-MoE pre-pack (tp=2, ep=2, SGLang target: shards, parts, experts), 4 KiB chunks."""
    from flashboot.flashload.prepack import prepack
    from flashboot.layouts.tiny import save_tiny_model

    root = Path(root)
    ckpt = root / "qwen3-moe"
    if not (ckpt / "config.json").is_file():
        save_tiny_model("qwen3_moe", ckpt, seed=0)
    out = root / "image"
    if not (out / "prepack.json").is_file():
        prepack(ckpt, out, tp=2, ep=2, target="sglang", chunk_bytes=4096, progress=False)
    return out


# ----------------------------------------------------------------- metadata.json, the parser
def _independent_metadata_check(meta) -> str | None:
    """The FORMAT.md invariants of a parsed metadata, recomputed in plain Python (not the reader's
    numpy columns): a parsed table that breaks one was accepted wrongly."""
    from flashboot.layouts.format import DTYPES, REGIONS

    n = meta.image_nbytes
    if n % 4096 or n > 1 << 56:
        return f"image size {n}"
    regions = meta.regions
    if regions["experts"].offset != 0 or regions["experts"].end != regions["non_experts"].offset \
            or regions["non_experts"].end != n:
        return "regions do not tile the image"
    spans = []
    for name, t in meta.tensors.items():
        if t.dtype not in DTYPES or t.region not in REGIONS:
            return f"tensor {name}: dtype {t.dtype} region {t.region}"
        if len(t.shape) != len(t.stride) or any(type(v) is not int or v < 0 for v in t.shape + t.stride):
            return f"tensor {name}: shape {t.shape} stride {t.stride}"
        span = 0 if 0 in t.shape else (1 + sum((a - 1) * s for a, s in zip(t.shape, t.stride))) * DTYPES[t.dtype].itemsize
        if span != t.nbytes:
            return f"tensor {name}: nbytes {t.nbytes} but span {span}"
        r = regions[t.region]
        if t.offset % 256 or (span and not r.offset <= t.offset <= t.offset + span <= r.end):
            return f"tensor {name}: bytes {t.offset}..{t.offset + span} outside {t.region} {r.offset}..{r.end}"
        for s in t.shard:
            if s.dim >= len(t.shape) or not 0 <= s.index < s.count:
                return f"tensor {name}: shard {s}"
        for p in t.parts:
            if not t.shape or not 0 <= p.start <= p.stop <= t.shape[0]:
                return f"tensor {name}: part {p.name} rows {p.start}..{p.stop}"
        if span:
            spans.append((t.offset, t.offset + span, name))
    spans.sort()
    for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
        if b0 < a1:
            return f"tensors {a} and {b} overlap"
    if len(meta.checksums.digests) != -(-n // meta.checksums.chunk_bytes):
        return "checksum table does not cover the image"
    p, e = meta.parallel, meta.experts
    if e is not None and (e.num_experts != e.local_count * p.ep_size or e.local_start != p.ep_rank * e.local_count):
        return (f"experts num_experts {e.num_experts}, local {e.local_start}+{e.local_count} disagree with ep_rank "
                f"{p.ep_rank} of ep={p.ep_size}")
    for w in meta.warnings:
        if not isinstance(w, str):
            return f"warning {w!r} is not a string"
    return None


def metadata_reader(image_dir: Path) -> Reader:
    """``parse_metadata`` (the strict reader of ``metadata.json``) on mutated bytes."""
    from flashboot.layouts.format import parse_metadata

    seeds = [p.read_bytes() for p in sorted(image_dir.glob("rank-*/metadata.json"))]
    return Reader("metadata.json", seeds, lambda data: parse_metadata(data, "fuzz/metadata.json"),
                  lambda meta, data: _independent_metadata_check(meta))


# ----------------------------------------------------------------- an image directory
def _fresh_copy(src: Path, dst: Path) -> Path:
    """``dst`` as a copy of ``src`` (a copy left by an earlier campaign may hold a mutated file)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


class _ImageDir:
    """A private copy of the seed image whose files a reader's inputs overwrite."""

    def __init__(self, image_dir: Path, work: Path):
        self.dir = _fresh_copy(image_dir, work / "image")
        self.original = {p: p.read_bytes() for p in self.dir.rglob("*.json")}
        self.image_sizes = {p: p.stat().st_size for p in self.dir.rglob("image.bin")}

    def restore(self, path: Path | None = None) -> None:
        """Put back ``path`` (default: every JSON file) and every image's size."""
        for p, b in self.original.items():
            if path is None or p == path:
                p.write_bytes(b)
        for p, n in self.image_sizes.items():
            if p.stat().st_size != n:
                os.truncate(p, n)


def _check_image(image, original_sha: str | None) -> str | None:
    """Views of every tensor inside the image's mapping, closed without a leak."""
    meta = image.metadata
    problem = _independent_metadata_check(meta)
    if problem:
        return problem
    if original_sha is not None and image.metadata_sha256 != original_sha:
        return f"metadata.json edited (sha256 {image.metadata_sha256[:12]}, pre-pack wrote {original_sha[:12]}) but read"
    if meta.image_nbytes:
        buf = image.mmap()
        import torch

        base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
        for name, t in meta.tensors.items():
            v = image.view(name)
            if t.nbytes and not (base <= v.data_ptr() and v.data_ptr() + t.nbytes <= base + meta.image_nbytes):
                return f"view of {name} reaches outside the image"
            del v
    return None


def image_reader(image_dir: Path, work: Path) -> Reader:
    """``read_image`` of a job directory whose ``metadata.json`` (of rank 0 or 1) or ``image.bin``
    size was changed after the pre-pack: refused (digest, size) or read with every view in bounds."""
    from flashboot.layouts.image import read_image

    d = _ImageDir(image_dir, work)
    metas = sorted(d.dir.glob("rank-*/metadata.json"))
    seeds = [bytes([i]) + bytes(8) + m.read_bytes() for i, m in enumerate(metas)]
    originals = [hashlib.sha256(m.read_bytes()).hexdigest() for m in metas]
    state: dict = {}

    def mutate(seed: bytes, rng: random.Random) -> bytes:
        rank, body = seed[0], seed[9:]
        size = 0
        if rng.random() < 0.15:  # an image.bin of another size (metadata intact)
            size = rng.choice((1, 4095, 4096, 8192, 1 << 20)) * rng.choice((1, -1))
        elif rng.random() < 0.9:
            body = mutate_document(body, rng)
        return bytes([rank]) + size.to_bytes(8, "little", signed=True) + body

    def feed(data: bytes):
        data = data.ljust(9, b"\0")  # any bytes (atheris): rank byte, size change, metadata
        rank, size, body = data[0] % 2, int.from_bytes(data[1:9], "little", signed=True), data[9:]
        size = max(-(1 << 30), min(size, 1 << 30))
        d.restore(metas[1 - rank])
        metas[rank].write_bytes(body)
        if size:
            img = metas[rank].parent / "image.bin"
            os.truncate(img, max(0, d.image_sizes[img] + size))
        state["sha"] = originals[rank]
        return read_image(d.dir, rank)

    def check(image, data: bytes) -> str | None:
        try:
            return _check_image(image, state["sha"])
        finally:
            image.close()

    return Reader("image dir (read_image)", seeds, feed, check, mutate, LeakProbe(str(d.dir)))


def lone_rank_reader(image_dir: Path, work: Path) -> Reader:
    """``read_image`` of a lone rank directory (no ``prepack.json`` above it): no digest to
    check against, so the strict reader alone stands between the bytes and the views."""
    from flashboot.layouts.image import read_image

    lone = work / "lone"
    _fresh_copy(image_dir / "rank-1", lone / "rank-1")
    meta_path, img = lone / "rank-1" / "metadata.json", lone / "rank-1" / "image.bin"
    original, size0 = meta_path.read_bytes(), img.stat().st_size

    def feed(data: bytes):
        meta_path.write_bytes(data)
        if img.stat().st_size != size0:
            os.truncate(img, size0)
        return read_image(lone / "rank-1")

    def check(image, data: bytes) -> str | None:
        try:
            return _check_image(image, None)
        finally:
            image.close()

    return Reader("lone rank dir (read_image)", [original], feed, check, leaks=LeakProbe(str(lone)))


def job_reader(image_dir: Path, work: Path) -> Reader:
    """``read_job`` + ``read_image`` of a job directory whose ``prepack.json`` was changed."""
    from flashboot.layouts.image import read_image

    d = _ImageDir(image_dir, work / "job")
    job_path = d.dir / "prepack.json"
    original = job_path.read_bytes()

    def feed(data: bytes):
        job_path.write_bytes(data)
        return [read_image(d.dir, r) for r in (0, 1)]

    def check(images, data: bytes) -> str | None:
        try:
            job = json.loads(data)
            for im in images:
                rec = next(r for r in job["ranks"] if r["rank"] == im.rank)
                if rec.get("metadata_sha256") != im.metadata_sha256:
                    return f"rank {im.rank} read, but prepack.json records another metadata digest"
            return None
        finally:
            for im in images:
                im.close()

    return Reader("prepack.json (read_job)", [original], feed, check)


# ----------------------------------------------------------------- .ready
def ready_reader(work: Path) -> Reader:
    """``read_ready`` of a mutated ``.ready`` file."""
    from flashboot.flashload.shm import READY_FORMAT, ReadyInfo, read_ready

    path = work / "rank-0.ready"
    seed = {"format": READY_FORMAT, "rank": 0, "nbytes": 1 << 20, "staged": str(work / "rank-0.img"),
            "source": str(work / "image.bin"), "metadata_sha256": "ab" * 32, "job_id": "cd" * 16,
            "key_digest": "sha256:" + "ef" * 32, "checksum": {"chunks": 16, "chunk_bytes": 65536,
                                                              "fingerprint": "0123456789abcdef"},
            "verified": False, "io_mode": "direct", "io_reason": "", "numa_node": 0, "numa_reason": "",
            "threads": 4, "read_s": 0.01, "staged_at": 1.7e9, "pid": 1234}

    def feed(data: bytes):
        path.write_bytes(data)
        return read_ready(path)

    def check(info: ReadyInfo, data: bytes) -> str | None:
        ints = {"rank": 0, "nbytes": 0, "threads": 1, "pid": 0}
        for name, minimum in ints.items():
            v = getattr(info, name)
            if type(v) is not int or v < minimum:
                return f"{name} {v!r}"
        for name in ("staged", "source", "job_id", "key_digest", "io_mode", "io_reason", "numa_reason"):
            if type(getattr(info, name)) is not str:
                return f"{name} {getattr(info, name)!r}"
        sha = info.metadata_sha256
        if type(sha) is not str or len(sha) != 64 or any(ch not in "0123456789abcdef" for ch in sha):
            return f"metadata_sha256 {sha!r}"
        if type(info.verified) is not bool or not isinstance(info.checksum, dict):
            return f"verified {info.verified!r} checksum {info.checksum!r}"
        if info.numa_node is not None and (type(info.numa_node) is not int or info.numa_node < 0):
            return f"numa_node {info.numa_node!r}"
        for name in ("read_s", "staged_at"):
            v = getattr(info, name)
            if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
                return f"{name} {v!r}"
        return None

    return Reader(".ready (read_ready)", [json.dumps(seed).encode()], feed, check)


# ----------------------------------------------------------------- rendezvous records, manifests, descriptors
