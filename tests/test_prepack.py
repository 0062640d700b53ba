"""The pre-pack job: streaming writes read back byte for byte, atomic commit, interrupted runs,
bad checkpoints refused before writing, space checks, and the prepack/inspect/verify CLI."""

import argparse
import fcntl
import json
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from flashboot.layouts import read_image, read_job, verify_image
from flashboot.layouts.checkpoint import ShardReader
from flashboot.layouts.tiny import save_tiny_model
from flashboot.layouts.writer import ImageWriter
from safetensors import safe_open
from safetensors.torch import save_file

import flashboot
from flashboot.commands import prepack as prepack_cmd
from flashboot.errors import ChecksumMismatchError, LayoutError
from flashboot.flashload import prepack as _prepack
from flashboot.flashload.prepack import DiskSpaceError, prepack


def _mixed_checkpoint(path: Path) -> dict:
    """Two shards plus an index, every supported dtype, a 0-d and an empty tensor."""
    g = torch.Generator().manual_seed(3)
    f32 = torch.randn(7, 9, generator=g)
    tensors = {
        "f64": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "f32": f32,
        "f16": torch.randn(11, generator=g).half(),
        "bf16": torch.randn(4, 4, generator=g).bfloat16(),
        "e4m3": torch.randn(6, 8, generator=g).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(5, generator=g).to(torch.float8_e5m2),
        "i64": torch.randint(-9, 9, (3,), generator=g),
        "i32": torch.randint(-9, 9, (2, 2), generator=g, dtype=torch.int32),
        "i16": torch.randint(-9, 9, (13,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-9, 9, (17,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (19,), generator=g, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "big": torch.randn(300, 300, generator=g),  # several 64 KiB chunks
    }
    path.mkdir()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, members in shards.items():
        save_file({n: tensors[n] for n in members}, path / fname)
        weight_map.update({n: fname for n in members})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"model_type": "mixed_bag", "_name_or_path": "org/mixed"}))
    return tensors


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    tensors = _mixed_checkpoint(root / "ckpt")
    return root / "ckpt", tensors


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    model = save_tiny_model("qwen3_moe", root / "ckpt", seed=11)
    return root / "ckpt", {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_prepack_api_writes_a_complete_job(mixed, tmp_path):
    ckpt, tensors = mixed
    out = tmp_path / "out"
    report = flashboot.prepack(ckpt, out, chunk_bytes=1 << 16, progress=False)
    assert isinstance(report, flashboot.PrepackReport)
    assert report.world_size == 1 and report.fallback and report.family == "generic"
    assert report.read_nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert report.written_nbytes == report.read_nbytes
    assert sorted(p.name for p in out.iterdir()) == [".lock", "prepack.json", "rank-0"]
    job = read_job(out)
    assert job.world_size == 1 and job.key.model_id == "org/mixed" and job.key.digest == report.key_digest
    with read_image(out) as im:
        assert set(im.tensors) == set(tensors)
        assert im.metadata.key.dtypes == tuple(sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()}))
        for name, t in tensors.items():
            view = im.view(name)
            assert view.dtype == t.dtype and view.shape == t.shape and torch.equal(_bytes(view), _bytes(t)), name
    assert verify_image(out)[0].chunks == -(-im.nbytes // (1 << 16)) == 6  # the last chunk is short


def test_progress_bar_reports_throughput(mixed, tmp_path, capsys):
    report = prepack(mixed[0], tmp_path / "out", progress=True)
    out = capsys.readouterr().out
    assert "prepack" in out and "/s" in out and report.read_gbps > 0


def test_each_source_tensor_is_read_once(qwen, tmp_path, monkeypatch):
    reads = Counter()
    read_bytes = []
    real = ShardReader.read

    def counting(self, batch):
        reads.update(batch.names)
        read_bytes.append(batch.nbytes)
        return real(self, batch)

    monkeypatch.setattr(ShardReader, "read", counting)
    report = prepack(qwen[0], tmp_path / "out", tp=2, ep=1, progress=False)
    assert reads and set(reads.values()) == {1}  # two ranks, one read per tensor
    assert sum(read_bytes) == report.read_nbytes and len(read_bytes) < len(reads)  # in batches of several tensors
    with safe_open(qwen[0] / "model.safetensors", "pt") as f:
        assert set(reads) == set(f.keys())


def test_rerun_replaces_a_previous_image(qwen, tmp_path):
    out = tmp_path / "out"
    first = prepack(qwen[0], out, tp=2, progress=False)
    second = prepack(qwen[0], out, tp=1, progress=False)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("rank-")) == ["rank-0"]
    assert read_job(out).job_id == second.job_id != first.job_id
    assert read_image(out).metadata.parallel.tp_size == 1
    assert not list(out.glob(".tmp-*"))


