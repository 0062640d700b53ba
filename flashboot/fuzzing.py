"""Fuzzing the trust boundaries: seeded mutation campaigns over every reader of outside bytes.

Each :class:`Reader` takes one kind of outside input (``metadata.json``, ``prepack.json``, an
image directory, a ``.ready`` file, a rendezvous record, a manifest, an arena descriptor, a
preloader request with its fds), starts from real seeds (a tiny Qwen3-MoE pre-pack, a real
arena, a real preloader) and is fed mutations of them. The contract, checked on every input:

* it parses into a valid object (``parsed``; then the reader's own invariants are checked again,
  independently of the reader: an object that breaks one is ``wrong``), or
* it is refused with a :class:`~flashboot.errors.FlashBootError` (``refused``);
* anything else is a ``crash``: another exception, an fd or a mapping left open, a view that
  reaches outside its image, a reply that names no FlashBoot error.

Mutations are structural (a field deleted, retyped, set to a huge, negative, non-finite or
deeply nested value, swapped with another field, renamed) on the parsed JSON, and byte-level
(truncation, a flipped or non-UTF-8 byte, a spliced slice) on the text. Everything is seeded:
``run_campaign(readers, n, seed)`` tries the same inputs on every run.

``python -m flashboot.fuzzing --inputs N`` (``make fuzz``) runs a long campaign and prints the
counts per reader; ``--atheris`` drives the byte-level readers with atheris' coverage-guided
mutator instead (one process per reader).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import FlashBootError

# ============================================================================ mutation
_INTS = (0, 1, -1, 2, 3, 7, 255, 256, 257, 4095, 4096, 4097, 1 << 31, 1 << 32, (1 << 40) + 8, (1 << 53) + 1,
         1 << 56, (1 << 56) + 4096, 1 << 62, (1 << 63) - 1, 1 << 63, 1 << 64, -(1 << 63), -(1 << 63) - 1, 10 ** 40)
_ATOMS = (None, True, False, "", "x", "float32", "bfloat16", "int8", "experts", "non_experts", "rank-0", "..",
          "../../etc", "a/b", "\udcff", "\x00", "0" * 64, "g" * 16, 0.5, -0.0, 1e308, float("inf"), float("-inf"),
          float("nan"), [], {}, [0], [1, 2, 3], [-1], {"a": 1}, [[0]], [None])


_DEEP = "\x00deep:"
"""A string that :func:`_dumps` replaces by that many nested lists (json.dumps itself would recurse)."""


_DEEP_RE = re.compile(re.escape(json.dumps(_DEEP)[:-1]) + r'(\d{1,6})"')


def _deep(depth: int) -> str:
    return f"{_DEEP}{depth}"


def _slots(obj: Any, out: list, depth: int = 0) -> list:
    """Every (container, key) whose value a mutation may replace, depth first."""
    if depth > 64:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((obj, k))
            _slots(v, out, depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append((obj, i))
            _slots(v, out, depth + 1)
    return out


def _nasty(rng: random.Random, old: Any, pool: list) -> Any:
    r = rng.random()
    if isinstance(old, int) and not isinstance(old, bool) and r < 0.45:
        return rng.choice((old + 1, old - 1, -old, old * 2, old + 256, old + 4096, old << 20, old // 2,
                           old + (1 << 40) + 8, rng.choice(_INTS)))
    if isinstance(old, str) and r < 0.3:
        return rng.choice((old + "x", old[:-1], old.upper(), old * 2, old[::-1], ""))
    if isinstance(old, list) and r < 0.3 and old:
        return rng.choice((old[:-1], old + old[-1:], old[::-1], [old[0]] * 9, old + [rng.choice(_INTS)]))
    if r < 0.6:
        return rng.choice(_INTS)
    if r < 0.85:
        return copy.deepcopy(rng.choice(_ATOMS))
    if r < 0.93 and pool:
        return copy.deepcopy(_pick(rng, pool))
    return _deep(rng.choice((2, 30, 200, 5000, 100_000)))


def _pick(rng: random.Random, pool: list) -> Any:
    container, key = rng.choice(pool)
    try:
        return container[key]
    except (KeyError, IndexError):  # removed by an earlier change of this round
        return None


def mutate_json(obj: Any, rng: random.Random, n_mutations: int) -> Any:
    """``obj`` (changed in place) with ``n_mutations`` structural changes."""
    slots = _slots(obj, [])
    if not slots:
        return rng.choice(_ATOMS + (_deep(100_000),))
    for _ in range(n_mutations):
        container, key = rng.choice(slots)
        if key not in container if isinstance(container, dict) else key >= len(container):
            continue  # removed by an earlier change of this round
        r = rng.random()
        if r < 0.15:  # delete (a field, a list element, a tensor)
            del container[key]
        elif r < 0.22 and isinstance(container, dict):  # rename
            value = container.pop(key)
            container[rng.choice((str(key) + "_", str(key).upper(), "", str(rng.choice(_INTS))))] = value
        elif r < 0.27 and isinstance(container, dict):  # add an unknown field
            container[rng.choice(("extra", "shard", "parts", "nbytes", "stride", "__proto__"))] = rng.choice(_INTS)
        elif r < 0.32:  # copy another value of the document here
            container[key] = copy.deepcopy(_pick(rng, slots))
        else:
            container[key] = _nasty(rng, container[key], slots)
    return obj


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """One byte-level change: truncate, flip, insert a non-UTF-8 byte, splice, nest."""
    b = bytearray(data)
    r = rng.random()
    pos = rng.randrange(len(b) + 1)
    if r < 0.2:
        return bytes(b[:pos])
    if r < 0.4 and b:
        b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
    elif r < 0.55:
        b[pos:pos] = rng.choice((b"\xff", b"\xc3", b"\x00", b"\xed\xa0\x80", b"\\ud800", b"\"", b",", b"}", b"]"))
    elif r < 0.7 and b:
        a = rng.randrange(len(b))
        b[pos:pos] = b[a:a + rng.randrange(1, 64)]
    elif r < 0.8:
        n = rng.choice((50, 1000, 100_000))
        b[pos:pos] = b"[" * n + b"]" * n
    elif r < 0.9 and b:
        a = rng.randrange(len(b))
        del b[a:a + rng.randrange(1, 64)]
    else:
        b[pos:pos] = str(rng.choice(_INTS)).encode()
    return bytes(b)


def _dumps(obj: Any) -> bytes:
    text = _DEEP_RE.sub(lambda m: "[" * int(m.group(1)) + "0" + "]" * int(m.group(1)), json.dumps(obj))
    return text.encode("utf-8", "surrogatepass")


def mutate_document(seed: bytes, rng: random.Random) -> bytes:
    """A mutation of the JSON document ``seed``: 1-3 structural changes, sometimes also a byte-level one."""
    try:
        obj = json.loads(seed)
    except ValueError:
        return mutate_bytes(seed, rng)
    r = rng.random()
    if r < 0.12:
        return mutate_bytes(seed, rng)
    data = _dumps(mutate_json(obj, rng, rng.choice((1, 1, 2, 3))))
    if r > 0.92:
        data = mutate_bytes(data, rng)
    return data


# ============================================================================ readers
@dataclass
class Outcome:
    """How one input went: ``parsed`` (and no invariant broken), ``refused``, ``wrong`` or ``crash``."""

    kind: str
    detail: str = ""


@dataclass
class Reader:
    """One reader of outside bytes: its seeds, how to mutate them and how to feed it one input.

    ``feed(data)`` returns the parsed object (or raises); ``check(obj, data)`` returns a broken
    invariant of a parsed object, or None; ``leaks`` (a :class:`LeakProbe`) looks for fds and
    mappings an input left open.
    """

    name: str
    seeds: list[bytes]
    feed: Callable[[bytes], Any]
    check: Callable[[Any, bytes], str | None] = lambda obj, data: None
    mutate: Callable[[bytes, random.Random], bytes] = mutate_document
    leaks: "LeakProbe | None" = None

    def warm_up(self) -> None:
        """Feed every seed once (lazy imports, caches): what a first use opens for good is no leak."""
        for s in self.seeds:
            self.run_one(s)

    def run_one(self, data: bytes) -> Outcome:
        if self.leaks is not None:
            self.leaks.before()
        try:
            obj = self.feed(data)
        except FlashBootError:
            outcome = Outcome("refused")
        except Exception as exc:  # noqa: BLE001 - the point: any other exception is a finding
            outcome = Outcome("crash", "".join(traceback.format_exception_only(type(exc), exc)).strip()[:400]
                              + "\n" + _where(exc))
        else:
            problem = self.check(obj, data)
            outcome = Outcome("wrong", problem) if problem else Outcome("parsed")
        if self.leaks is not None:
            leak = self.leaks.after()
            if leak:
                outcome = Outcome("crash", f"leak: {leak}")
        return outcome


def _where(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(tb[-4:]))


@dataclass
class Finding:
    reader: str
    kind: str
    detail: str
    data: bytes


@dataclass
class Counts:
    """Per reader: inputs tried, parsed, refused with a FlashBootError, crashes, accepted-but-wrong."""

    tried: int = 0
    parsed: int = 0
    refused: int = 0
    crash: int = 0
    wrong: int = 0
    seconds: float = 0.0
    findings: list[Finding] = field(default_factory=list)


def run_campaign(readers: list[Reader], inputs: int, seed: int = 0, *, keep: int = 20,
                 progress: Callable[[str, Counts], None] | None = None) -> dict[str, Counts]:
    """Feed ``inputs`` mutated inputs to each reader (seeded: the same inputs every run); returns
    the counts per reader, with up to ``keep`` distinct findings (crash or wrong) each."""
    out = {}
    for reader in readers:
        rng = random.Random(f"{seed}/{reader.name}")
        reader.warm_up()
        c = Counts()
        seen: set[str] = set()
        t0 = time.perf_counter()
        for i in range(inputs):
            data = reader.mutate(rng.choice(reader.seeds), rng)
            o = reader.run_one(data)
            c.tried += 1
            setattr(c, o.kind, getattr(c, o.kind) + 1)
            if o.kind in ("crash", "wrong"):
                first = o.detail.splitlines()[0]
                sig = first[:70] + o.detail.splitlines()[-1] if o.kind == "crash" else first.split(":")[0]
                if sig not in seen and len(c.findings) < keep:
                    seen.add(sig)
                    c.findings.append(Finding(reader.name, o.kind, o.detail, data))
            if progress is not None and ((i + 1) % 10_000 == 0 or i + 1 == inputs):
                progress(reader.name, c)
        c.seconds = time.perf_counter() - t0
        out[reader.name] = c
    return out


def format_counts(counts: dict[str, Counts]) -> str:
    """A table: reader, tried, parsed, refused, crashes, wrong, seconds."""
    rows = [("reader", "tried", "parsed", "refused", "crashes", "wrong", "s")]
    for name, c in counts.items():
        rows.append((name, f"{c.tried:,}", f"{c.parsed:,}", f"{c.refused:,}", f"{c.crash:,}", f"{c.wrong:,}",
                     f"{c.seconds:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
                     for r in rows)


# ============================================================================ leak probes
def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def mappings_of(path_part: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if path_part in line)


class LeakProbe:
    """fds one input left open (every input) and mappings of files whose path contains
    ``path_part`` (every ``maps_every``-th input: /proc/self/maps of a torch process is ~1 ms)."""

    def __init__(self, path_part: str, maps_every: int = 16):
        self.path_part, self.maps_every, self.calls = path_part, maps_every, 0
        self._fds: set[int] = set()
        self._maps: int | None = None

    def before(self) -> None:
        self.calls += 1
        self._fds = open_fds()
        self._maps = mappings_of(self.path_part) if self.calls % self.maps_every == 0 else None

    def after(self) -> str | None:
        leaked = open_fds() - self._fds
        maps = 0 if self._maps is None else mappings_of(self.path_part) - self._maps
        if leaked or maps > 0:
            targets = sorted({_fd_target(fd) for fd in leaked})[:3]
            return f"{len(leaked)} fd(s) {targets} and {maps} mapping(s) of {self.path_part} left open"
        return None


# ============================================================================ the corpus
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
_TOKEN = "fuzz-token-0123456789abcdef"
_KEY = "flashboot/v1/fuzz/seed"


def _seed_descriptor() -> dict:
    return {"backend": "host", "pid": os.getpid(), "fds": [7, 8], "nbytes": 3 << 20, "device_index": -1,
            "handle_type": "memfd", "granularity": 4096, "segment_bytes": 2 << 20, "arena_id": "0123456789abcdef",
            "fabric_handles": None, "hostname": "host-a"}


def _seed_manifest(image_dir: Path) -> dict:
    from flashboot.layouts.format import parse_metadata
    from flashboot.flashclone.rendezvous import Manifest

    meta = parse_metadata((image_dir / "rank-0" / "metadata.json").read_bytes(), "seed")
    return Manifest.from_metadata(meta).to_dict()


def _check_descriptor(desc) -> str | None:
    if desc.backend not in ("cuda", "host") or desc.handle_type not in ("posix_fd", "fabric+posix_fd", "memfd"):
        return f"backend {desc.backend!r}, handle type {desc.handle_type!r}"
    for name in ("pid", "nbytes", "granularity", "segment_bytes"):
        v = getattr(desc, name)
        if type(v) is not int or v <= 0:
            return f"{name} {v!r}"
    if type(desc.device_index) is not int or desc.device_index < -1:
        return f"device_index {desc.device_index!r}"
    if not all(type(fd) is int and fd >= 0 for fd in desc.fds):
        return f"fds {desc.fds!r}"
    if type(desc.arena_id) is not str or type(desc.hostname) is not str:
        return f"arena_id {desc.arena_id!r}, hostname {desc.hostname!r}"
    if desc.fabric_handles is not None and not all(type(h) is bytes and len(h) == 64 for h in desc.fabric_handles):
        return f"fabric handles {desc.fabric_handles!r}"
    return None


def _check_manifest(m) -> str | None:
    for name in ("nbytes", "arena_nbytes", "checksum_chunk_bytes"):
        v = getattr(m, name)
        if type(v) is not int or v <= 0:
            return f"{name} {v!r}"
    if not all(type(c) is int and 0 <= c < 1 << 64 for c in m.checksums):
        return "checksums outside 64 bits"
    if m.key is not None and (not isinstance(m.key, dict) or type(m.key.get("digest")) is not str):
        return f"key {m.key!r}"
    return None


def descriptor_reader() -> Reader:
    """``ArenaDescriptor.from_dict`` of a mutated descriptor (as a clone or the preloader gets it)."""
    from flashboot.arena import ArenaDescriptor

    return Reader("arena descriptor (from_dict)", [json.dumps(_seed_descriptor()).encode()],
                  _json_feed(ArenaDescriptor.from_dict), lambda d, data: _check_descriptor(d))


def _json_feed(parse: Callable[[Any], Any]) -> Callable[[bytes], Any]:
    """Inputs that are not JSON at all are not this reader's: only parsed JSON reaches ``parse``."""
    def feed(data: bytes):
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            raise _NotJson() from None
        return parse(obj)
    return feed


