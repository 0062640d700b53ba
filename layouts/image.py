"""Reading, verifying and writing pre-packed images.

The reader is strict: :func:`read_image_metadata` checks the metadata (version, dtypes,
alignment, regions, bounds, overlaps, checksum table, key), the image file's size, and the
rank / tp / ep / key the caller expects, all before a byte of the image is read.
:func:`verify_image` then recomputes the chunk checksums.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import operator
import os
import re
import stat
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from flashboot._json import loads
from flashboot.errors import ChecksumMismatchError, LayoutError
from flashboot.fileio import open_regular, read_regular

from .format import (
    FORMAT_VERSION, IMAGE_FILE, JOB_FILE, JOB_FORMAT_NAME, METADATA_FILE, ChecksumTable, ImageKey, ImageMetadata,
    TensorEntry, _Fields, parse_metadata,
)
from .table import TABLE_FILE, run_beside, sha256_beside, tables_agree

_RANK_DIR = re.compile(r"^rank-(\d+)$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
MAX_TABLE_FILE_BYTES = 1 << 30
"""The most ``metadata.json`` or ``tensors.bin`` may hold: each is read whole into memory, and a
million tensors take ~250 MB of either; a larger one is refused before it is read."""
MAX_JOB_FILE_BYTES = 64 << 20
"""The most ``prepack.json`` may hold (a line per rank)."""


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank}"


# ------------------------------------------------------------------------------------- the job
@dataclass(frozen=True)
class JobInfo:
    """``prepack.json``: the job's ranks and key. Written last: its presence marks a complete job."""

    path: Path
    job_id: str
    world_size: int
    tp_size: int
    ep_size: int
    key: ImageKey
    ranks: dict[int, str]
    """Rank -> its directory name under the job directory."""
    raw: dict
    metadata_sha256: dict[int, str]
    """Rank -> hex sha256 of the ``metadata.json`` the pre-pack wrote for it (tamper evidence)."""


def read_job(path: str | os.PathLike) -> JobInfo:
    """Parse ``DIR/prepack.json``. LayoutError if it is missing (an interrupted or never-run
    pre-pack) or malformed."""
    path = require_image_dir(path)
    job_path = path / JOB_FILE
    if not job_path.is_file():
        leftovers = sorted(p.name for p in path.glob(".tmp-*")) if path.is_dir() else []
        hint = (f" ({len(leftovers)} unfinished temporary dir(s) {leftovers[:2]}: the pre-pack was interrupted; "
                "re-run flashboot prepack)" if leftovers else "")
        raise LayoutError(f"{path}: no {JOB_FILE}: not a complete pre-packed image directory{hint}")
    where = str(job_path)
    raw = loads(read_regular(job_path, MAX_JOB_FILE_BYTES), where, LayoutError)
    f = _Fields(raw, where, "")
    if f.get("format", str) != JOB_FORMAT_NAME:
        raise LayoutError(f"{where}: format {raw.get('format')!r} is not {JOB_FORMAT_NAME!r}")
    version = f.int("format_version")
    if version != FORMAT_VERSION:
        raise LayoutError(f"{where}: format version {version}; this flashboot reads version {FORMAT_VERSION}")
    ranks, digests = {}, {}
    for i, r in enumerate(f.get("ranks", list)):
        rf = _Fields(r, where, f"ranks[{i}]")
        rank, name, sha = rf.int("rank"), rf.get("dir", str), rf.get("metadata_sha256", str)
        if not _RANK_DIR.match(name):
            raise LayoutError(f"{where}: ranks[{i}].dir {name!r} is not a rank directory name (rank-N)")
        if not _SHA256_HEX.match(sha):
            raise LayoutError(f"{where}: ranks[{i}].metadata_sha256 must be 64 hex digits, found {sha!r}")
        if rank in ranks:
            raise LayoutError(f"{where}: rank {rank} is listed twice")
        ranks[rank], digests[rank] = name, sha
    world = f.int("world_size", minimum=1)
    if len(ranks) != world or sorted(ranks) != list(range(world)):  # len first: world may be 2**62
        raise LayoutError(f"{where}: lists ranks {sorted(ranks)} for world_size {world}")
    return JobInfo(path, f.get("job_id", str), world, f.int("tp_size", minimum=1), f.int("ep_size", minimum=1),
                   ImageKey.from_dict(f.sub("key")), ranks, raw, digests)


