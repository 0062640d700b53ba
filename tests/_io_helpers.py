"""Shared by the preloader, streamed-load and pre-pack tests: a tiny synthetic image and a
filesystem that refuses O_DIRECT. Not a conftest (tests import it)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from flashboot.benchmarks.checkpoints import CheckpointSpec, make_checkpoint

import flashboot

TINY = CheckpointSpec("tiny", layers=2, experts=4, expert_rows=64, expert_cols=32, hidden=32, vocab=64, shards=2)
CHUNK = 4096  # checksum chunk of the test images: a ~127 KB image has ~31 chunks


@pytest.fixture(scope="module")
def image_master(tmp_path_factory):
    """The tiny synthetic checkpoint, pre-packed once per test module."""
    root = tmp_path_factory.mktemp("tiny-image")
    make_checkpoint(str(root / "ckpt"), TINY, device="cpu")
    flashboot.prepack(str(root / "ckpt"), str(root / "image"), chunk_bytes=CHUNK, progress=False)
    return root / "image"


@pytest.fixture
def image(image_master, tmp_path):
    """A private copy of the tiny image (tests damage theirs)."""
    return Path(shutil.copytree(image_master, tmp_path / "image"))


@pytest.fixture
def shm(tmp_path):
    return tmp_path / "shm"


def refuse_direct_open(monkeypatch) -> None:
    """``os.open`` with O_DIRECT fails with EINVAL, as on a filesystem without it."""
    real_open = os.open

    def fake(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", fake)
