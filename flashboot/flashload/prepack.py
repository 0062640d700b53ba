"""Pre-pack: a Hugging Face safetensors checkpoint -> one image per rank (``flashboot.prepack``).

The job plans every rank's layout from the safetensors headers alone, refuses before writing
if the output filesystem is short of space, then reads each checkpoint tensor once and writes
each of its pieces straight to its final offset in every rank's image (``pwrite``), in one pass:
the shards are read in large sequential batches (``O_DIRECT`` where allowed) on several
threads, each batch's pieces written and their chunk checksums summed as they are written (no
read-back), and the written pages handed to writeback at once, so the disk writes while the
checkpoint is read. At most ``threads`` batches are in memory. Everything is written under
``OUT/.tmp-XXXX`` and moved into place only when complete; ``prepack.json``, the marker of a
complete job, is written last. A crash leaves only the temporary directory, which the next run
removes.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LayoutError

JOB_LOCK = ".lock"
READ_THREADS = 4
"""Batches read (and their pieces written and hashed) at once: enough reads in flight for a
disk's queue; each thread holds one batch (64 MiB, or one larger tensor)."""


class DiskSpaceError(LayoutError):
    """The output filesystem cannot hold the images; says bytes needed and free."""

    def __init__(self, path: Path, nbytes_needed: int, nbytes_free: int, *, during: OSError | None = None):
        self.path, self.nbytes_needed, self.nbytes_free = path, nbytes_needed, nbytes_free
        if during is None:
            super().__init__(f"{path}: the images need {nbytes_needed:,} bytes but the filesystem has only "
                             f"{nbytes_free:,} free (short by {nbytes_needed - nbytes_free:,}); nothing was written")
        else:  # the space was there at the check and went while writing (another writer, a quota)
            super().__init__(f"{path}: the filesystem filled while the images were written ({during.strerror}); they "
                             f"need {nbytes_needed:,} bytes and {nbytes_free:,} are free with the partial images "
                             "removed; nothing was committed")


@dataclass(frozen=True)
class RankSummary:
    """One written rank."""

    rank: int
    dir: Path
    image_nbytes: int
    expert_nbytes: int
    non_expert_nbytes: int
    tensors: int


@dataclass
class PrepackReport:
    """What a pre-pack wrote, how fast, and what it warned about."""

    out_dir: Path
    job_id: str
    family: str
    model_type: str | None
    fallback: bool
    target: str
    tp_size: int
    ep_size: int
    world_size: int
    key_digest: str
    ranks: list[RankSummary]
    read_nbytes: int
    """Checkpoint bytes read (each tensor once)."""
    written_nbytes: int
    """Tensor bytes written over all ranks (padding excluded)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Per phase: plan, write, checksum, commit, total."""
    warnings: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    read_io: dict[str, str] = field(default_factory=dict)
    """Per checkpoint file: how it was read (``o_direct``, or ``buffered`` and why)."""

    @property
    def image_nbytes(self) -> int:
        return sum(r.image_nbytes for r in self.ranks)

    @property
    def write_gbps(self) -> float:
        s = self.seconds.get("write", 0.0)
        return self.written_nbytes / s / 1e9 if s > 0 else 0.0

    @property
    def read_gbps(self) -> float:
        s = self.seconds.get("write", 0.0)
        return self.read_nbytes / s / 1e9 if s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"out_dir": str(self.out_dir), "job_id": self.job_id, "family": self.family,
                "model_type": self.model_type, "fallback": self.fallback, "target": self.target,
                "tp_size": self.tp_size, "ep_size": self.ep_size, "world_size": self.world_size,
                "key_digest": self.key_digest, "read_nbytes": self.read_nbytes, "written_nbytes": self.written_nbytes,
                "image_nbytes": self.image_nbytes, "read_gbps": self.read_gbps, "write_gbps": self.write_gbps,
                "seconds": self.seconds, "warnings": self.warnings, "skipped": self.skipped, "read_io": self.read_io,
                "ranks": [{"rank": r.rank, "dir": str(r.dir), "image_nbytes": r.image_nbytes,
                           "expert_nbytes": r.expert_nbytes, "non_expert_nbytes": r.non_expert_nbytes,
                           "tensors": r.tensors} for r in self.ranks]}