def require_image_dir(path: str | os.PathLike) -> Path:
    """``path`` as a Path when it is a directory; else the one LayoutError every command gives for
    an image directory that is not there."""
    path = Path(path)
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such image directory"
        raise LayoutError(f"{path}: {what}")
    return path


def resolve_rank(path: str | os.PathLike, rank: int | None) -> tuple[Path, JobInfo | None]:
    """The rank directory to read, and the job it belongs to (None for a lone rank directory):
    what :func:`read_metadata_file` reads first, for a caller that checks the job before it."""
    # links resolved once: a deployment that flips a link to another image while a load reads
    # this one must not give it one image's metadata and the other's bytes
    if rank is not None:
        # "0" had been reported as a rank the image lacks ("rank 0 requested, the image has ranks 0..1")
        if isinstance(rank, bool) or not hasattr(type(rank), "__index__") or operator.index(rank) < 0:
            raise LayoutError(f"{path}: rank must be an int >= 0, got {rank!r} ({type(rank).__name__})")
        rank = operator.index(rank)
    path = Path(os.path.realpath(path))
    if (path / METADATA_FILE).is_file():
        parent_job = path.parent / JOB_FILE
        return path, (read_job(path.parent) if parent_job.is_file() else None)
    job = read_job(path)
    if rank is None:
        if job.world_size != 1:
            raise LayoutError(f"{path}: holds {job.world_size} ranks (tp={job.tp_size}, ep={job.ep_size}); "
                              "say which rank to read")
        rank = 0
    if rank not in job.ranks:
        raise LayoutError(f"{path}: rank {rank} requested, the image has ranks 0..{job.world_size - 1} "
                          f"(tp={job.tp_size}, ep={job.ep_size})")
    rank_dir = path / job.ranks[rank]
    if not (rank_dir / METADATA_FILE).is_file():
        raise LayoutError(f"{rank_dir}: missing {METADATA_FILE} (incomplete image)")
    return rank_dir, job


# ---------------------------------------------------------------------------------- the reader
@dataclass(frozen=True)
class MetadataFile:
    """One rank's ``metadata.json`` as read from disk, not parsed yet: the rank directory, the
    job it belongs to (None for a lone rank directory) and the file's bytes."""

    rank_dir: Path
    job: JobInfo | None
    raw: bytes
    table: bytes | None = None
    """The ``tensors.bin`` beside it (:mod:`flashboot.layouts.table`), None when there is none."""
    raw_sha256: str | None = field(default=None, repr=False, compare=False)
    """:attr:`sha256` where the reader hashed ``raw`` already."""
    decoded: Any = field(default=None, repr=False, compare=False)
    """The table's :func:`~flashboot.layouts.table.predecode_table`, where the reader made it."""

    @property
    def where(self) -> str:
        return str(self.rank_dir / METADATA_FILE)

    @functools.cached_property
    def sha256(self) -> str:
        """Hex sha256 of the bytes: what identifies this metadata to the preloader (``.ready``)."""
        return self.raw_sha256 or hashlib.sha256(self.raw).hexdigest()