class _Crash(RuntimeError):
    pass


def test_interrupted_prepack_leaves_nothing_that_looks_complete(qwen, tmp_path, monkeypatch):
    out = tmp_path / "out"
    calls = {"n": 0}
    real_write = ImageWriter.write

    def crashing(self, entry, elem_offset, data):
        calls["n"] += 1
        if calls["n"] == 20:
            raise _Crash("power cut")
        return real_write(self, entry, elem_offset, data)

    monkeypatch.setattr(ImageWriter, "write", crashing)
    monkeypatch.setattr(_prepack, "_discard_tmp", lambda tmp: None)  # as if the process died mid-write
    with pytest.raises(_Crash):
        prepack(qwen[0], out, tp=2, progress=False)
    leftovers = list(out.glob(".tmp-*"))
    assert leftovers and (leftovers[0] / "rank-0" / "image.bin").exists()  # the half image exists...
    assert not (out / "prepack.json").exists() and not (out / "rank-0").exists()
    with pytest.raises(LayoutError, match="interrupted; re-run flashboot prepack"):
        read_image(out, 0)  # ...and is never used
    monkeypatch.setattr(ImageWriter, "write", real_write)
    report = prepack(qwen[0], out, tp=2, progress=False)
    assert not list(out.glob(".tmp-*"))
    assert [r.rank for r in verify_image(out)] == [0, 1]
    images = [read_image(out, r) for r in range(2)]
    assert all(im.metadata.job_id == report.job_id for im in images)