def prepack(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, tp: int = 1, ep: int = 1, *,
            target: str = "transformers", family: str | None = None, chunk_bytes: int | None = None,
            model_id: str | None = None, revision: str | None = None, progress: bool | None = None,
            tensor_alignment: int | None = None) -> PrepackReport:
    """Pre-pack the safetensors checkpoint in ``hf_dir`` into ``out_dir`` for ``tp`` x ``ep``.

    Parameters:
        hf_dir: a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``).
        out_dir: the image directory (created; a previous image there is replaced only once
            the new one is complete).
        tp, ep: tensor- and expert-parallel sizes; ``max(tp, ep)`` ranks are written.
        target: ``"transformers"`` (tensor names = the transformers module's parameters) or
            ``"sglang"`` (FusedMoE ``w13_weight``/``w2_weight``, stacked ``qkv_proj``/``gate_up_proj``).
        family: force a family rule by name (default: by config.json ``model_type``; unknown
            types fall back to ``generic`` with a warning).
        chunk_bytes: checksum chunk size (default 64 MiB; a multiple of 4096).
        model_id, revision: recorded in the key (default: from the path / config).
        progress: show a progress bar (default: when stderr is a terminal).

    Raises LayoutError (unsupported dtype, aliased tensors, a layout the family cannot
    produce, a concurrent pre-pack of ``out_dir``) and DiskSpaceError, all before writing.
    """
    from flashboot import __version__
    from flashboot.layouts.checkpoint import open_checkpoint
    from flashboot.layouts.families import (
        PlanContext,
        check_plan,
        family_for,
        get_family,
    )
    from flashboot.layouts.format import (
        DEFAULT_CHUNK_BYTES,
        FORMAT_VERSION,
        JOB_FORMAT_NAME,
        MAX_CHUNK_BYTES,
        TARGETS,
        TENSOR_ALIGNMENT,
        FamilyInfo,
        ImageKey,
        ImageMetadata,
        ParallelLayout,
        SourceInfo,
        compute_layout,
    )
    from flashboot.layouts.image import rank_dir_name

    t_start = time.perf_counter()
    for what, value in (("hf_dir", hf_dir), ("out_dir", out_dir)):
        if isinstance(value, (str, bytes)) and not value:  # Path("") is the working directory: an unset
            raise LayoutError(f"{what} is an empty path")   # $OUT had written the image into it
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if not isinstance(chunk_bytes, int) or not 0 < chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes % 4096:
        raise LayoutError(f"chunk_bytes must be a positive multiple of 4096 of at most {MAX_CHUNK_BYTES:,}, got "
                          f"{chunk_bytes!r}")
    alignment = TENSOR_ALIGNMENT if tensor_alignment is None else tensor_alignment
    if target not in TARGETS:
        raise LayoutError(f"target {target!r}; known: {', '.join(TARGETS)}")
    for what, value in (("model_id", model_id), ("revision", revision)):
        if value is not None and not isinstance(value, str):  # had been refused after the whole image was written
            raise LayoutError(f"{what} must be a string (or None: from the checkpoint), got {value!r}")
    layouts = ParallelLayout.all_ranks(tp, ep)

    # ---- plan: headers only
    ckpt = open_checkpoint(hf_dir)
    if family is None:
        choice = family_for(ckpt.model_type)
        fam, fallback, warning = choice.family, choice.fallback, choice.warning
    else:
        fam, fallback, warning = get_family(family), False, None
    warnings = [warning] if warning else []
    plans, rank_layouts = [], []
    for p in layouts:
        plan = fam.plan(PlanContext(ckpt.config, ckpt.tensors, p, target))
        check_plan(plan, ckpt.tensors, fam.name)
        rank_layouts.append(compute_layout([t.slot() for t in plan.tensors], tensor_alignment=alignment))
        plans.append(plan)
    looks = sorted(n for n in ckpt.tensors if ".experts." in n) if ep > 1 else []
    if looks and all(plan.experts is None for plan in plans):
        # ep splits experts only: a family whose expert names match none of the checkpoint's (a
        # forced --family) had written ep full copies, each rank's "share", without a word. A dense
        # model at ep > 1 is not refused: its ep ranks each hold the same shard, as the engine's do.
        raise LayoutError(f"{hf_dir}: ep={ep} splits experts, but family {fam.name} finds no expert tensor among "
                          f"the checkpoint's {len(ckpt.tensors)}: every rank would hold a full copy of the "
                          f"{ckpt.nbytes:,} bytes; {len(looks)} tensor(s) look like experts but are not this "
                          f"family's expert names (e.g. {looks[0]!r}): choose the family whose names they are")
    empty = [p.rank for p, lay in zip(layouts, rank_layouts) if lay.image_nbytes == 0]
    if empty:  # a load refuses an empty image: say so now, not after a job that "succeeded"
        raise LayoutError(f"{hf_dir}: rank(s) {empty[:8]} of {len(layouts)} would hold no tensor bytes "
                          f"({len(ckpt.tensors)} tensor(s), {ckpt.nbytes:,} bytes in the checkpoint); nothing to "
                          "pre-pack")
    for w in plans[0].warnings:
        warnings.append(w)
    skipped = dict(plans[0].skipped)
    dtypes = tuple(sorted({t.dtype for plan in plans for t in plan.tensors}))
    source = SourceInfo(str(hf_dir.resolve()), model_id or ckpt.model_id(), revision or ckpt.revision(),
                        ckpt.config_hash, ckpt.model_type)
    key = ImageKey(source.model_id, source.revision, source.config_hash, fam.name, target, tp, ep, dtypes)
    fam_info = FamilyInfo(fam.name, ckpt.model_type, fallback, warning)
    job_id = uuid.uuid4().hex
    t_plan = time.perf_counter()

    # ---- refuse before writing: a concurrent job, an output that is not an image's, space
    from flashboot.layouts.writer import (
        ImageWriter, check_out_dir, job_tmp_path, make_job_tmp, publish_job, stage_job, sweep_stale_jobs,
    )

    if out_dir.exists() and not out_dir.is_dir():
        raise LayoutError(f"{out_dir} is not a directory; pre-pack writes an image directory there")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = open(out_dir / JOB_LOCK, "a+")
    except OSError as exc:  # not writable, a dangling link, a .lock that is a directory: a traceback had
        raise LayoutError(f"{out_dir}: cannot make the image directory or its lock file {JOB_LOCK} "
                          f"({exc.strerror}: {exc.filename}); nothing was written") from None
    writers: list = []
    claim = None
    try:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LayoutError(f"{out_dir}: another flashboot prepack is writing here (lock {out_dir / JOB_LOCK})") from None
        except OSError as exc:  # a filesystem without locks (NFS without lockd: ENOLCK) had been a traceback
            raise LayoutError(f"{out_dir}: cannot lock {out_dir / JOB_LOCK} ({exc.strerror}): pre-pack writes an image "
                              "only where no other job can write at once; choose an output on a local filesystem") from None
        check_out_dir(out_dir)
        sweep_stale_jobs(out_dir)  # left by an interrupted run; we hold the lock
        needed = sum(lay.image_nbytes + _metadata_nbytes(plan, lay, chunk_bytes)
                     for plan, lay in zip(plans, rank_layouts))
        free = shutil.disk_usage(out_dir).free
        if needed > free:
            raise DiskSpaceError(out_dir, needed, free)
        try:
            claim = make_job_tmp(out_dir, job_id)
            tmp = claim.path
        except OSError as exc:  # a full disk has no block for the directory either
            _discard_tmp(job_tmp_path(out_dir, job_id))
            raise _write_failed(exc, out_dir, needed) from exc

        # ---- write: each source tensor read once, its pieces to every rank's final offsets
        try:
            for p, lay in zip(layouts, rank_layouts):
                writers.append(ImageWriter(tmp / rank_dir_name(p.rank), lay, chunk_bytes))
            uses: dict[str, list] = {}
            for w, plan, lay in zip(writers, plans, rank_layouts):
                for t in plan.tensors:
                    entry = lay.tensors[t.name]
                    for piece in t.pieces:
                        uses.setdefault(piece.source, []).append((w, entry, piece))
            order = sorted(uses, key=lambda n: (ckpt.tensors[n].file, ckpt.tensors[n].data_start))
            read_nbytes = sum(ckpt.tensors[n].nbytes for n in order)
            read_io = _write_all(ckpt, order, uses, read_nbytes, _show_progress(progress))
            t_write = time.perf_counter()
            metas = []
            for w, p, plan, lay in zip(writers, layouts, plans, rank_layouts):
                meta = ImageMetadata(
                    flashboot_version=__version__, job_id=job_id, source=source, family=fam_info, target=target,
                    parallel=p, experts=plan.experts, image_file=w.path.name, image_nbytes=lay.image_nbytes,
                    regions=lay.regions, tensors=lay.tensors, checksums=w.checksums(chunk_bytes), key=key,
                    tensor_alignment=alignment, warnings=tuple(warnings))
                # The writer must produce what the strict reader accepts: check it here, not at load.
                ImageMetadata.from_dict(json.loads(meta.to_json()), str(w.rank_dir / "metadata.json"))
                w.finish(meta)
                metas.append(meta)
            t_checksum = time.perf_counter()
            job = {
                "format": JOB_FORMAT_NAME, "format_version": FORMAT_VERSION, "flashboot_version": __version__,
                "job_id": job_id, "created_unix": time.time(), "world_size": len(layouts), "tp_size": tp,
                "ep_size": ep, "target": target, "family": fam_info.to_dict(), "source": source.to_dict(),
                "key": key.to_dict(), "warnings": warnings, "skipped": skipped,
                "ranks": [{"rank": m.parallel.rank, "dir": rank_dir_name(m.parallel.rank),
                           "image_nbytes": m.image_nbytes, "tensors": len(m.tensors)} for m in metas],
            }
            # the job file too is written before the old image is touched: a disk that fills on
            # it (or a foreign file found in a rank directory meanwhile) discards the new job
            stage_job(tmp, out_dir, job)
        except BaseException as exc:
            for w in writers:
                w.close()
            _discard_tmp(tmp)  # nothing of it was committed: a full disk is not left full
            if isinstance(exc, OSError):
                raise _write_failed(exc, out_dir, needed) from exc
            raise
        for w in writers:
            w.close()
        written = sum(w.written_nbytes for w in writers)
        # ---- commit: unmark the old job, swap rank dirs in, mark the new job last
        publish_job(tmp, out_dir, [p.rank for p in layouts])
        t_commit = time.perf_counter()
    finally:
        if claim is not None:
            claim.close()
        lock.close()  # releases the lock (an unlock of one never taken fails as its lock did)

    ranks = [RankSummary(m.parallel.rank, out_dir / rank_dir_name(m.parallel.rank), m.image_nbytes,
                         m.regions["experts"].nbytes, m.regions["non_experts"].nbytes, len(m.tensors)) for m in metas]
    return PrepackReport(
        out_dir=out_dir, job_id=job_id, family=fam.name, model_type=ckpt.model_type, fallback=fallback,
        target=target, tp_size=tp, ep_size=ep, world_size=len(layouts), key_digest=key.digest, ranks=ranks,
        read_nbytes=read_nbytes, written_nbytes=written,
        seconds={"plan": t_plan - t_start, "write": t_write - t_plan, "checksum": t_checksum - t_write,
                 "commit": t_commit - t_checksum, "total": t_commit - t_start},
        warnings=warnings, skipped=skipped, read_io=read_io)