def read_metadata_file(path: str | os.PathLike, rank: int | None = None, *, decode: bool = False,
                       resolved: tuple[Path, JobInfo | None] | None = None) -> MetadataFile:
    """Find rank ``rank``'s ``metadata.json`` under ``path`` (see :func:`read_image_metadata`) and
    read its bytes. Checks the job file, that the rank exists and, where a job file is found,
    that the bytes are the ones the pre-pack wrote (:func:`check_metadata_digest`); parses
    nothing else, unless ``decode`` (for a caller that opens the image next): then the binary
    table's columns are decoded while ``metadata.json`` is read and hashed in a thread (the
    file's read and hashlib release the GIL). For 40,250 tensors that is 6.6 MB read and hashed
    (~10 ms) beside ~20 ms of decoding, which came after it. Errors are raised in the order of
    :func:`open_image`: the metadata's digest first, then the table's own. ``resolved``: what
    :func:`resolve_rank` returned for ``path`` and ``rank``, where the caller has it already."""
    if decode:
        return begin_metadata_read(path, rank, resolved=resolved).finish()
    rank_dir, job = resolved if resolved is not None else resolve_rank(path, rank)
    raw = read_regular(rank_dir / METADATA_FILE, MAX_TABLE_FILE_BYTES)
    digest = sha256_beside(raw)  # 6.6 MB for 40,000 tensors: hashed while tensors.bin is read
    table = _read_table(rank_dir / TABLE_FILE)
    return _checked(MetadataFile(rank_dir, job, raw, table, digest(), None))


class PendingMetadata:
    """:func:`read_metadata_file` with ``decode``, started: both files are read (and
    ``metadata.json`` hashed) in threads, which release the GIL, so the caller can do other work
    that does too (create an arena, ask the daemon for a copy) before :meth:`finish` decodes the
    table and waits for the rest. ``beside=False``: no threads; :meth:`finish` opens, reads,
    hashes and decodes in its own thread, one after the other (the early call's background thread, beside
    an engine's Python: every thread started or joined there is one more wait for the GIL, and
    nothing waits for its reads)."""

    def __init__(self, rank_dir: Path, job: JobInfo | None, *, beside: bool = True):
        self.rank_dir, self.job, self.beside = rank_dir, job, beside
        table_path = rank_dir / TABLE_FILE
        if beside:
            self._meta_nbytes, self._read_json = _read_and_hash_beside(rank_dir / METADATA_FILE)
            self._table = run_beside(lambda: _read_table(table_path), f"{table_path}: reading")
        else:  # finish() opens and reads both
            self._table = functools.partial(_read_table, table_path)

    def finish(self) -> MetadataFile:
        """The :class:`MetadataFile`, its table's columns decoded (:func:`predecode_table`) while
        ``metadata.json`` is still being read and hashed; the job's digest checked."""
        if not self.beside:
            meta = open_regular(self.rank_dir / METADATA_FILE, max_bytes=MAX_TABLE_FILE_BYTES)
            self._meta_nbytes = os.fstat(meta.fileno()).st_size
            self._read_json = functools.partial(_read_and_hash, meta)
        table, decoded = self._table(), None
        if table is not None:
            from .table import predecode_table

            decoded = predecode_table(table, str(self.rank_dir / TABLE_FILE), self._meta_nbytes, beside=self.beside)
        raw, sha = self._read_json()
        return _checked(MetadataFile(self.rank_dir, self.job, raw, table, sha, decoded))


def begin_metadata_read(path: str | os.PathLike, rank: int | None = None, *,
                        resolved: tuple[Path, JobInfo | None] | None = None, beside: bool = True) -> PendingMetadata:
    """Start :func:`read_metadata_file` with ``decode``; :meth:`PendingMetadata.finish` ends it.
    A missing rank or ``metadata.json`` is raised here, in the caller's thread. ``beside``: as
    :class:`PendingMetadata`'s."""
    rank_dir, job = resolved if resolved is not None else resolve_rank(path, rank)
    return PendingMetadata(rank_dir, job, beside=beside)


def _read_table(path: Path) -> bytes | None:
    try:
        return read_regular(path, MAX_TABLE_FILE_BYTES)
    except FileNotFoundError:
        return None


