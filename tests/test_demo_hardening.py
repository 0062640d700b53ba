"""The demo's arguments and temporary files: a bad --workdir is refused before any work, and the
staging directory is removed whatever fails (host backend)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashboot import demo
from flashboot.errors import FlashBootError


def test_a_missing_workdir_is_refused_before_the_mover_round(tmp_path, monkeypatch, capsys):
    # it had run the whole mover round, then raised a raw FileNotFoundError
    monkeypatch.setattr(demo, "_mover_round", lambda *a: pytest.fail("the mover round ran first"))
    missing = tmp_path / "missing" / "dir"
    with pytest.raises(FlashBootError, match=f"demo --workdir {missing}: no such directory"):
        demo.run_demo(device="cpu", workdir=str(missing))
    from flashboot.cli import main

    assert main(["demo", "--device", "cpu", "--workdir", str(missing)]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_the_staging_directory_is_removed_when_the_pipeline_fails_before_staging(tmp_path, monkeypatch):
    import tempfile

    import flashboot.layouts.tiny as tiny

    made = []
    real = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(real(*a, **k)) or made[-1])

    def broken_save(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tiny, "save_tiny_model", broken_save)
    with pytest.raises(OSError, match="No space left"):
        demo._pipeline(demo.Device.parse("cpu"), tmp_path)
    assert [d for d in made if Path(d).exists()] == []
