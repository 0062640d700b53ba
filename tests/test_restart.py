"""flashboot.load(..., holder=): an engine restart maps the held arena instead of loading (host
backend), and every way that cannot happen ends in a warning and a normal load."""

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import flashboot
from flashboot.errors import ArenaError, FlashBootError
from flashboot.flashclone.holder import Holder, held_record
from flashboot.flashload.restart import HolderOption

from _clone_helpers import serving_holder, spawn_cli, stop, wait_until
from _image_helpers import rewrite_metadata
from _preload_helpers import make_tiny_image


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("restart"))


@pytest.fixture
def holder(tmp_path):
    registry = tmp_path / "registry"
    with serving_holder(Holder(registry=registry)):
        yield registry


def held_name(image_dir) -> str:
    return HolderOption(registry="-").name_for(image_dir, 0, "cpu")


def image_bytes(image_dir) -> bytes:
    return flashboot.layouts.read_image(image_dir, 0).path.read_bytes()


def views(loaded) -> dict:
    return {n: bytes(t.contiguous().view(-1).view(torch.uint8).numpy()) for n, t in loaded.tensors.items()}


def test_restart_maps_the_held_arena_without_a_copy(image, holder):
    name = held_name(image)
    assert re.fullmatch(r"image-[0-9a-f]{12}\.rank0\.cpu", name)
    with pytest.warns(RuntimeWarning, match=rf"not restarting from the holder \(nothing is held as '{name}'"):
        first = flashboot.load(image, 0, "cpu", stream=True, holder=holder)
    assert first.report.details["handed_over_as"] == name
    with pytest.raises(ArenaError, match=f"cannot sleep: .*holder '{name}'"):
        first.sleep(level=2)  # the holder maps it: refused by name
    want = views(first)
    arena_id = first.arena.arena_id
    first.close()  # the engine exits; the holder keeps the memory
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = flashboot.load(image, 0, "cpu", stream=True, holder={"registry": holder})
    with again:
        r = again.report
        assert r.mode == "held" and r.h2d_ms == 0 and r.details["holder_pid"] == os.getpid()
        assert again.arena.arena_id == arena_id and again.arena.imported
        assert views(again) == want
        assert bytes(again.arena.bytes()[:again.nbytes].numpy()) == image_bytes(image)
    listing = subprocess.run([sys.executable, "-m", "flashboot.cli", "hold", "--list", "--registry", str(holder)],
                             capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    line = listing.stdout.strip()
    nbytes = image_bytes(image).__len__()
    assert line.startswith(f"{name}: ") and f"rank 0 ({nbytes:,} bytes, metadata " in line
    assert ", held " in line and line.endswith(" s")


def test_a_held_arena_written_to_since_is_refused_by_verify_and_loaded_normally(image, holder):
    """verify=True on a restart had been skipped (the report said "verify=False"): a held arena
    with a stray write came back as the weights."""
    with pytest.warns(RuntimeWarning, match="nothing is held"):
        first = flashboot.load(image, 0, "cpu", stream=True, holder=holder)
    first.arena.bytes()[1000] ^= 0xFF  # a stray write before the engine exits
    first.close()
    with pytest.warns(RuntimeWarning, match=rf"the arena held as '{held_name(image)}' cannot be bound or does not verify: "
                                            r".*chunk 0"):
        again = flashboot.load(image, 0, "cpu", stream=True, holder=holder, verify=True)
    with again:
        assert again.report.mode.startswith("streamed") and again.report.verified_text().startswith("verified")
        assert bytes(again.arena.bytes()[:again.nbytes].numpy()) == image_bytes(image)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fresh load was handed over in the damaged one's place
        third = flashboot.load(image, 0, "cpu", stream=True, holder=holder, verify=True)
    with third:
        assert third.report.mode == "held" and third.report.verified_text().startswith("verified: ")
    with flashboot.load(image, 0, "cpu", stream=True, holder=holder) as fourth:
        assert fourth.report.mode == "held"
        assert fourth.report.verified_text() == ("not verified: off by default on the host backend, where it costs ~2x "
                                                 "the copy; verify=True checks")


def test_a_restart_does_not_wait_for_an_unused_early_stream(image, holder, monkeypatch):
    """load(holder=, prepared=h) while h's early stream still ran: the restart had waited up to 30 s
    in h.close(), then taken the timeout for a failure to bind, dropped the bound held image
    unclosed and failed "the prepared load ... is closed". Now the held image returns at once and
    the handle stops its stream and releases its arena when the chunk in hand is done."""
    import time

    from flashboot.arena import Arena
    from flashboot.flashload import stream

    with pytest.warns(RuntimeWarning, match="nothing is held"):
        flashboot.load(image, 0, "cpu", stream=True, holder=holder).close()
    real, reads, gate = stream._preadv, [], threading.Event()

    def slow(fd, bufs, off):
        reads.append(off)
        gate.wait(10)  # the disk answers once the restart has returned
        return real(fd, bufs, off)

    monkeypatch.setattr(stream, "_preadv", slow)
    handle = flashboot.prepare(image, 0, "cpu", stream_buffer_bytes={"buffer_bytes": 4 * 4096, "slot_bytes": 4096,
                                                                      "adapt_reads": False})
    wait_until(lambda: reads, 10, "the early stream's first read")
    created = []
    real_create = Arena.create.__func__
    monkeypatch.setattr(Arena, "create", classmethod(lambda c, *a, **k: created.append(real_create(c, *a, **k))
                                                     or created[-1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = flashboot.load(image, 0, "cpu", holder=holder, prepared=handle)
    gate.set()
    with again:
        assert again.report.mode == "held" and created == []
        assert bytes(again.arena.bytes()[:again.nbytes].numpy()) == image_bytes(image)
    # released by its thread once the stream stopped
    wait_until(lambda: handle.done and (handle.arena is None or handle.arena.closed), 10, "the handle's release")
    n_chunks = -(-len(image_bytes(image)) // 4096)
    assert len(reads) < n_chunks  # the stream stopped, it did not read the whole image for nothing


def test_another_version_is_refused_by_name_and_loaded_normally(image, holder, tmp_path):
    with pytest.warns(RuntimeWarning, match="nothing is held"):
        flashboot.load(image, 0, "cpu", stream=True, holder=HolderOption(registry=str(holder), name="w")).close()
    repacked = shutil.copytree(image, tmp_path / "image")
    rank_dir = flashboot.layouts.read_image(repacked, 0).path.parent
    meta = json.loads((rank_dir / "metadata.json").read_text())
    meta["note"] = "re-packed"
    rewrite_metadata(rank_dir, meta)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = flashboot.load(repacked, 0, "cpu", stream=True, holder={"registry": holder, "name": "w"})
        gc.collect()
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert any(re.search(r"the arena held as 'w' is another image or version \(metadata_sha256: held '[0-9a-f]{64}', "
                         r"wanted '[0-9a-f]{64}'\): refused before binding", m) for m in messages), messages
    # the held arena was mapped beside the metadata read, then closed, not dropped (a ResourceWarning)
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    with loaded:
        assert loaded.report.mode.startswith("streamed") and "refused before binding" in loaded.report.details["not_restored"]
        assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == image_bytes(repacked)
    record = held_record("w", registry=holder)  # the new version replaced the old one
    assert record["image"]["image_dir"] == os.path.realpath(repacked)


def test_a_killed_holder_means_a_normal_load_with_warnings(image, tmp_path):
    registry = tmp_path / "registry"
    proc = spawn_cli("hold", "--registry", registry)
    try:
        wait_until(lambda: (registry / "held").is_dir(), 60, "the holder registry", proc)
        with pytest.warns(RuntimeWarning, match="nothing is held"):
            flashboot.load(image, 0, "cpu", stream=True, holder=str(registry)).close()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        with pytest.warns(RuntimeWarning) as caught:
            loaded = flashboot.load(image, 0, "cpu", stream=True,
                                    holder={"registry": registry, "handover_timeout_s": 0.5})
        messages = [str(w.message) for w in caught]
        assert any("cannot be mapped" in m and f"pid {proc.pid}" in m for m in messages), messages
        assert any("could not hand it to the holder" in m and "no holder adopted" in m for m in messages), messages
        with loaded:
            assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == image_bytes(image)
    finally:
        stop(proc)


def test_holder_option_is_checked():
    with pytest.raises(FlashBootError, match="exactly one of registry and store"):
        HolderOption(registry="/tmp/r", store="127.0.0.1:1")
    with pytest.raises(FlashBootError, match=r"unknown holder option\(s\) \['registery'\]"):
        HolderOption.of({"registery": "/tmp/r"})
    for bad in (0, -1, float("nan"), float("inf"), True, "5"):  # NaN had been taken: a hand-over waited forever
        with pytest.raises(FlashBootError, match=rf"holder handover_timeout_s must be a finite number of seconds in "
                                                 rf"\(0, .*\], got {re.escape(repr(bad))}"):
            HolderOption(registry="/tmp/r", handover_timeout_s=bad)
    assert HolderOption(registry="/tmp/r", handover_timeout_s=0.5).handover_timeout_s == 0.5
    for bad in ("../w", "a b", "", ".hidden", 7):  # had been a normal load at every start, with two warnings
        with pytest.raises(FlashBootError, match=rf"held-arena name must be letters, .*, got {re.escape(repr(bad))}"):
            HolderOption.of({"registry": "/tmp/r", "name": bad})


@pytest.mark.gpu
def test_restart_on_a_gpu_maps_the_held_arena_named_by_the_gpus_pci_address(image, holder):
    """The same restart on cuda:0: the held name and identity carry the GPU's PCI address (engines
    that each see their own GPU as cuda:0 keep their held arenas apart), and the restarted load
    binds the held bytes without a copy."""
    from flashboot.memory import Device
    from flashboot.pinning import gpu_pci_bus_id

    pci = gpu_pci_bus_id(Device.parse("cuda:0"))
    name = HolderOption(registry="-").name_for(image, 0, "cuda:0")
    assert name.endswith(".rank0.gpu" + pci.replace(":", "-")), (name, pci)
    with pytest.warns(RuntimeWarning, match="nothing is held"):
        first = flashboot.load(image, 0, "cuda:0", holder=holder)
    assert first.report.details["handed_over_as"] == name
    want = views_of_gpu(first)
    first.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = flashboot.load(image, 0, "cuda:0", holder=holder)
    with again:
        assert again.report.mode == "held" and again.report.h2d_ms == 0
        assert views_of_gpu(again) == want
        assert held_record(name, registry=holder)["image"]["gpu"] == pci


def views_of_gpu(loaded) -> dict:
    return {n: bytes(t.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for n, t in loaded.tensors.items()}