def _checked(mf: MetadataFile) -> MetadataFile:
    if mf.job is not None:
        check_metadata_digest(mf)
    return mf


def _read_and_hash_beside(path: Path) -> tuple[int, Callable[[], tuple[bytes, str]]]:
    """``path``'s size when opened, and the call that waits for its bytes and their hex sha256,
    read and hashed in a thread (:func:`~flashboot.layouts.table.run_beside`)."""
    # opened here: a missing file is raised in the caller's thread
    f = open_regular(path, max_bytes=MAX_TABLE_FILE_BYTES)
    nbytes = os.fstat(f.fileno()).st_size
    try:
        return nbytes, run_beside(functools.partial(_read_and_hash, f), f"{path}: reading and hashing {nbytes:,} bytes")
    except BaseException:  # the thread that would have closed it never started
        f.close()
        raise


def _read_and_hash(f) -> tuple[bytes, str]:
    """The bytes of the open file ``f`` (closed after) and their hex sha256."""
    with f:
        raw = f.read()
    return raw, hashlib.sha256(raw).hexdigest()


def check_metadata_digest(mf: MetadataFile) -> None:
    """LayoutError naming the rank and both digests where ``mf``'s bytes are not the ones its job's
    ``prepack.json`` recorded: an edited or damaged tensor table (a tensor removed, an offset,
    shape or count changed) is refused before it is parsed and before any image byte is read."""
    job = mf.job
    ranks = [r for r, name in job.ranks.items() if name == mf.rank_dir.name]
    if not ranks:
        raise LayoutError(f"{mf.rank_dir}: {job.path / JOB_FILE} lists no rank in a directory named "
                          f"{mf.rank_dir.name!r} (it lists {sorted(job.ranks.values())})")
    rank, recorded = ranks[0], job.metadata_sha256[ranks[0]]
    if mf.sha256 != recorded:
        raise LayoutError(f"{mf.where}: rank {rank}'s metadata has sha256 {mf.sha256}, but {job.path / JOB_FILE} "
                          f"records {recorded}: the metadata was edited or damaged after the pre-pack; refused "
                          "before any image byte was read (re-run flashboot prepack)")


def open_image(mf: MetadataFile, rank: int | None = None, *, tp: int | None = None, ep: int | None = None,
               expected_key: ImageKey | Mapping[str, Any] | None = None) -> "Image":
    """Parse and validate ``mf`` (the strict reader, see :func:`read_image_metadata`) and check it
    against the caller's rank, tp, ep and key, the job and the image file's size."""
    where = mf.where
    meta = parse_metadata(mf.raw, where, mf.table, str(mf.rank_dir / TABLE_FILE),
                          mf.sha256 if mf.table is not None else None, mf.decoded)
    check_request(meta, where, rank=rank, tp=tp, ep=ep)
    job = mf.job
    if job is not None:
        if job.job_id != meta.job_id:
            raise LayoutError(f"{where}: written by pre-pack job {meta.job_id}, but {job.path / JOB_FILE} is job "
                              f"{job.job_id} (mixed or half-replaced image; re-run flashboot prepack)")
        if job.key.digest != meta.key.digest:
            raise LayoutError(f"{where}: key {meta.key.describe()} differs from the job's {job.key.describe()}")
    check_request(meta, where, expected_key=expected_key)
    image_path = mf.rank_dir / meta.image_file
    try:
        st = image_path.stat()
    except OSError as exc:
        raise LayoutError(f"{image_path}: image file missing or unreadable ({exc.strerror}; metadata expects "
                          f"{meta.image_nbytes:,} bytes)") from None
    if not stat.S_ISREG(st.st_mode):
        raise LayoutError(f"{image_path}: not a regular file (metadata expects {meta.image_nbytes:,} bytes)")
    size = st.st_size
    if size != meta.image_nbytes:
        cs = meta.checksums
        chunk = min(size, meta.image_nbytes) // cs.chunk_bytes
        start, nbytes = cs.chunk_range(chunk, meta.image_nbytes)
        what = "truncated" if size < meta.image_nbytes else "longer than recorded"
        raise LayoutError(f"{image_path}: {what}: metadata expects {meta.image_nbytes:,} bytes, the file has "
                          f"{size:,} (first chunk affected: {chunk}, bytes {start:,}..{start + nbytes:,})")
    return Image(mf.rank_dir, meta, metadata_file=mf, file_identity=FileIdentity.of(image_path, st))