METADATA_NBYTES_PER_TENSOR = 512
"""Room counted for each tensor's entry in ``metadata.json`` and ``tensors.bin`` together, beyond
its name (~250 bytes of JSON and ~100 of table for a 2-D tensor)."""


def _metadata_nbytes(plan, layout, chunk_bytes: int) -> int:
    """Room for one rank's ``metadata.json`` and ``tensors.bin``: a 20,000-tensor rank's metadata
    is megabytes, which a fixed allowance had not counted."""
    names = sum(2 * len(t.name.encode()) + METADATA_NBYTES_PER_TENSOR for t in plan.tensors)
    return (1 << 20) + names + 64 * -(-layout.image_nbytes // chunk_bytes)


def _discard_tmp(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def _write_failed(exc: OSError, out_dir: Path, needed: int) -> LayoutError:
    """The error for a write the filesystem refused (full, file too large, I/O), once the partial
    job is removed."""
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskSpaceError(out_dir, needed, shutil.disk_usage(out_dir).free, during=exc)
    return LayoutError(f"{out_dir}: writing the image failed: {exc}; nothing was committed and the partial image "
                       "was removed")


def _show_progress(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


def _write_all(ckpt, order: list[str], uses: dict[str, list], total_nbytes: int, show: bool, *,
               threads: int = READ_THREADS, batch_bytes: int | None = None) -> dict[str, str]:
    """Read each source once, in batches of consecutive tensors (checkpoint file order) on
    ``threads`` threads, and write every piece that uses it; returns how each file was read."""
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    from flashboot.layouts.checkpoint import DEFAULT_BATCH_BYTES, ShardReader, plan_reads

    batches = plan_reads(ckpt, order, batch_bytes or DEFAULT_BATCH_BYTES)
    bar = task = None
    if show:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        bar = Progress(TextColumn("prepack"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                       TimeRemainingColumn(), transient=False)
        bar.start()
        task = bar.add_task("prepack", total=total_nbytes)

    stop = threading.Event()
    left: dict[str, int] = {}  # batches of each file not yet read: its fd is closed at 0
    for b in batches:
        left[b.file] = left.get(b.file, 0) + 1
    left_lock = threading.Lock()

    def one(batch, reader: ShardReader) -> None:
        if stop.is_set():  # the run was interrupted: batches not yet started read nothing
            return
        data = reader.read(batch)
        with left_lock:
            left[batch.file] -= 1
            done = left[batch.file] == 0
        if done:  # one open file per shard being read, not per shard of the checkpoint
            reader.release(batch.file)
        for name in batch.names:
            src = ckpt.tensors[name]
            at = src.data_start - batch.start
            _write_pieces(src, data[at:at + src.nbytes], uses[name])
        if bar is not None:
            bar.update(task, advance=sum(ckpt.tensors[n].nbytes for n in batch.names))

    try:
        with ShardReader(ckpt.path, expect=ckpt.identities) as reader, \
                ThreadPoolExecutor(max(1, threads), thread_name_prefix="flashboot-prepack") as pool:
            futures = [pool.submit(one, b, reader) for b in batches]  # each holds its batch only while it runs
            try:
                _, pending = wait(futures, return_when=FIRST_EXCEPTION)
            except BaseException:  # Ctrl-C: the pool's exit then waits for the running batches only
                stop.set()
                for f in futures:
                    f.cancel()
                raise
            for f in pending:
                f.cancel()
            for f in futures:  # the first failure in file order is the one reported
                if f.done() and not f.cancelled() and f.exception() is not None:
                    raise f.exception()
            reader.check_unchanged()  # a shard rewritten in place while read: its bytes are not the header's
            return dict(reader.modes)
    finally:
        if bar is not None:
            bar.stop()


def _write_pieces(src, raw, uses: list) -> None:
    """Write the pieces of one source tensor (``raw``: its bytes, C order) to their writers.

    Sliced in bytes (the last dimension scaled by the item size): dtype-agnostic (bf16, fp8,
    bool), and a piece that is the whole tensor is written straight from the read buffer."""
    import numpy as np

    from flashboot.layouts.format import DTYPES

    shape = src.shape
    itemsize = DTYPES[src.dtype].itemsize
    for writer, entry, piece in uses:
        if all(a == 0 and b == d for (a, b), d in zip(piece.box, shape)):
            part = raw
        else:
            rows = raw.reshape(*shape[:-1], shape[-1] * itemsize)
            (a, b) = piece.box[-1]
            box = tuple(slice(lo, hi) for lo, hi in piece.box[:-1]) + (slice(a * itemsize, b * itemsize),)
            part = np.ascontiguousarray(rows[box]).reshape(-1)
        if part.size:
            writer.write(entry, piece.dst_elem, part)
