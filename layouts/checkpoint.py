"""A Hugging Face checkpoint directory seen through its safetensors headers.

:func:`open_checkpoint` reads ``config.json`` and every shard's header (nothing else), and
refuses, before any tensor byte is read, what an image cannot hold: unsupported dtypes, two
names sharing bytes in a shard, the same name in two shards, an index that disagrees with the
shards. Pre-pack then reads the tensors' bytes in large sequential batches (:func:`plan_reads`,
:class:`ShardReader`: ``O_DIRECT`` where the filesystem allows it, from several threads);
:meth:`Checkpoint.read` gives one tensor through ``safetensors.safe_open``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashboot._json import loads
from flashboot.errors import LayoutError
from flashboot.fileio import DirectReadRefused, io_buffer, open_regular, read_exactly, read_regular

from .format import DTYPES_BY_SAFETENSORS, DTYPES, config_hash
from .image import FileIdentity  # the identity an image's readers check its files by

_HEADER_LIMIT = 100 << 20  # safetensors' own cap on the JSON header
MAX_CHECKPOINT_JSON_BYTES = 256 << 20
"""The most ``config.json`` or ``model.safetensors.index.json`` may hold (read whole)."""


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the checkpoint: where its bytes are and what they are."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    data_start: int
    """Absolute byte offset of the data in ``file``."""
    nbytes: int

    @property
    def ndim(self) -> int:
        return len(self.shape)


MAX_NDIM = 64
"""The most dimensions a tensor may have: what an image's binary table holds (``tensors.bin``)."""
MAX_SPAN = (1 << 63) - 1
"""A tensor's dims may not span more elements than an int64 counts: its strides are int64."""