@dataclass(frozen=True)
class FileIdentity:
    """Which file an image's bytes are, as its metadata was validated against it: a reader
    compares the file it opens (and, after reading, the same file again) with this, so bytes
    the metadata does not describe are refused, not loaded: another file put in its place, or
    the file rewritten in place while it was read. Device, inode, size and mtime: what an
    ordinary write or replacement changes (as :class:`~flashboot.flashload.prepared.PreparedLoad`
    checks between prepare and load)."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path, st: os.stat_result | None = None) -> "FileIdentity":
        """``path``'s identity from ``st`` (default: ``os.stat(path)`` now)."""
        st = os.stat(path) if st is None else st
        return cls(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    @property
    def key(self) -> tuple[int, int, int, int]:
        return self.dev, self.ino, self.size, self.mtime_ns

    def check(self, st: os.stat_result, when: str) -> None:
        """LayoutError unless ``st`` (an ``os.fstat`` of the file opened) is this file, unchanged."""
        now, seen = FileIdentity.of(self.path, st).key, self.key
        if now != seen:
            raise LayoutError(f"{self.path} changed {when} (device, inode, size, mtime_ns {seen} -> {now}): another "
                              "file took its place or it was written to; its bytes are not the ones its metadata "
                              "describes, and nothing was loaded")


def check_request(meta: ImageMetadata, where: str, *, rank: int | None = None, tp: int | None = None,
                  ep: int | None = None, expected_key: ImageKey | Mapping[str, Any] | None = None) -> None:
    """LayoutError, naming both sides, where ``meta`` is not the rank, tp, ep or key the caller asks for."""
    p = meta.parallel
    if rank is not None and p.rank != rank:
        raise LayoutError(f"{where}: holds rank {p.rank} of {p.world_size}, rank {rank} was requested")
    if tp is not None and tp != p.tp_size:
        raise LayoutError(f"{where}: packed for tp={p.tp_size} (rank {p.rank} of {p.world_size}), "
                          f"requested tp={tp}")
    if ep is not None and ep != p.ep_size:
        raise LayoutError(f"{where}: packed for ep={p.ep_size} (rank {p.rank} of {p.world_size}), "
                          f"requested ep={ep}")
    check_key(meta.key, where, expected_key)


def check_key(key: ImageKey, where: str, expected_key: ImageKey | Mapping[str, Any] | None) -> None:
    """LayoutError naming each differing field where ``key`` is not ``expected_key`` (None: no check)."""
    if expected_key is None:
        return
    diffs = key.mismatches(expected_key)
    if diffs:
        detail = "; ".join(f"{k}: expected {want!r}, image has {have!r}" for k, want, have in diffs)
        raise LayoutError(f"{where}: image of {key.describe()} is not the expected model ({detail})")


def read_image_metadata(path: str | os.PathLike, rank: int | None = None, *, tp: int | None = None,
                        ep: int | None = None, expected_key: ImageKey | Mapping[str, Any] | None = None
                        ) -> ImageMetadata:
    """Read and validate one rank's ``metadata.json`` and check it against its image file.

    ``path`` is a job directory (``prepack.json`` + ``rank-R/``; pass ``rank`` unless the job
    has one rank) or one rank's directory. ``tp``/``ep`` and ``expected_key`` (an
    :class:`ImageKey` or a mapping of some of its fields) are what the caller will load for;
    any disagreement raises LayoutError naming both sides. Reads no image byte.
    """
    return read_image(path, rank, tp=tp, ep=ep, expected_key=expected_key).metadata


class Image:
    """One rank's validated image: its metadata, tensor table and the file's bytes.

    ``mmap()`` maps the file privately (copy-on-write: writes never reach the file), and
    :meth:`view` gives a zero-copy torch view of a tensor at its recorded offset, shape,
    stride and dtype over that mapping or any other buffer laid out like the image.
    """

    def __init__(self, dir: Path, metadata: ImageMetadata, *, metadata_file: MetadataFile | None = None,
                 file_identity: FileIdentity | None = None):
        self.dir = dir
        self.metadata = metadata
        self.path = dir / metadata.image_file
        self.file_identity = file_identity
        """The image file as validated (None where the image was made from metadata alone)."""
        self._mmap: mmap.mmap | None = None
        self._metadata_file = metadata_file

    @property
    def metadata_path(self) -> Path:
        return self.dir / METADATA_FILE

    @property
    def table_source(self) -> str:
        """Where the tensor table was read from: ``tensors.bin`` (the binary columns) or ``metadata.json``."""
        mf = self._metadata_file
        return TABLE_FILE if mf is not None and mf.table is not None else METADATA_FILE

    def _metadata(self) -> MetadataFile:
        """The ``metadata.json`` this image was validated from (read now where the image was made
        from parsed metadata alone)."""
        if self._metadata_file is None:
            raw = read_regular(self.dir / METADATA_FILE, MAX_TABLE_FILE_BYTES)
            self._metadata_file = MetadataFile(self.dir, None, raw)
        return self._metadata_file

    @property
    def metadata_bytes(self) -> bytes:
        """The ``metadata.json`` bytes this image was validated from."""
        return self._metadata().raw

    @property
    def metadata_sha256(self) -> str:
        """Hex sha256 of the ``metadata.json`` bytes this image was validated from."""
        return self._metadata().sha256

    @property
    def tensors(self) -> dict[str, TensorEntry]:
        return self.metadata.tensors

    @property
    def nbytes(self) -> int:
        return self.metadata.image_nbytes

    @property
    def rank(self) -> int:
        return self.metadata.parallel.rank

    def open(self):
        """The image file, opened for binary reading (the caller closes it)."""
        return open_regular(self.path)

    def mmap(self) -> mmap.mmap:
        if self._mmap is None:
            if self.nbytes == 0:
                raise LayoutError(f"{self.path}: empty image, nothing to map")
            with open_regular(self.path) as f:
                self._mmap = mmap.mmap(f.fileno(), self.nbytes, access=mmap.ACCESS_COPY)
        return self._mmap

    def view(self, name: str, buffer=None):
        """Tensor ``name`` as a torch view into ``buffer`` (default: this image's mapping)."""
        import torch

        t = self.tensors.get(name)
        if t is None:
            raise LayoutError(f"{self.path}: no tensor {name!r} in the image ({len(self.tensors)} tensors)")
        dtype = getattr(torch, t.dtype)
        if t.nbytes == 0:
            return torch.empty(t.shape, dtype=dtype)
        raw = torch.frombuffer(self.mmap() if buffer is None else buffer, dtype=torch.uint8,
                               count=t.nbytes, offset=t.offset)
        return raw.view(dtype).as_strided(t.shape, t.stride)

    def close(self) -> None:
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # views still alive keep the mapping; it goes when they do
            self._mmap = None

    def __enter__(self) -> "Image":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        p = self.metadata.parallel
        return (f"Image({str(self.dir)!r}, rank={p.rank}/{p.world_size}, {self.nbytes:,} bytes, "
                f"{len(self.tensors)} tensors)")


def read_image(path: str | os.PathLike, rank: int | None = None, *, tp: int | None = None, ep: int | None = None,
               expected_key: ImageKey | Mapping[str, Any] | None = None) -> Image:
    """The validated :class:`Image` of ``rank`` (see :func:`read_image_metadata`)."""
    return open_image(read_metadata_file(path, rank, decode=True), rank, tp=tp, ep=ep, expected_key=expected_key)


def image_ranks(path: str | os.PathLike) -> list[int]:
    """The ranks of a job directory, or ``[rank]`` of a rank directory."""
    path = Path(path)
    if (path / METADATA_FILE).is_file():
        return [read_image_metadata(path).parallel.rank]
    return sorted(read_job(path).ranks)


# ---------------------------------------------------------------------------------- verify
@dataclass(frozen=True)
class VerifyResult:
    rank: int
    path: Path
    nbytes: int
    chunks: int


def verify_image(path: str | os.PathLike, rank: int | None = None, *, progress: bool = False) -> list[VerifyResult]:
    """Recompute every chunk checksum of one rank (or, ``rank=None`` on a job directory, of all
    ranks) and compare with the metadata, after comparing ``tensors.bin`` with the JSON table entry
    by entry. Raises ChecksumMismatchError naming the first bad
    chunk (rank, chunk index, byte range), LayoutError for anything the strict reader refuses."""
    from flashboot.kernels.checksum import checksum_host

    path = Path(path)
    if rank is None and not (path / METADATA_FILE).is_file():
        ranks = sorted(read_job(path).ranks)
    else:
        ranks = [rank]
    images = [read_image(path, r) for r in ranks]  # all metadata checked before any byte is read
    for im in images:  # the binary table must say what metadata.json says, entry by entry
        if im.table_source == TABLE_FILE:
            json_table = parse_metadata(im.metadata_bytes, str(im.metadata_path)).tensors
            diff = tables_agree(im.metadata.tensors, json_table)
            if diff is not None:
                raise LayoutError(f"{im.dir / TABLE_FILE} disagrees with {im.metadata_path}: {diff}")
    total = sum(im.nbytes for im in images)
    results = []
    bar = _progress(progress)
    with bar:
        task = bar.add_task("verify", total=total) if bar else None
        for im in images:
            cs: ChecksumTable = im.metadata.checksums
            buf = bytearray(min(cs.chunk_bytes, im.nbytes))
            with im.open() as f:
                # the file its metadata was checked against: one a re-pre-pack put in its place
                # meanwhile had been reported as corrupt (a checksum mismatch)
                _check_verified(im, f, "since its metadata was read")
                for k, expected in enumerate(cs.digests):
                    start, nbytes = cs.chunk_range(k, im.nbytes)
                    view = memoryview(buf)[:nbytes]
                    got = f.readinto(view)
                    if got != nbytes:  # the file shrank after the size check
                        raise LayoutError(f"{im.path}: chunk {k} (bytes {start:,}..{start + nbytes:,}): read "
                                          f"{got:,} of {nbytes:,} bytes (file truncated)")
                    found = checksum_host(view)
                    view.release()
                    if found != expected:
                        raise ChecksumMismatchError(f"{im.path} (rank {im.rank})", k, start, nbytes, expected, found)
                    if bar:
                        bar.update(task, advance=nbytes)
                _check_verified(im, f, "while it was verified")
            results.append(VerifyResult(im.rank, im.path, im.nbytes, len(cs.digests)))
    return results


def _check_verified(im: Image, f, when: str) -> None:
    """LayoutError (not a checksum mismatch: no byte was found damaged) where the image file
    open as ``f`` is not the one ``im`` was validated against, or was written to."""
    want = im.file_identity
    got = FileIdentity.of(im.path, os.fstat(f.fileno()))
    if want is not None and got.key != want.key:
        raise LayoutError(f"{im.path} was replaced or written to {when} (device, inode, size, mtime_ns {want.key} "
                          f"-> {got.key}: another pre-pack into this directory?); verify it again")


def _progress(enabled: bool):
    if not enabled:
        return _NoProgress()
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn())


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __bool__(self):
        return False