class _NotJson(FlashBootError):
    """The mutation broke the JSON text itself; the reader under test takes parsed JSON."""


def manifest_reader(image_dir: Path) -> Reader:
    """``Manifest.from_dict`` of a mutated manifest (what a clone reads from the seed's record)."""
    from flashboot.flashclone.rendezvous import Manifest

    return Reader("manifest (from_dict)", [json.dumps(_seed_manifest(image_dir)).encode()],
                  _json_feed(Manifest.from_dict), lambda m, data: _check_manifest(m))


def record_reader(image_dir: Path, *, sealed_garbage: bool) -> Reader:
    """``decode_record`` as a clone reads the seed's record.

    ``sealed_garbage=False``: the stored bytes are mutated (no token: everything but a no-op must
    fail authentication). ``True``: the record's body and sealed part are mutated *before* they are
    authenticated with the right token (a participant with a bug), then decoded and the manifest
    and sealed descriptor parsed as the clone does."""
    from flashboot.arena import ArenaDescriptor
    from flashboot.flashclone.rendezvous import Manifest, Token, decode_record, encode_record

    token = Token(_TOKEN)
    body = {"manifest": _seed_manifest(image_dir), "generation": "g0", "pid": os.getpid()}
    sealed = {"arena": _seed_descriptor()}
    original = decode_record(token, _KEY, encode_record(token, _KEY, body, sealed))
    if not sealed_garbage:
        def feed(data: bytes):
            return decode_record(token, _KEY, data)

        def check(rec, data: bytes) -> str | None:
            if (rec.body, rec.sealed) != (original.body, original.sealed):
                return "a changed record passed authentication"
            return None

        return Reader("rendezvous record (stored bytes)", [encode_record(token, _KEY, body, sealed)], feed, check)

    seed = json.dumps({"body": body, "sealed": sealed}).encode()

    def feed_sealed(data: bytes):
        try:
            doc = json.loads(data)
            b, s = doc["body"], doc["sealed"]
            raw = encode_record(token, _KEY, b, s)
        except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
            raise _NotJson() from None  # not a record anyone could write: encode_record needs mappings
        rec = decode_record(token, _KEY, raw)
        manifest = Manifest.from_dict(rec.body.get("manifest"))
        desc = ArenaDescriptor.from_dict(rec.sealed.get("arena")) if rec.sealed is not None else None
        return manifest, desc

    def check_sealed(parsed, data: bytes) -> str | None:
        manifest, desc = parsed
        return _check_manifest(manifest) or (desc is not None and _check_descriptor(desc)) or None

    return Reader("rendezvous record (sealed, authenticated garbage)", [seed], feed_sealed, check_sealed)


