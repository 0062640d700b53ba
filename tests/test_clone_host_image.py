"""The host image a clone falls back to (or a ring member loads its shard from): the preloader's
staged copy where it is of this pre-pack, read through its checked folder, else the image file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import flashboot
from flashboot.flashclone.sources import _HostImage
from flashboot.flashload import staging
from flashboot.flashload.shm import staged_paths
from flashboot.memory import CPU

from _clone_helpers import make_prepacked_image

pytestmark = pytest.mark.timeout(60)


def _bytes(img: _HostImage) -> np.ndarray:
    return np.frombuffer(img._mm, np.uint8, img.nbytes).copy()


def test_a_copy_staged_from_an_earlier_pre_pack_is_not_read_as_the_image(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    monkeypatch.setenv("FLASHBOOT_SHM", str(shm))
    image = make_prepacked_image(tmp_path)
    staging.stage_rank(image, 0, shm_dir=shm)
    staged = staged_paths(image, 0, shm).image
    img = _HostImage(image, CPU)
    try:
        assert img.path == str(staged)  # this pre-pack's staged copy: the same pages, no read of the disk
        first = _bytes(img)
    finally:
        img.close()

    # pre-packed again from other weights of the same shapes: the same size, other bytes
    g = torch.Generator().manual_seed(4)
    tensors = {f"layers.{i}.w": torch.randn(256, 1024, generator=g).bfloat16() for i in range(6)}
    tensors["embed"] = torch.randn(100, 64, generator=g)
    save_file(tensors, tmp_path / "ckpt" / "model.safetensors")
    flashboot.prepack(tmp_path / "ckpt", image, chunk_bytes=1 << 20, progress=False)
    image_file = flashboot.layouts.read_image(image, 0).path
    img = _HostImage(image, CPU)
    try:
        assert img.path == str(image_file), img.path  # the stale staged copy (same size) had been taken
        now = _bytes(img)
        assert np.array_equal(now, np.fromfile(image_file, np.uint8, img.nbytes))
        assert not np.array_equal(now, first)
    finally:
        img.close()