# ------------------------------------------------------------------------------ reassembly
def reassemble(shards: Iterable[tuple[TensorEntry, Any]]) -> dict:
    """Put per-rank tensors back together: ``(entry, tensor)`` pairs from any ranks (torch
    tensors) -> full tensor by logical name. Fused tensors (``parts``) are split into their
    members first. Raises LayoutError if a piece is missing or two copies of one piece differ
    in any byte."""
    import torch

    pieces: dict[str, list[tuple[tuple, Any]]] = {}
    for entry, tensor in shards:
        if tuple(tensor.shape) != entry.shape:
            raise LayoutError(f"tensor {entry.name!r}: got shape {list(tensor.shape)}, entry says {list(entry.shape)}")
        if entry.parts:
            for part in entry.parts:
                pieces.setdefault(part.name, []).append((part.shard, tensor[part.start:part.stop]))
        else:
            pieces.setdefault(entry.name, []).append((entry.shard, tensor))
    out = {}
    for name, items in pieces.items():
        shard0, t0 = items[0]
        full_shape = list(t0.shape)
        for s in shard0:
            full_shape[s.dim] *= s.count
        full = torch.empty(full_shape, dtype=t0.dtype)
        seen: dict[tuple, Any] = {}
        for shard, t in items:
            if [(s.dim, s.count, s.blocks) for s in shard] != [(s.dim, s.count, s.blocks) for s in shard0]:
                raise LayoutError(f"tensor {name!r}: ranks disagree on how it is split: {shard} vs {shard0}")
            key = tuple(s.index for s in shard)
            if key in seen:
                if not torch.equal(_bytes_of(seen[key]), _bytes_of(t)):
                    raise LayoutError(f"tensor {name!r}: two ranks hold shard {key} with different bytes")
                continue
            seen[key] = t
            per_dim = []
            for s in shard:
                piece = t.shape[s.dim] // s.blocks
                per_dim.append([(s.dim, b * piece, (b + 1) * piece, (b * s.count + s.index) * piece)
                                for b in range(s.blocks)])
            for combo in product(*per_dim):
                src = [slice(None)] * t.dim()
                dst = [slice(None)] * t.dim()
                for dim, a, b, d in combo:
                    src[dim], dst[dim] = slice(a, b), slice(d, d + b - a)
                full[tuple(dst)] = t[tuple(src)]
        expected = 1
        for s in shard0:
            expected *= s.count
        if len(seen) != expected:
            raise LayoutError(f"tensor {name!r}: have shards {sorted(seen)}, need all {expected}")
        out[name] = full
    return out