def _is_int(v: Any) -> bool:
    return type(v) is int  # not bool, not float: safetensors itself refuses both


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The JSON header of one ``.safetensors`` file (``__metadata__`` removed), data offsets
    made absolute. LayoutError naming the file on anything malformed, and on what safetensors
    accepts but an image cannot hold (an empty name, a name that is no UTF-8, more than
    :data:`MAX_NDIM` dims, dims spanning more than an int64): refused here, before pre-pack
    writes gigabytes, not by the reader of the image it would write."""
    return _read_header(path)[0]


def _read_header(path: Path) -> tuple[dict[str, dict], FileIdentity]:
    """:func:`read_safetensors_header`, and the identity of the file it was read from."""
    _refuse_dangling(path, "a shard")
    try:
        f = open_regular(path)
    except OSError as exc:  # a shard removed meanwhile
        raise LayoutError(f"{path}: cannot open the shard ({exc.strerror})") from None
    with f:
        st = os.fstat(f.fileno())
        size = st.st_size
        head = f.read(8)
        if len(head) != 8:
            raise LayoutError(f"{path}: {size} bytes, too short for a safetensors header")
        n = struct.unpack("<Q", head)[0]
        if n > _HEADER_LIMIT or 8 + n > size:
            raise LayoutError(f"{path}: header claims {n:,} bytes; file has {size:,}")
        header = _load_header(f.read(n), path)
    if not isinstance(header, dict):
        raise LayoutError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        # safetensors' own reader refuses it (a map of strings): a file no loader reads is no checkpoint
        raise LayoutError(f"{path}: __metadata__ must map names to strings (as safetensors requires), found "
                          f"{str(meta)[:200]}")
    base = 8 + n
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
                and isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)
                and isinstance(info.get("dtype"), str)):
            raise LayoutError(f"{path}: tensor {name!r} has a malformed header entry {str(info)[:200]} (dtype a "
                              "string, shape a list of ints >= 0, data_offsets two ints)")
        if not name:  # one not UTF-8 is refused with the header's text
            raise LayoutError(f"{path}: a tensor's name is empty; an image names every tensor")
        if len(shape) > MAX_NDIM or math.prod(max(d, 1) for d in shape) > MAX_SPAN:
            raise LayoutError(f"{path}: tensor {name!r} shape {shape[:8]}{'...' if len(shape) > 8 else ''} "
                              f"({len(shape)} dims) has more than {MAX_NDIM} dims or spans more than 2**63 elements")
        start, end = offsets
        if not 0 <= start <= end or base + end > size:
            raise LayoutError(f"{path}: tensor {name!r} data_offsets {offsets} fall outside the "
                              f"file's {size - base:,} data bytes")
        info["data_offsets"] = (base + start, base + end)
    _check_tiled(path, header, base, size)
    return header, FileIdentity.of(path, st)


def _load_header(raw: bytes, path: Path) -> Any:
    """The header's JSON, refusing a name given twice (JSON keeps the last entry and had dropped
    the first without a word: safetensors refuses such a file; its tensor's bytes were lost) and
    text that is not UTF-8 (pre-pack had packed a shard no loader reads)."""
    def pairs(items: list) -> dict:
        for k, v in items:  # JSON allows "\ud800"; safetensors' reader (UTF-8 only) refuses the file
            for text in (k, v) if isinstance(v, str) else (k,):
                if not _utf8(text):
                    raise LayoutError(f"{path}: the header holds {text!r}, which is not UTF-8 (a lone surrogate); "
                                      "safetensors refuses such a file")
        obj = dict(items)
        if len(obj) != len(items):
            seen: set = set()
            twice = next(k for k, _ in items if k in seen or seen.add(k))
            raise LayoutError(f"{path}: the header names {twice!r} twice ({len(items) - len(obj)} repeated "
                              "name(s)); safetensors refuses such a file")
        return obj

    try:
        return json.loads(raw, object_pairs_hook=pairs)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise LayoutError(f"{path}: header: not JSON ({exc})") from None
    except RecursionError:
        raise LayoutError(f"{path}: header: not JSON (nested deeper than this reader accepts)") from None


def _check_tiled(path: Path, header: dict[str, dict], base: int, size: int) -> None:
    """safetensors' own rule, which its reader enforces: the tensors' data, in offset order, tile
    the file's data bytes from the first to the last, with no gap and no overlap. A gap or a tail
    no tensor holds had been taken without a word: bytes a writer lost track of (one of two
    entries of one name, which JSON keeps the last of), a truncated rewrite, a file still being
    appended to; safetensors and every engine refuse such a file."""
    at, prev = base, None
    for start, end, name in sorted((*info["data_offsets"], name) for name, info in header.items()):
        if start > at:
            raise LayoutError(f"{path}: file bytes {at:,}..{start:,} (before tensor {name!r}) belong to no tensor; "
                              "safetensors refuses a file whose tensors leave gaps")
        if start < at:
            raise LayoutError(f"{path}: tensors {prev!r} and {name!r} share file bytes {start:,}..{min(at, end):,} "
                              "(aliased tensors are not supported: save them as separate tensors)")
        at, prev = end, name
    if at != size:
        raise LayoutError(f"{path}: the tensors' data ends at byte {at:,} but the file has {size:,} bytes: "
                          f"{size - at:,} trailing bytes belong to no tensor (a file still being written or "
                          "appended to?); safetensors refuses it")


def _utf8(name: str) -> bool:
    try:
        name.encode()
    except UnicodeEncodeError:  # a lone surrogate ("\ud800") that JSON allows
        return False
    return True


def _refuse_dangling(path: Path, what: str) -> None:
    """LayoutError for a link whose target is gone (a hub snapshot whose blob was deleted or never
    finished downloading): named as such, not as an absent file, which ``ls`` shows is there."""
    try:
        dangling = path.is_symlink() and not path.exists()
        target = os.readlink(path) if dangling else ""
    except OSError as exc:  # a name too long (ENAMETOOLONG) from an index: a bare OSError had escaped
        raise LayoutError(f"{str(path)[:300]}: cannot look up {what} ({exc.strerror})") from None
    if dangling:
        raise LayoutError(f"{path}: a link to {target}, which does not exist ({what})")


def _read_json(path: Path, what: str) -> Any:
    """A checkpoint's JSON file (``config.json``, the index), or LayoutError naming it; a link
    whose target is gone is named as such, not taken for an absent file."""
    _refuse_dangling(path, what)
    try:
        raw = read_regular(path, MAX_CHECKPOINT_JSON_BYTES)
    except OSError as exc:
        raise LayoutError(f"{path}: cannot read {what} ({exc.strerror})") from None
    return loads(raw, str(path), LayoutError)


def read_config(path: Path) -> dict:
    """A model's ``config.json`` at ``path`` as a dict, or LayoutError naming it (unreadable, not
    JSON, nested too deeply, or no JSON object)."""
    config = _read_json(path, "the model's config")
    if not isinstance(config, dict):
        raise LayoutError(f"{path}: a config is a JSON object, found a JSON {type(config).__name__}")
    return config


def _hub_repo_hint(path: Path) -> str:
    """For a hub cache repo directory (``models--org--name``, whose checkpoint is one of its
    ``snapshots/REV``): which directory to give instead."""
    snapshots = path / "snapshots"
    if not snapshots.is_dir():
        return ""
    revs = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
    try:  # refs/main names the revision the hub's "main" resolved to
        want = read_regular(path / "refs" / "main", 1024).decode(errors="replace").strip()
    except (OSError, LayoutError):
        want = revs[0] if len(revs) == 1 else None
    if want in revs:
        return f" (a hub cache repo: its checkpoint is {snapshots / want})"
    return f" (a hub cache repo: give one of its snapshots, {', '.join(revs[:4]) or 'none downloaded'})"


def _index_shards(weight_map: Any, index_path: Path) -> dict[str, str]:
    """The index's ``weight_map`` checked: names to plain relative shard paths inside the
    checkpoint (an index naming ``../x`` or ``/etc/...`` had been followed)."""
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise LayoutError(f"{index_path}: weight_map must map tensor names to shard file names (strings)")
    for name, shard in weight_map.items():
        parts = Path(shard).parts
        if not shard or Path(shard).is_absolute() or ".." in parts:
            raise LayoutError(f"{index_path}: maps {name!r} to {shard!r}, outside the checkpoint directory")
    # one file, one name: "./model.safetensors" beside "model.safetensors" had been read as two
    # shards, and its every tensor refused as "in two shards"
    return {name: os.path.normpath(shard) for name, shard in weight_map.items()}


@dataclass
class Checkpoint:
    """A checkpoint directory: its config, and every tensor's header entry by name."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, SourceTensor]
    files: list[str]
    identities: dict[str, FileIdentity] = field(default_factory=dict)
    """Each shard as its header was read: :class:`ShardReader` refuses one that changed since."""

    @property
    def model_type(self) -> str | None:
        mt = self.config.get("model_type")
        return mt if isinstance(mt, str) else None

    @property
    def config_hash(self) -> str:
        # Keys that describe the writer, not the model (transformers_version, _name_or_path...)
        # would give the same weights a new hash after a library upgrade.
        return config_hash({k: v for k, v in self.config.items()
                            if not k.startswith("_") and k != "transformers_version"})

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def model_id(self) -> str:
        """``_name_or_path`` from the config when it names a hub id, else the directory name
        (the snapshot's repo for a hub cache path ``models--org--name/snapshots/REV``)."""
        m = re.search(r"models--([^/]+)--([^/]+)/snapshots/[^/]+/?$", str(self.path.resolve()))
        if m:
            return f"{m.group(1)}/{m.group(2)}"
        name = self.config.get("_name_or_path")
        if isinstance(name, str) and name and not os.path.isabs(name) and not name.startswith("."):
            return name
        return self.path.resolve().name

    def revision(self) -> str | None:
        """The snapshot hash for a hub cache path, else the fingerprint of the directory's weight
        files (:func:`checkpoint_fingerprint`): a local directory has no commit, and two of one
        model and config (``step-1000/``, ``step-2000/``, whose ``_name_or_path`` both name the
        base model) had one image key, so a clone expecting one took the other's seed."""
        m = re.search(r"/snapshots/([0-9a-f]{7,64})/?$", str(self.path.resolve()))
        return m.group(1) if m else checkpoint_fingerprint(self.path)

    def read(self, name: str, handles: dict):
        """One tensor as a torch tensor, through ``safe_open`` (``handles`` caches open files)."""
        from safetensors import safe_open

        src = self.tensors[name]
        f = handles.get(src.file)
        if f is None:
            try:
                f = handles[src.file] = safe_open(str(self.path / src.file), framework="pt")
            except Exception as exc:  # safetensors raises its own SafetensorError
                raise LayoutError(f"{self.path / src.file}: safetensors refused the file: {exc}") from exc
        t = f.get_tensor(name)
        if tuple(t.shape) != src.shape:
            raise LayoutError(f"{self.path / src.file}: tensor {name!r} read back with shape {list(t.shape)}, "
                              f"header says {list(src.shape)}")
        return t


WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


FINGERPRINT_SAMPLES = 4
FINGERPRINT_SAMPLE_BYTES = 64 << 10
"""A weight file is fingerprinted by this many reads of this many bytes spread over it (start,
thirds, end): 2 MiB for 8 shards, a few ms, where hashing the weights would be a full read at
every engine start. Two training steps of one model differ nearly everywhere."""
FINGERPRINT_PREFIX = "local-sha256:"


def checkpoint_fingerprint(path: str | os.PathLike) -> str | None:
    """``local-sha256:...`` of a local checkpoint directory's weights: each weight file's name and
    size, :data:`FINGERPRINT_SAMPLES` samples of its bytes, and the bytes of its ``*.index.json``
    files. No mtimes, no paths: a copy (``cp``, ``rsync``, a download to ``--local-dir``) keeps
    it, so an image packed on one node loads on another. None for a directory without weight
    files (a load node that ships ``config.json`` alone)."""
    h = hashlib.sha256()
    weights = 0
    for entry in sorted(Path(path).iterdir(), key=lambda p: p.name):
        is_index = entry.name.endswith(".index.json")
        if not (is_index or entry.name.endswith(WEIGHT_FILE_SUFFIXES)):
            continue
        try:
            if is_index:
                blob, size = read_regular(entry, MAX_CHECKPOINT_JSON_BYTES), None
            else:
                with open_regular(entry) as f:
                    size = os.fstat(f.fileno()).st_size
                    last = max(0, size - FINGERPRINT_SAMPLE_BYTES)
                    blob = b"".join(os.pread(f.fileno(), FINGERPRINT_SAMPLE_BYTES, last * k // (FINGERPRINT_SAMPLES - 1))
                                    for k in range(FINGERPRINT_SAMPLES))
        except OSError as exc:
            raise LayoutError(f"{entry}: unreadable checkpoint file ({exc}); a local checkpoint's revision is a "
                              "fingerprint of its weights") from None
        h.update(json.dumps([entry.name, size]).encode() + b"\0" + blob + b"\0")
        weights += not is_index
    if not weights:
        return None
    return FINGERPRINT_PREFIX + h.hexdigest()


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read ``config.json`` and all safetensors headers of ``path``; validate before any data.

    Raises LayoutError for: no safetensors files, an unsupported dtype (naming tensor, file and
    dtype), two tensors sharing bytes within a file, one name in two files, and an index
    (``model.safetensors.index.json``) naming a file or tensor that is not there.
    """
    path = Path(path)
    if not path.is_dir():
        raise LayoutError(f"{path}: not a directory (expected a Hugging Face checkpoint directory)")
    config: dict[str, Any] = {}
    cfg_path = path / "config.json"
    if cfg_path.exists() or cfg_path.is_symlink():
        config = read_config(cfg_path)
    index_path = path / "model.safetensors.index.json"
    weight_map: dict[str, str] | None = None
    if index_path.exists() or index_path.is_symlink():
        index = _read_json(index_path, "the shard index")
        if not isinstance(index, dict) or "weight_map" not in index:
            raise LayoutError(f"{index_path}: no weight_map object")
        weight_map = _index_shards(index["weight_map"], index_path)
        files = sorted(set(weight_map.values()))
        for f in files:
            _refuse_dangling(path / f, f"a shard {index_path.name} names")
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise LayoutError(f"{index_path}: names shard(s) {missing} that do not exist in {path}")
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise LayoutError(f"{index_path}: its weight_map names no tensor" if weight_map is not None
                          else f"{path}: no .safetensors files{_hub_repo_hint(path)}")
    tensors: dict[str, SourceTensor] = {}
    identities: dict[str, FileIdentity] = {}
    bad_dtypes = []
    for fname in files:
        header, identities[fname] = _read_header(path / fname)
        for name, info in header.items():
            if name in tensors:
                raise LayoutError(f"{path}: tensor {name!r} is in two shards ({tensors[name].file} and {fname}); "
                                  "aliased or duplicated tensors are not supported")
            start, end = info["data_offsets"]
            st_dtype = info["dtype"]
            d = DTYPES_BY_SAFETENSORS.get(st_dtype)
            if d is None:
                bad_dtypes.append(f"{name} ({st_dtype}, in {fname})")
                continue
            numel = 1
            for n in info["shape"]:
                numel *= n
            if numel * d.itemsize != end - start:
                raise LayoutError(f"{path / fname}: tensor {name!r} shape {info['shape']} {d.name} needs "
                                  f"{numel * d.itemsize:,} bytes, header gives {end - start:,}")
            tensors[name] = SourceTensor(name, fname, d.name, tuple(info["shape"]), start, end - start)
    if bad_dtypes:
        raise LayoutError(f"{path}: unsupported dtype in {len(bad_dtypes)} tensor(s): {', '.join(bad_dtypes[:8])}"
                          f"{' ...' if len(bad_dtypes) > 8 else ''}; supported: {', '.join(DTYPES)}")
    if weight_map is not None:
        for name, fname in weight_map.items():
            t = tensors.get(name)
            if t is None or t.file != fname:
                raise LayoutError(f"{index_path}: maps {name!r} to {fname}, but "
                                  f"{'no shard holds it' if t is None else 'it is in ' + t.file}")
    return Checkpoint(path, config, tensors, files, identities)


# ================================================================================ batched reads
DEFAULT_BATCH_BYTES = 64 << 20
"""Bytes per read: large sequential reads keep the disk's queue full (dd bs=16M reaches its rate)."""
_ALIGN = 4096
"""O_DIRECT wants offsets, lengths and buffers aligned to the logical block size (<= 4096)."""


@dataclass(frozen=True)
class ReadBatch:
    """Consecutive tensors of one shard, read with one ``pread`` of bytes ``[start, end)``."""

    file: str
    start: int
    end: int
    names: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def plan_reads(ckpt: Checkpoint, names: list[str], batch_bytes: int = DEFAULT_BATCH_BYTES) -> list[ReadBatch]:
    """Group ``names`` (in file order: by shard, then data offset) into batches of consecutive
    tensors of about ``batch_bytes``; a larger tensor is a batch of its own. A gap of unused
    bytes between two tensors larger than a quarter batch starts a new batch (it is not read)."""
    batches: list[ReadBatch] = []
    cur: list[str] = []
    file, start, end = "", 0, 0
    for name in names:
        t = ckpt.tensors[name]
        t_end = t.data_start + t.nbytes
        if cur and t.file == file and t.data_start >= end and t.data_start - end <= batch_bytes // 4 \
                and t_end - start <= batch_bytes:
            cur.append(name)
            end = t_end
            continue
        if cur:
            batches.append(ReadBatch(file, start, end, tuple(cur)))
        cur, file, start, end = [name], t.file, t.data_start, t_end
    if cur:
        batches.append(ReadBatch(file, start, end, tuple(cur)))
    return batches


class ShardReader:
    """Reads :class:`ReadBatch` byte ranges of a checkpoint's shards, from any number of threads.

    ``io``: ``auto`` (O_DIRECT, reading the 4096-aligned range around the batch into an aligned
    buffer; buffered where the filesystem refuses it, e.g. tmpfs), ``direct`` or ``buffered``.
    :attr:`modes` says, per file, which was used and why. :meth:`close` closes the files.

    ``expect`` (:attr:`Checkpoint.identities`): the files as their headers were read. A file
    opened here that is another one (replaced: a re-save, a new download) or was modified since
    is refused, and :meth:`check_unchanged` refuses one modified while it was read: the header's
    offsets had been applied to the new bytes, and an image of other tensors' bytes (or of the
    new header's text) written without a word.
    """

    def __init__(self, root: str | os.PathLike, io: str = "auto", *, expect: dict[str, FileIdentity] | None = None):
        if io not in ("auto", "direct", "buffered"):
            raise LayoutError(f"io must be auto, direct or buffered, got {io!r}")
        self.root, self.io = Path(root), io
        self.expect = dict(expect or {})
        self._fds: dict[str, tuple[int, bool]] = {}
        self.modes: dict[str, str] = {}
        self._lock = threading.Lock()

    def _fd(self, file: str, *, refused: str = "") -> tuple[int, bool]:
        with self._lock:
            have = self._fds.get(file)
            if have is not None and not (refused and have[1]):
                return have
            path = self.root / file
            if have is not None:  # O_DIRECT reads refused: reopen buffered
                os.close(have[0])
            direct = self.io != "buffered" and not refused
            fd = -1
            if direct:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    self.modes[file] = "o_direct"
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise LayoutError(f"{path}: cannot open ({exc.strerror})") from None
                    refused = "the filesystem refuses O_DIRECT (open: EINVAL)"
                    direct = False
            if not direct:
                if refused and self.io == "direct":
                    raise LayoutError(f"{path}: {refused} and io='direct' was asked")
                fd = os.open(path, os.O_RDONLY)
                self.modes[file] = f"buffered ({refused})" if refused else "buffered (asked)"
            self._fds[file] = (fd, direct)
            self._check(file, fd, "since its header was read")
            return fd, direct

    def _check(self, file: str, fd: int, when: str) -> None:
        want = self.expect.get(file)
        if want is None:
            return
        got = FileIdentity.of(want.path, os.fstat(fd))
        if got.key == want.key:
            return
        path = self.root / file
        if (got.dev, got.ino) != (want.dev, want.ino):
            what = "was replaced by another file"
        else:
            what = f"was modified ({want.size:,} bytes -> {got.size:,}, mtime {want.mtime_ns} -> {got.mtime_ns} ns)"
        raise LayoutError(f"{path}: {what} {when}; the bytes read no longer match its header (a re-save or a "
                          "download into the checkpoint meanwhile?): nothing was committed, pre-pack it again")

    def release(self, file: str) -> None:
        """Close ``file`` once every read of it is done, checking first that it did not change
        while it was read: a checkpoint of more shards than the process may hold open files
        (1,024 by default) had failed at the 1,018th with EMFILE."""
        with self._lock:
            have = self._fds.pop(file, None)
            if have is None:
                return
            try:
                self._check(file, have[0], "while it was read")
            finally:
                os.close(have[0])

    def check_unchanged(self) -> None:
        """LayoutError naming the first file opened here that changed since its header was read
        (call it once every read is done: the bytes read are then the header's)."""
        with self._lock:
            for file, (fd, _) in self._fds.items():
                self._check(file, fd, "while it was read")

    def read(self, batch: ReadBatch):
        """The batch's bytes as a uint8 numpy array: tensor ``t`` is at ``t.data_start - batch.start``."""
        import numpy as np

        fd, direct = self._fd(batch.file)
        try:
            return self._read(fd, direct, batch, np)
        except DirectReadRefused as exc:
            fd, direct = self._fd(batch.file, refused=f"the filesystem refuses O_DIRECT reads ({exc})")
            return self._read(fd, direct, batch, np)

    def _read(self, fd: int, direct: bool, batch: ReadBatch, np):
        lo = batch.start // _ALIGN * _ALIGN if direct else batch.start
        need = batch.end - lo
        ask = -(-need // _ALIGN) * _ALIGN if direct else need
        buf = io_buffer(ask)
        view = memoryview(buf)
        try:
            read_exactly(fd, view[:ask], lo, need, direct=direct, path=str(self.root / batch.file),
                         file_nbytes=batch.end, preadv=os.preadv)
        finally:
            view.release()
        return np.frombuffer(buf, np.uint8, count=batch.nbytes, offset=batch.start - lo)

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
