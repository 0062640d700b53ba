"""Version skew, as a rolling upgrade makes it: a holder, a preloader, images and records of an
older FlashBoot meeting this one. Each older peer is played here by the bytes or messages its
version writes (no other checkout is needed): what this version must do with them is either
work byte-exact or refuse naming the versions and what differs, never wait out a timeout for
nothing, nor share memory with a peer it cannot see."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flashboot.errors import FlashBootError

pytestmark = pytest.mark.timeout(60)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_holder_refuses_a_registry_an_older_lockless_holder_still_serves(tmp_path):
    """A holder of a FlashBoot from before the registry's lock (2026-12-04 and earlier) takes no
    lock and writes records without its start time. This holder, started beside it on the same
    registry, had taken the lock and served too: both adopted every later request, so an arena
    released through one stayed mapped by the other. It is refused naming the other's pid, and
    starts once that holder is gone (dropping its records)."""
    from flashboot.flashclone.holder import Holder, list_held

    registry = tmp_path / "registry"
    for sub in ("requests", "held"):
        (registry / sub).mkdir(parents=True, mode=0o700)
    registry.chmod(0o700)
    old = _sleeper()
    try:
        record = {"descriptor": {"backend": "host", "pid": old.pid, "fds": [6], "nbytes": 2 << 20,
                                 "device_index": -1, "handle_type": "memfd", "granularity": 2 << 20,
                                 "segment_bytes": 256 << 20, "arena_id": "52e727636a7f78ee",
                                 "fabric_handles": None, "hostname": "vm"},
                  "request": "c9c01daf9d62a8fb", "since": 1.0, "holder_pid": old.pid, "image": None}
        (registry / "held" / "engine0.json").write_text(json.dumps(record))
        with pytest.raises(FlashBootError, match=rf"pid {old.pid} still holds 1 arena\(s\) here \(engine0\) without "
                                                 r"the registry's lock holder.lock: a holder of an older FlashBoot"):
            Holder(registry=registry)
        assert "engine0" in list_held(registry)  # its arena is that holder's: the record stays
    finally:
        old.kill()
        old.wait()
    with Holder(registry=registry) as holder:  # the lock was let go: the next start goes on
        assert list_held(registry) == {}
        assert any("engine0: removed the stale record" in e for e in holder.errors), list(holder.errors)


def test_a_served_load_hears_at_once_that_an_older_daemon_holds_a_pack_since_replaced(tmp_path, monkeypatch):
    """A preloader of an older FlashBoot (before 2026-12-01's status fields) answers its status
    without the metadata sha256 it holds. After the image is re-packed, a served load had waited
    its whole timeout for a re-staging that daemon never does, then advised re-running a preload
    that its lock refuses. It is refused at once, by the pre-pack its .ready names, telling to
    restart it."""
    import flashboot
    from flashboot.errors import LayoutError
    from flashboot.flashload.server import PreloadServer

    from _preload_helpers import TINY, Daemon, make_image

    image = make_image(tmp_path, TINY, chunk_bytes=4096)
    real_status = PreloadServer.status

    def older_status(self):  # the fields such a daemon's status had
        reply = real_status(self)
        return {"ok": True, "pid": reply["pid"], "image_dir": reply["image_dir"],
                "ranks": {r: {k: v for k, v in st.items() if k in ("state", "nbytes", "pin_ms", "error")}
                          for r, st in reply["ranks"].items()}}

    monkeypatch.setattr(PreloadServer, "status", older_status)
    d = Daemon(image, tmp_path / "shm")
    try:
        held = d.load_exact()  # the pre-pack it staged loads byte-exact
        assert held["ok"]
        flashboot.prepack(str(tmp_path / "ckpt"), str(image), progress=False, chunk_bytes=4096)  # a new job id
        with pytest.raises(LayoutError, match=r"holds rank 0 of another pre-pack .* by its \.ready: a preloader of an "
                                              r"older FlashBoot.*restart it: `flashboot preload .* --stop`"):
            flashboot.load(image, 0, "cpu", served=True, timeout_s=30, shm_dir=d.shm)
    finally:
        d.close()