def _bytes_of(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def is_rank_dir_name(name: str) -> bool:
    """``name`` is the one :func:`rank_dir_name` gives some rank: ``rank-01`` and ``rank-1`` (or
    ``rank-\u0661``, an Arabic-Indic one) are not both rank 1."""
    m = _RANK_DIR.match(name)
    return m is not None and m.group(1).isascii() and name == rank_dir_name(int(m.group(1)))


def list_rank_dirs(path: Path) -> dict[int, Path]:
    """``rank-R`` directories directly under ``path``, by the names pre-pack gives them: a
    ``rank-01`` beside ``rank-1`` had taken its place here, and a commit that moved it aside then
    renamed the new ``rank-1`` over the old one still there (ENOTEMPTY, the old image lost)."""
    out = {}
    if path.is_dir():
        for p in path.iterdir():
            if is_rank_dir_name(p.name) and p.is_dir():
                out[int(p.name.removeprefix("rank-"))] = p
    return out


__all__ = ["Image", "JobInfo", "MetadataFile", "PendingMetadata", "VerifyResult", "begin_metadata_read", "check_metadata_digest", "check_request", "image_ranks", "list_rank_dirs", "open_image", "resolve_rank",
           "rank_dir_name", "read_image", "read_image_metadata", "read_job", "read_metadata_file", "reassemble",
           "verify_image", "IMAGE_FILE"]