def test_a_write_that_fails_removes_its_partial_job(qwen, tmp_path, monkeypatch):
    """An error the process lives through (a full disk, a bug) removes the job's temp directory:
    before, its full-size images stayed, and a full filesystem stayed full."""
    out = tmp_path / "out"
    monkeypatch.setattr(ImageWriter, "write", lambda *a, **k: (_ for _ in ()).throw(_Crash("bad")))
    with pytest.raises(_Crash):
        prepack(qwen[0], out, tp=2, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


@pytest.mark.parametrize("errno_name", ["ENOSPC", "EFBIG"])
def test_the_filesystem_refusing_a_write_is_a_layout_error_and_leaves_nothing(qwen, tmp_path, monkeypatch, errno_name):
    """A raw OSError from pwrite (ENOSPC past the space check: the metadata, another writer; EFBIG
    under a file size limit) had ended the CLI in a traceback with the partial job left."""
    import errno
    import os

    code = getattr(errno, errno_name)
    real, calls = os.pwrite, {"n": 0}

    def pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(code, os.strerror(code))
        return real(fd, data, offset)

    monkeypatch.setattr("flashboot.layouts.writer.os.pwrite", pwrite)
    out = tmp_path / "out"
    expected = DiskSpaceError if errno_name == "ENOSPC" else LayoutError
    message = ("the filesystem filled while the images were written .*; nothing was committed" if errno_name == "ENOSPC"
               else "writing the image failed: .*File too large; nothing was committed and the partial image was removed")
    with pytest.raises(expected, match=message):
        prepack(qwen[0], out, tp=2, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_a_disk_that_fills_on_the_job_file_keeps_the_old_image_and_leaves_no_partial_job(qwen, tmp_path, monkeypatch):
    """prepack.json is written into the job's temp directory after the images: a full disk there
    had raised a bare OSError and left the new job's full-size images behind (a full disk stayed
    full until the next run); the old image is untouched either way."""
    import errno
    import os

    out = tmp_path / "out"
    old = prepack(qwen[0], out, progress=False)
    real_fsync, seen = os.fsync, {"job": False}
    real_open = open

    def fsync(fd):
        if seen["job"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    def opening(path, *a, **k):
        seen["job"] = Path(path).name == "prepack.json"
        return real_open(path, *a, **k)

    monkeypatch.setattr("flashboot.layouts.writer.os.fsync", fsync)
    monkeypatch.setattr("builtins.open", opening)
    with pytest.raises(DiskSpaceError, match="the filesystem filled while the images were written"):
        prepack(qwen[0], out, tp=2, progress=False)
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == [".lock", "prepack.json", "rank-0"]
    assert read_image(out).metadata.job_id == old.job_id
    verify_image(out)


@pytest.mark.parametrize("where", ["dangling link", "lock is a directory"])
def test_an_output_that_cannot_be_made_is_a_layout_error_naming_it(qwen, tmp_path, where):
    """A bare OSError (a traceback from the CLI) had come from making the output or its lock."""
    out = tmp_path / "out"
    if where == "dangling link":
        out.symlink_to(tmp_path / "gone")
        message = r"out: cannot make the image directory or its lock file .lock \(File exists: .*out\)"
    else:
        (out / ".lock").mkdir(parents=True)
        message = r"out: cannot make the image directory or its lock file .lock \(Is a directory: .*\.lock\)"
    with pytest.raises(LayoutError, match=message):
        prepack(qwen[0], out, progress=False)


def test_an_output_that_cannot_be_locked_is_a_layout_error(qwen, tmp_path, monkeypatch):
    import errno
    import os

    def flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(_prepack.fcntl, "flock", flock)
    with pytest.raises(LayoutError, match=r"out: cannot lock .*out/.lock \(No locks available\)"):
        prepack(qwen[0], tmp_path / "out", progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".lock"]


def test_a_disk_too_full_for_the_job_directory_leaves_nothing(qwen, tmp_path, monkeypatch):
    import errno
    import os

    from flashboot.layouts.writer import JOB_TMP_MARK

    real_open = os.open

    def open_(path, flags, *a, **k):
        if os.fspath(path).endswith(JOB_TMP_MARK) and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", open_)
    out = tmp_path / "out"
    with pytest.raises(DiskSpaceError, match="the filesystem filled while the images were written"):
        prepack(qwen[0], out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_a_prepack_leaves_the_temp_directory_of_a_job_still_writing_alone(qwen, tmp_path):
    """An engine job's ranks write OUT/.tmp-<job> before they take OUT/.lock (at the commit): a
    prepack into OUT meanwhile had swept it as an interrupted job's, deleting the ranks under them.
    A job claims its directory while it writes; once it lets go, the next job sweeps it."""
    from flashboot.layouts.writer import make_job_tmp

    out = tmp_path / "out"
    claim = make_job_tmp(out, "e" * 32)  # an engine job's rank, writing
    (claim.path / "rank-1").mkdir()
    (claim.path / "rank-1" / "image.bin").write_bytes(b"x" * 4096)
    try:
        prepack(qwen[0], out, progress=False)
        assert (claim.path / "rank-1" / "image.bin").read_bytes() == b"x" * 4096
    finally:
        claim.close()
    prepack(qwen[0], out, progress=False)  # given up (never committed): stale now
    assert not claim.path.exists()


def test_ctrl_c_stops_prepack_after_the_batches_already_reading(qwen, tmp_path, monkeypatch):
    """A KeyboardInterrupt in the wait for the batches: the pool's exit had read and written every
    batch still queued first (on a large checkpoint, minutes); now the queued ones are cancelled."""
    import concurrent.futures
    import threading
    import time

    from flashboot.layouts import checkpoint

    monkeypatch.setattr(checkpoint, "DEFAULT_BATCH_BYTES", 4096)
    reads, real_read, started = [], ShardReader.read, threading.Event()

    def slow_read(self, batch):
        reads.append(batch)
        started.set()
        time.sleep(0.05)
        return real_read(self, batch)

    def interrupted_wait(futures, **kw):
        started.wait(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(ShardReader, "read", slow_read)
    monkeypatch.setattr(concurrent.futures, "wait", interrupted_wait)
    batches = len(checkpoint.plan_reads(checkpoint.open_checkpoint(qwen[0]), sorted(
        checkpoint.open_checkpoint(qwen[0]).tensors), 4096))
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepack(qwen[0], out, progress=False)
    assert batches > 3 * _prepack.READ_THREADS and len(reads) <= 2 * _prepack.READ_THREADS
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # and the partial job is gone


def test_the_space_check_counts_the_metadata_of_many_tensors(tmp_path, monkeypatch):
    """20,000 one-element tensors: 80 KB of image and ~4 MB of metadata, which a fixed 1 MiB had
    not counted (the run then filled the disk)."""
    from collections import namedtuple

    ckpt = tmp_path / "many"
    ckpt.mkdir()
    save_file({f"model.layers.{i}.some_long_parameter_name.weight": torch.full((1,), float(i)) for i in range(20_000)},
              ckpt / "model.safetensors")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(_prepack.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - (3 << 20), 3 << 20))
    with pytest.raises(DiskSpaceError) as exc:
        prepack(ckpt, tmp_path / "out", progress=False)
    assert exc.value.nbytes_needed > 20_000 * 2 * len("model.layers.0.some_long_parameter_name.weight")
    monkeypatch.undo()
    report = prepack(ckpt, tmp_path / "out", progress=False)
    written = sum(f.stat().st_size for f in report.ranks[0].dir.iterdir())
    assert written - report.ranks[0].image_nbytes > 1 << 20  # more than the old allowance...
    assert written <= exc.value.nbytes_needed  # ...and no more than the check counted


@pytest.mark.parametrize("where", ["rank-7/results.csv", ".tmp-notes/a.txt", "rank-0/model.safetensors"])
def test_prepack_deletes_nothing_it_did_not_write(qwen, tmp_path, where):
    """A rank-N directory with other files in it is refused, not replaced (it had been deleted
    with the old image's); a .tmp-* directory without a job's mark is left alone (it had been
    removed as an interrupted job's)."""
    out = tmp_path / "out"
    (out / where).parent.mkdir(parents=True)
    (out / where).write_text("keep")
    if where.startswith(".tmp-"):
        prepack(qwen[0], out, progress=False)
        assert read_image(out).metadata.parallel.rank == 0
    else:
        rank_dir = (out / where).parent
        with pytest.raises(LayoutError, match=rf"{rank_dir} holds {Path(where).name}, which pre-pack did not write; a "
                                              rf"pre-pack into {out} replaces every rank-N directory there, so it will "
                                              "not"):
            prepack(qwen[0], out, progress=False)
        assert not (out / "prepack.json").exists() and not list(out.glob(".tmp-*"))
    assert (out / where).read_text() == "keep"


def test_a_rank_name_that_is_no_directory_is_refused_and_the_old_image_kept(qwen, tmp_path):
    """A file named rank-1 in the output: the commit had unlinked the old job, moved the old rank
    directories aside and then failed renaming the new rank-1 over it (NotADirectoryError), the
    old image lost with the partial commit."""
    out = tmp_path / "out"
    old = prepack(qwen[0], out, progress=False)
    (out / "rank-1").write_text("keep")
    with pytest.raises(LayoutError, match=rf"{out} holds rank-1, which is no directory: pre-pack writes its ranks as "
                                          "rank-N directories and will not replace it"):
        prepack(qwen[0], out, tp=2, progress=False)
    assert (out / "rank-1").read_text() == "keep" and not list(out.glob(".tmp-*"))
    assert read_image(out).metadata.job_id == old.job_id
    verify_image(out)


@pytest.mark.parametrize("name", ["rank-01", "rank-001", "rank-\u0661"])
def test_a_directory_named_like_a_rank_another_way_is_left_alone(qwen, tmp_path, name):
    """rank-01 beside rank-1 had been listed as rank 1 in rank-1's place (whichever came last): the
    commit moved it aside, left the old rank-1, then failed renaming the new rank-1 over it
    (ENOTEMPTY) with the old image already unlinked."""
    out = tmp_path / "out"
    prepack(qwen[0], out, tp=2, progress=False)
    (out / name).mkdir()
    (out / name / "notes.txt").write_text("keep")
    report = prepack(qwen[0], out, tp=2, progress=False)
    assert (out / name / "notes.txt").read_text() == "keep"
    assert [r.rank for r in verify_image(out)] == [0, 1]
    assert all(read_image(out, r).metadata.job_id == report.job_id for r in (0, 1))


def test_a_checkpoint_inside_the_output_is_not_moved_aside(qwen, tmp_path):
    """``prepack X/rank-0 --out X``: the checkpoint itself had been moved into the trash and removed."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(qwen[0], out / "rank-0")
    with pytest.raises(LayoutError, match=r"rank-0 holds .*config.json.*which pre-pack did not write"):
        prepack(out / "rank-0", out, progress=False)
    assert (out / "rank-0" / "config.json").is_file()


def test_an_output_inside_an_image_or_over_a_file_is_refused(qwen, tmp_path):
    img = tmp_path / "img"
    prepack(qwen[0], img, progress=False)
    with pytest.raises(LayoutError, match=r"img/rank-0 holds metadata.json: it is one rank's directory of an image"):
        prepack(qwen[0], img / "rank-0", progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(LayoutError, match=r"file is not a directory"):
        prepack(qwen[0], tmp_path / "file", progress=False)
    verify_image(img)


def test_interrupted_replacement_keeps_the_old_image(qwen, tmp_path, monkeypatch):
    out = tmp_path / "out"
    old = prepack(qwen[0], out, progress=False)
    monkeypatch.setattr(ImageWriter, "write", lambda *a, **k: (_ for _ in ()).throw(_Crash("disk gone")))
    with pytest.raises(_Crash):
        prepack(qwen[0], out, tp=2, progress=False)
    assert read_image(out).metadata.job_id == old.job_id  # the old job is untouched
    verify_image(out)


def test_crash_during_commit_is_refused_then_recovered(qwen, tmp_path, monkeypatch):
    out = tmp_path / "out"
    prepack(qwen[0], out, progress=False)
    real_rename = _prepack.os.rename
    seen = {"n": 0}

    def rename(src, dst):
        if Path(dst).name == "rank-1":
            raise _Crash("crash between rank renames")
        seen["n"] += 1
        return real_rename(src, dst)

    monkeypatch.setattr(_prepack.os, "rename", rename)
    with pytest.raises(_Crash):
        prepack(qwen[0], out, tp=2, progress=False)
    assert (out / "rank-0").exists() and not (out / "prepack.json").exists()
    with pytest.raises(LayoutError, match="no prepack.json"):
        read_image(out, 0)
    monkeypatch.setattr(_prepack.os, "rename", real_rename)
    prepack(qwen[0], out, tp=2, progress=False)
    assert len(verify_image(out)) == 2


def test_verify_of_an_image_replaced_meanwhile_is_no_checksum_failure(qwen, mixed, tmp_path, monkeypatch):
    """A re-pre-pack into the directory between verify's metadata read and its open of image.bin:
    the new image's bytes had been checked against the old checksums and reported as corrupt."""
    from flashboot.layouts import image

    out = tmp_path / "out"
    prepack(qwen[0], out, progress=False)
    real_open = image.Image.open

    def open_after_a_new_job(self):
        prepack(mixed[0], out, progress=False)
        return real_open(self)

    monkeypatch.setattr(image.Image, "open", open_after_a_new_job)
    with pytest.raises(LayoutError, match=r"rank-0/image.bin was replaced or written to since its metadata was read"):
        verify_image(out)
    monkeypatch.undo()
    verify_image(out)  # the new image itself is whole


def _write_raw_safetensors(path: Path, header: dict, data: bytes):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_aliased_tensors_refused(tmp_path):
    ckpt = tmp_path / "alias"
    ckpt.mkdir()
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}
    _write_raw_safetensors(ckpt / "model.safetensors", header, bytes(16))
    base = 8 + len(json.dumps(header))
    with pytest.raises(LayoutError, match=f"tensors 'a' and 'b' share file bytes {base + 8}..{base + 16} .*aliased"):
        prepack(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_same_name_in_two_shards_refused(tmp_path):
    ckpt = tmp_path / "dup"
    ckpt.mkdir()
    save_file({"x": torch.ones(2)}, ckpt / "a.safetensors")
    save_file({"x": torch.ones(2), "y": torch.ones(1)}, ckpt / "b.safetensors")
    with pytest.raises(LayoutError, match="tensor 'x' is in two shards \\(a.safetensors and b.safetensors\\)"):
        prepack(ckpt, tmp_path / "out", progress=False)


def test_unsupported_dtypes_refused_naming_them(tmp_path):
    ckpt = tmp_path / "cplx"
    ckpt.mkdir()
    save_file({"ok": torch.ones(2), "z": torch.zeros(3, dtype=torch.complex64),
               "u": torch.zeros(3, dtype=torch.uint16)}, ckpt / "model.safetensors")
    with pytest.raises(LayoutError) as exc:
        prepack(ckpt, tmp_path / "out", progress=False)
    msg = str(exc.value)
    assert "unsupported dtype in 2 tensor(s)" in msg and "z (C64, in model.safetensors)" in msg
    assert "u (U16, in model.safetensors)" in msg and "supported: float64" in msg


def test_index_naming_a_missing_shard_refused(mixed, tmp_path):
    ckpt = tmp_path / "ckpt"
    _mixed_checkpoint(ckpt)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(LayoutError, match=r"names shard\(s\) \['model-00002-of-00002.safetensors'\] that do not exist"):
        prepack(ckpt, tmp_path / "out", progress=False)


def test_too_little_space_refused_before_writing(qwen, tmp_path, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(_prepack.shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 4096, 4096))
    out = tmp_path / "out"
    with pytest.raises(DiskSpaceError) as exc:
        prepack(qwen[0], out, tp=2, progress=False)
    assert exc.value.nbytes_free == 4096 and exc.value.nbytes_needed > 4096
    assert f"need {exc.value.nbytes_needed:,} bytes but the filesystem has only 4,096 free" in str(exc.value)
    assert not list(out.glob("rank-*")) and not list(out.glob(".tmp-*"))


def test_concurrent_prepack_refused(qwen, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".lock", "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(LayoutError, match="another flashboot prepack is writing here"):
            prepack(qwen[0], out, progress=False)


def _one_tensor_checkpoint(path: Path, header: dict, data: bytes, config: str | None = '{"model_type": "x"}') -> Path:
    path.mkdir()
    _write_raw_safetensors(path / "model.safetensors", header, data)
    if config is not None:
        (path / "config.json").write_text(config)
    return path


@pytest.mark.parametrize("header,data,message", [
    # what safetensors or torch accept but an image cannot hold: pre-pack had written the job,
    # "succeeded", and every reader then refused it (or raised OverflowError / UnicodeEncodeError)
    ({"": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "a tensor's name is empty"),
    ({"a\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), "which is not UTF-8"),
    # anywhere in the header, as safetensors' reader refuses it (found by make fuzz's checkpoint reader)
    ({"__metadata__": {"format": "\udcff"}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4),
     "which is not UTF-8"),
    ({"a": {"dtype": "F32\ud800", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), "which is not UTF-8"),
    ({"a": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}, bytes(4), r"\(65 dims\) has more than 64"),
    ({"a": {"dtype": "F32", "shape": [0, 2**62, 4], "data_offsets": [0, 0]}}, b"", "spans more than 2\\*\\*63"),
    # laxer than safetensors: "12" had become [1, 2] and [2.9] had become [2]
    ({"a": {"dtype": "F32", "shape": "12", "data_offsets": [0, 8]}}, bytes(8), "malformed header entry"),
    ({"a": {"dtype": "F32", "shape": [2.9], "data_offsets": [0, 8]}}, bytes(8), "malformed header entry"),
    ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, bytes(4), "malformed header entry"),
    ({"a": [1, 2]}, b"", "malformed header entry"),
])
def test_a_header_no_image_can_hold_is_refused_before_writing(tmp_path, header, data, message):
    ckpt = _one_tensor_checkpoint(tmp_path / "ck", header, data)
    with pytest.raises(LayoutError, match=message):
        prepack(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_without_bytes_is_refused_before_writing(tmp_path):
    ckpt = _one_tensor_checkpoint(tmp_path / "ck", {"a": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}}, b"")
    with pytest.raises(LayoutError, match=r"rank\(s\) \[0\] of 1 would hold no tensor bytes \(1 tensor\(s\), 0 bytes"):
        prepack(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_checkpoint_json_that_is_malformed_is_a_layout_error(tmp_path):
    """Each had ended in a raw traceback: RecursionError, AttributeError, TypeError, FileNotFoundError."""
    one = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    cases = [
        ("config.json", "[" * 100_000 + "]" * 100_000, "config.json: not JSON .nested deeper"),
        ("model.safetensors.index.json", '{"weight_map": []}', "weight_map must map tensor names to shard file names"),
        ("model.safetensors.index.json", '{"weight_map": {"a": 5}}', "weight_map must map tensor names"),
        ("model.safetensors.index.json", '{"weight_map": {"a": "model.safetensors", "b": 3}}', "weight_map must map"),
        ("model.safetensors.index.json", '{"weight_map": {"a": "../other/model.safetensors"}}',
         "maps 'a' to '../other/model.safetensors', outside the checkpoint directory"),
        ("model.safetensors.index.json", '{"weight_map": {"a": "/etc/passwd"}}', "'/etc/passwd', outside the checkpoint"),
    ]
    for i, (name, text, message) in enumerate(cases):
        ckpt = _one_tensor_checkpoint(tmp_path / f"ck{i}", one, bytes(4))
        (ckpt / name).write_text(text)
        with pytest.raises(LayoutError, match=message):
            prepack(ckpt, tmp_path / "out", progress=False)
    deep = _one_tensor_checkpoint(tmp_path / "deep", {}, b"")
    blob = ("{\"a\": " + "[" * 100_000 + "]" * 100_000 + "}").encode()
    (deep / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    with pytest.raises(LayoutError, match="model.safetensors: header: not JSON .nested deeper"):
        prepack(deep, tmp_path / "out", progress=False)


def test_dangling_links_in_a_checkpoint_are_named(tmp_path):
    """A hub snapshot whose blob is gone: config.json had been taken as absent (the generic family,
    exit 0), a shard gave a raw FileNotFoundError."""
    one = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    ckpt = _one_tensor_checkpoint(tmp_path / "ck", one, bytes(4), config=None)
    (ckpt / "config.json").symlink_to(tmp_path / "blobs" / "gone")
    with pytest.raises(LayoutError, match=r"config.json: a link to .*blobs/gone, which does not exist"):
        prepack(ckpt, tmp_path / "out", progress=False)
    (ckpt / "config.json").unlink()
    (ckpt / "other.safetensors").symlink_to(tmp_path / "blobs" / "gone2")
    with pytest.raises(LayoutError, match=r"other.safetensors: a link to .*blobs/gone2, which does not exist \(a shard\)"):
        prepack(ckpt, tmp_path / "out", progress=False)


def test_bad_options_refused(qwen, tmp_path, monkeypatch):
    with pytest.raises(LayoutError, match="chunk_bytes must be a positive multiple of 4096"):
        prepack(qwen[0], tmp_path / "o", chunk_bytes=1000, progress=False)
    with pytest.raises(LayoutError, match="of at most 1,073,741,824, got 1125899906842624"):
        prepack(qwen[0], tmp_path / "o", chunk_bytes=2**50, progress=False)  # had failed every verified load
    with pytest.raises(LayoutError, match="tp=100000000, ep=1 make 100,000,000 ranks; an image job holds at most 65,536"):
        prepack(qwen[0], tmp_path / "o", tp=10**8, progress=False)  # had exhausted memory
    with pytest.raises(LayoutError, match="target 'vllm'; known: transformers, sglang"):
        prepack(qwen[0], tmp_path / "o", target="vllm", progress=False)
    with pytest.raises(LayoutError, match="not a directory"):
        prepack(tmp_path / "missing", tmp_path / "o", progress=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(LayoutError, match="out_dir is an empty path"):
        prepack(qwen[0], "", progress=False)  # --out "$UNSET": had written into the working directory
    assert not list((tmp_path / "cwd").iterdir())
    with pytest.raises(LayoutError, match="hf_dir is an empty path"):
        prepack("", tmp_path / "o", progress=False)
    with pytest.raises(LayoutError, match="model_id must be a string .*, got 123"):
        prepack(qwen[0], tmp_path / "o", model_id=123, progress=False)  # had been refused once written
    with pytest.raises(LayoutError, match="revision must be a string .*, got 5"):
        prepack(qwen[0], tmp_path / "o", revision=5, progress=False)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("alignment", [0, 16, 2.0, True, 3 << 8])
def test_a_tensor_alignment_no_reader_takes_is_refused_before_writing(qwen, tmp_path, monkeypatch, alignment):
    """0 had been a ZeroDivisionError and 2.0 a TypeError; 16 or 768 were written out in full and
    then refused by the metadata check of the temporary image."""
    monkeypatch.setattr(ImageWriter, "write", lambda *a, **k: pytest.fail("an image was written"))
    with pytest.raises(LayoutError, match=rf"tensor_alignment must be a power of two in 256..2\*\*56 \(what an "
                                          rf"image's readers take\), got {alignment!r}"):
        prepack(qwen[0], tmp_path / "o", tensor_alignment=alignment, progress=False)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------ CLI
def _cli(argv):
    parser = argparse.ArgumentParser(prog="flashboot")
    prepack_cmd.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_prepack_inspect_verify(qwen, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps to the terminal width
    out = tmp_path / "img"
    assert _cli(["prepack", str(qwen[0]), "--out", str(out), "--tp", "2", "--ep", "2", "--chunk-bytes", "64KiB",
                 "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 2 and report["family"] == "qwen3_moe" and len(report["ranks"]) == 2
    assert _cli(["inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tp_size"] == 2 and summary["ep_size"] == 2 and summary["key"]["digest"] == report["key_digest"]
    r1 = summary["ranks"][1]
    assert r1["experts"] == {"num_experts": 8, "local_start": 4, "local_count": 4}
    assert r1["tensor_counts"] == {"experts": 4, "non_experts": 21} and r1["dtypes"] == {"float32": 25}
    assert r1["regions"]["non_experts"]["offset"] % 4096 == 0
    assert _cli(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "qwen3_moe" in text and "tp=2 ep=2" in text and "4..7 of 8" in text
    assert _cli(["verify", str(out), "--no-progress"]) == 0
    assert capsys.readouterr().out.count(": OK") == 2
    # one flipped byte in rank 1: verify fails and names rank, chunk and byte range
    meta = read_image(out, 1).metadata
    offset = meta.tensors["model.layers.1.mlp.experts.down_proj"].offset + 70_000
    with open(out / "rank-1" / "image.bin", "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))
    assert _cli(["verify", str(out), "--no-progress", "--rank", "0"]) == 0
    capsys.readouterr()
    assert _cli(["verify", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    chunk = offset // (64 << 10)
    assert f"rank-1/image.bin (rank 1): chunk {chunk} (bytes {chunk * 65536:,}..{(chunk + 1) * 65536:,})" in err
    with pytest.raises(ChecksumMismatchError):
        verify_image(out, 1)


def test_cli_prepack_prints_report_and_warnings(mixed, tmp_path, capsys):
    assert _cli(["prepack", str(mixed[0]), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "warning:" in text and "mixed_bag" in text and "GB/s" in text


def test_cli_main_turns_layout_errors_into_exit_2(tmp_path, capsys):
    from flashboot.cli import main

    rc = main(["verify", str(tmp_path)])
    assert rc == 2 and "no prepack.json" in capsys.readouterr().err


def test_checksums_summed_while_writing_equal_a_read_back(mixed, qwen, tmp_path):
    """Pre-pack never reads its image back: the digests it records are those of the file (every
    dtype, fp8 and bool pieces at unaligned offsets; tp=2 pieces sliced out of the sources)."""
    from flashboot.kernels.checksum import chunk_checksums_host

    for name, ckpt, tp in (("mixed", mixed[0], 1), ("qwen1", qwen[0], 1), ("qwen2", qwen[0], 2)):
        prepack(ckpt, tmp_path / name, tp=tp, chunk_bytes=4096, progress=False)
        for rank in range(tp):
            img = read_image(tmp_path / name, rank)
            raw = np.frombuffer(img.path.read_bytes(), np.uint8)
            assert list(img.metadata.checksums.digests) == chunk_checksums_host(raw, 4096), (name, rank)


def test_shards_read_buffered_where_o_direct_is_refused(qwen, tmp_path, monkeypatch):
    from _io_helpers import refuse_direct_open

    reference = prepack(qwen[0], tmp_path / "direct", tp=2, progress=False)
    refuse_direct_open(monkeypatch)
    report = prepack(qwen[0], tmp_path / "buffered", tp=2, progress=False)
    assert report.read_io and all(m.startswith("buffered (the filesystem refuses O_DIRECT") for m in report.read_io.values())
    for rank in (0, 1):
        assert read_image(tmp_path / "buffered", rank).path.read_bytes() == \
            read_image(tmp_path / "direct", rank).path.read_bytes()
    assert reference.read_io


def test_o_direct_read_refused_midway_rereads_buffered(qwen, tmp_path, monkeypatch):
    import errno
    import fcntl
    import os

    from flashboot.layouts import checkpoint as ckpt_mod

    real = os.preadv
    tried = []

    def fake(fd, bufs, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            tried.append(off)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, off)

    path = qwen[0] / "model.safetensors"
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"the filesystem of {path} refuses O_DIRECT at open (the test above covers it)")
    monkeypatch.setattr(ckpt_mod.os, "preadv", fake)
    report = prepack(qwen[0], tmp_path / "out", progress=False)
    assert tried and all("refuses O_DIRECT reads" in m for m in report.read_io.values())
    verify_image(tmp_path / "out")


def test_a_shard_that_shrank_is_a_layout_error_naming_it(qwen, tmp_path):
    import shutil

    from flashboot.layouts.checkpoint import open_checkpoint

    src = Path(shutil.copytree(qwen[0], tmp_path / "hf"))
    checkpoint = open_checkpoint(src)  # headers read while the file was whole
    shard = src / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 4096)
    from flashboot.layouts.checkpoint import ShardReader, plan_reads

    batches = plan_reads(checkpoint, sorted(checkpoint.tensors, key=lambda n: checkpoint.tensors[n].data_start))
    with ShardReader(src) as reader, pytest.raises(LayoutError, match=f"{shard}: ends at byte .*the file shrank"):
        for b in batches:
            reader.read(b)


def test_local_checkpoints_of_one_model_have_their_own_image_keys(tmp_path):
    """Two local checkpoints of one model and config (``step-1000/hf``, ``step-2000/hf``: both
    ``_name_or_path`` the base model) had one image key, so a clone expecting one took the other's
    seed; a copy of one keeps its key (the revision fingerprints the weights, not the path)."""
    import shutil

    from flashboot.flashclone.manifest import Manifest
    from flashboot.errors import RendezvousError

    keys = {}
    for step, seed in (("step-1000", 1), ("step-2000", 2)):
        save_tiny_model("llama", tmp_path / step / "hf", seed=seed)
    shutil.copytree(tmp_path / "step-1000", tmp_path / "copy-of-1000")
    for step in ("step-1000", "step-2000", "copy-of-1000"):
        flashboot.prepack(tmp_path / step / "hf", tmp_path / "img" / step, chunk_bytes=1 << 16, progress=False)
        keys[step] = read_job(tmp_path / "img" / step).key
    assert keys["step-1000"].model_id == keys["step-2000"].model_id  # the config's _name_or_path
    assert keys["step-1000"].revision.startswith("local-sha256:")
    assert keys["step-1000"].digest != keys["step-2000"].digest
    assert keys["copy-of-1000"].digest == keys["step-1000"].digest
    with read_image(tmp_path / "img" / "step-2000") as other:
        seed_manifest = Manifest.from_metadata(other.metadata)
    with pytest.raises(RendezvousError, match="key_digest"):
        seed_manifest.require(keys["step-1000"], "the seed")