# ----------------------------------------------------------------- the preloader's socket
class _Preloader:
    """A real served-load daemon (host backend) over the seed image, and a real host arena to
    copy into; requests are handed to its connection handler over a socketpair."""

    def __init__(self, image_dir: Path, work: Path):
        import threading

        from flashboot.arena import Arena
        from flashboot.flashload.server import PreloadServer
        from flashboot.flashload.shm import rank_source
        from flashboot.flashload.staging import PreloadConfig

        self.image_dir = _fresh_copy(image_dir, work / "served")
        self.logs: list[str] = []
        shutil.rmtree(work / "shm", ignore_errors=True)
        cfg = PreloadConfig(str(self.image_dir), ranks=[0], shm_dir=str(work / "shm"), serve=True, threads=1)
        self.server = PreloadServer(cfg, log=self.logs.append)
        self.thread = threading.Thread(target=self.server.run, name="fuzz-preloader", daemon=True)
        self.thread.start()
        res = self.server.residents[0]
        if not res.event.wait(120) or res.error is not None:
            raise FlashBootError(f"the fuzzed preloader did not stage rank 0: {res.error}")
        self.source = rank_source(self.image_dir, 0)
        self.arena = Arena.create(self.source.nbytes, "cpu")
        self.desc = self.arena.export()
        self.other = Arena.create(self.source.nbytes // 2 or 4096, "cpu")  # an arena of another size
        self.other_desc = self.other.export()

    def close(self) -> None:
        self.server.stop.set()
        self.thread.join(timeout=30)
        self.arena.close()
        self.other.close()


_FD_KINDS = ("arena", "arena", "arena", "none", "other-size", "pipe", "devnull", "socket", "two", "many", "image",
             "short")
"""What a fuzzed request carries: the arena's own fd, none, another (smaller) arena's memfd, a pipe,
/dev/null, a socket, two arenas' fds, SCM_MAX_FD fds, the image file, a memfd named like the
arena's segment but shorter (the size check is all that stands between it and a SIGBUS)."""


def preloader_reader(image_dir: Path, work: Path) -> tuple[Reader, _Preloader]:
    """``PreloadServer._handle`` on mutated requests with the right, no, or the wrong fds
    attached (another arena's memfd, a pipe, /dev/null, a socket, the image file, too many).
    The reply must be a FlashBootError by name (or ok), and every received fd closed."""
    from flashboot.fdshare import SCM_MAX_FD

    p = _Preloader(image_dir, work)
    load = {"op": "load", "rank": 0, "descriptor": p.desc.to_dict(), "nbytes": p.source.nbytes,
            "metadata_sha256": p.source.metadata_sha256, "timeout_s": 5, "pci_bus_id": None}
    seeds = [bytes([k]) + json.dumps(load).encode() for k in range(len(_FD_KINDS))]
    seeds.append(bytes([0]) + json.dumps({"op": "status"}).encode())
    from flashboot import errors as _errors

    def mutate(seed: bytes, rng: random.Random) -> bytes:
        kind = rng.randrange(len(_FD_KINDS)) if rng.random() < 0.5 else seed[0]
        body = seed[1:] if rng.random() < 0.05 else mutate_document(seed[1:], rng)
        return bytes([kind]) + body

    def fds_for(kind: str) -> tuple[list[int], list[int]]:
        """(fds to send, fds this harness opened for it and closes after)"""
        if kind == "arena":
            return list(p.desc.fds), []
        if kind == "other-size":
            return list(p.other_desc.fds), []
        if kind == "none":
            return [], []
        if kind == "pipe":
            r, w = os.pipe()
            return [r], [r, w]
        if kind == "devnull":
            fd = os.open(os.devnull, os.O_RDWR)
            return [fd], [fd]
        if kind == "socket":
            a, b = socket.socketpair()
            fa, fb = a.detach(), b.detach()
            return [fa], [fa, fb]
        if kind == "image":
            fd = os.open(p.source.path, os.O_RDONLY)
            return [fd], [fd]
        if kind == "short":
            from flashboot.arena import _memfd_name

            fd = os.memfd_create(_memfd_name(p.desc.arena_id, 0), os.MFD_CLOEXEC)
            os.ftruncate(fd, max(4096, p.desc.nbytes // 2))
            return [fd], [fd]
        if kind == "two":
            return list(p.desc.fds) + list(p.other_desc.fds), []
        fd = os.open(os.devnull, os.O_RDONLY)
        return [fd] * SCM_MAX_FD, [fd]

    def feed(data: bytes):
        from flashboot.fdshare import send_fds

        data = data or b"\0"
        # No client can send more in one SOCK_SEQPACKET message (EMSGSIZE at its end, wmem_default ~208 KiB).
        kind, msg = _FD_KINDS[data[0] % len(_FD_KINDS)], data[1:_MAX_SEND_BYTES + 1]
        fds, mine = fds_for(kind)
        engine, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if fds:
                send_fds(engine, fds, msg)
            else:
                engine.send(msg)
            engine.shutdown(socket.SHUT_WR)  # a client that said all it will say
            p.server._handle(daemon)  # closes daemon, and every fd it received
            engine.settimeout(5)
            try:
                reply = engine.recv(1 << 20)
            except OSError as exc:
                return ("no reply", str(exc))
        finally:
            engine.close()
            for fd in mine:
                os.close(fd)
        if not reply:
            return ("empty", "")
        reply = json.loads(reply)
        if reply.get("ok") is True:
            return ("ok", reply)
        cls = getattr(_errors, str(reply.get("error")), None)
        if isinstance(cls, type) and issubclass(cls, FlashBootError):
            raise cls.__new__(cls)  # refused, by name
        raise _UnnamedReply(f"reply names {reply.get('error')}: {str(reply.get('message'))[:300]}")

    def check(result, data: bytes) -> str | None:
        what, reply = result
        if what == "ok" or (what == "empty" and data[1:] == b""):
            return None  # an empty message is a closed connection: nothing to answer
        return f"{what} to a {len(data) - 1}-byte request: {reply}"

    return Reader("preloader request + fds (_handle)", seeds, feed, check, mutate, LeakProbe("/memfd:", 64)), p


_MAX_SEND_BYTES = 200_000


class _UnnamedReply(Exception):
    """The daemon answered with an error that is no FlashBootError (a crash of the contract)."""


def _fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


# ============================================================================ all of them
READERS = ("metadata", "image", "lone", "job", "ready", "record", "sealed", "manifest", "descriptor", "preloader")


class Corpus:
    """The seed image and every reader over it, in a working directory; :meth:`close` stops the preloader."""

    def __init__(self, work: str | os.PathLike, names=READERS, image_dir: str | os.PathLike | None = None):
        self.work = Path(work)
        image = Path(image_dir) if image_dir is not None else make_seed_image(self.work / "seed")
        self.image_dir = image
        self.preloader: _Preloader | None = None
        self.readers: list[Reader] = []
        for name in names:
            if name == "metadata":
                self.readers.append(metadata_reader(image))
            elif name == "image":
                self.readers.append(image_reader(image, self.work))
            elif name == "lone":
                self.readers.append(lone_rank_reader(image, self.work))
            elif name == "job":
                self.readers.append(job_reader(image, self.work))
            elif name == "ready":
                self.readers.append(ready_reader(self.work))
            elif name == "record":
                self.readers.append(record_reader(image, sealed_garbage=False))
            elif name == "sealed":
                self.readers.append(record_reader(image, sealed_garbage=True))
            elif name == "manifest":
                self.readers.append(manifest_reader(image))
            elif name == "descriptor":
                self.readers.append(descriptor_reader())
            elif name == "preloader":
                reader, self.preloader = preloader_reader(image, self.work)
                self.readers.append(reader)
            else:
                raise FlashBootError(f"unknown fuzz reader {name!r}; known: {', '.join(READERS)}")
            self.readers[-1].warm_up()
        self._by_name = dict(zip(names, self.readers))

    def reader(self, name: str) -> Reader:
        """The reader called ``name`` (one of :data:`READERS`)."""
        return self._by_name[name]

    def close(self) -> None:
        if self.preloader is not None:
            self.preloader.close()
            self.preloader = None


# ============================================================================ atheris
def _atheris_main(name: str, runs: int, work: str) -> None:
    """One reader under atheris (coverage-guided): the fuzzer's bytes are the reader's input,
    starting from the reader's seeds. Prints one JSON line of counts."""
    import atheris

    with atheris.instrument_imports():
        import flashboot.arena  # noqa: F401
        import flashboot.flashload.server  # noqa: F401
        import flashboot.flashload.shm  # noqa: F401
        import flashboot.layouts.format  # noqa: F401
        import flashboot.layouts.image  # noqa: F401
        import flashboot.flashclone.rendezvous  # noqa: F401
    corpus = Corpus(work, [name], image_dir=os.environ.get("FLASHBOOT_FUZZ_IMAGE"))
    reader = corpus.readers[0]
    seeds_dir = Path(work) / f"atheris-seeds-{name}"
    seeds_dir.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(reader.seeds):
        (seeds_dir / f"seed-{i}").write_bytes(s)
    c = Counts()
    t0 = time.perf_counter()

    def one(data: bytes) -> None:
        o = reader.run_one(data)
        c.tried += 1
        setattr(c, o.kind, getattr(c, o.kind) + 1)
        if o.kind in ("crash", "wrong") and len(c.findings) < 20:
            c.findings.append(Finding(name, o.kind, o.detail, data))
        if c.tried == runs:
            c.seconds = time.perf_counter() - t0
            _report_atheris(name, c)
            corpus.close()
            os._exit(0)

    atheris.Setup([sys.argv[0], f"-runs={runs + 10}", "-rss_limit_mb=4096", str(seeds_dir)], one)
    atheris.Fuzz()


def _report_atheris(name: str, c: Counts) -> None:
    print(json.dumps({"reader": name, "tried": c.tried, "parsed": c.parsed, "refused": c.refused, "crash": c.crash,
                      "wrong": c.wrong, "seconds": c.seconds,
                      "findings": [{"kind": f.kind, "detail": f.detail, "input": f.data[:2000].hex()}
                                   for f in c.findings]}), flush=True)


# ============================================================================ the command
def limit_memory(gib: float) -> None:
    """Cap this process's address space at ``gib`` GiB (RLIMIT_AS): a reader that tries to allocate
    for a field like ``world_size = 2**62`` then raises MemoryError instead of exhausting the host."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = int(gib * (1 << 30))
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft == resource.RLIM_INFINITY or soft > want:
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))


def main(argv: list[str] | None = None) -> int:
    """``python -m flashboot.fuzzing [--inputs N] [--seed S] [--readers a,b] [--atheris]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m flashboot.fuzzing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=100_000, help="inputs per reader (default 100,000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--readers", default=",".join(READERS), help=f"comma-separated subset of {', '.join(READERS)}")
    ap.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--atheris", action="store_true", help="coverage-guided (atheris), one process per reader")
    ap.add_argument("--findings", default=None, help="write every finding (input hex, detail) to this JSON file")
    ap.add_argument("--atheris-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--memory-gib", type=float, default=8.0,
                    help="address-space limit of this process (a reader that asks for more fails with MemoryError, "
                         "a finding, instead of taking the machine's memory); default 8")
    args = ap.parse_args(argv)
    limit_memory(args.memory_gib)
    names = [n for n in args.readers.split(",") if n]
    work = Path(args.work) if args.work else fuzz_work_dir()
    if args.atheris_child:
        _atheris_main(args.atheris_child, args.inputs, str(work))
        return 0
    if args.atheris:
        return _run_atheris(names, args, work)
    corpus = Corpus(work, names)
    try:
        def progress(name: str, c: Counts) -> None:
            print(f"  {name}: {c.tried:,} tried, {c.crash} crashes, {c.wrong} wrong", file=sys.stderr, flush=True)

        counts = run_campaign(corpus.readers, args.inputs, args.seed, progress=progress)
    finally:
        corpus.close()
    print(format_counts(counts))
    findings = [f for c in counts.values() for f in c.findings]
    for f in findings:
        print(f"\n[{f.reader}] {f.kind}: {f.detail}\n  input: {f.data[:300]!r}")
    if args.findings:
        Path(args.findings).write_text(json.dumps([{"reader": f.reader, "kind": f.kind, "detail": f.detail,
                                                    "input": f.data.hex()} for f in findings], indent=1))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if findings else 0


def _run_atheris(names: list[str], args, work: Path) -> int:
    import subprocess

    image = make_seed_image(work / "seed")
    bad = 0
    rows: dict[str, Counts] = {}
    for name in names:
        env = dict(os.environ, FLASHBOOT_FUZZ_IMAGE=str(image))
        proc = subprocess.run([sys.executable, "-m", "flashboot.fuzzing", "--atheris-child", name, "--inputs",
                               str(args.inputs), "--work", str(work / f"atheris-{name}")],
                              capture_output=True, text=True, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("{\"reader\"")), None)
        if line is None:
            print(f"[{name}] atheris run ended without counts (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            bad += 1
            continue
        d = json.loads(line)
        rows[name] = Counts(d["tried"], d["parsed"], d["refused"], d["crash"], d["wrong"], d["seconds"])
        for f in d["findings"]:
            bad += 1
            print(f"[{name}] {f['kind']}: {f['detail']}\n  input: {bytes.fromhex(f['input'])[:300]!r}")
    print(format_counts(rows))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
