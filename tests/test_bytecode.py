"""FlashBoot's bytecode written ahead of time (``flashboot warm``), as a wheel's install writes it."""

from __future__ import annotations

import importlib.util
import marshal
import os
import sys
from pathlib import Path

import pytest

from flashboot.bytecode import bytecode_status, compile_bytecode, package_dirs, sources

from _python import run_python  # noqa: E402  (tests/ is on the path)


def test_every_module_a_process_imports_is_among_the_sources_compiled():
    code = ("import sys, flashboot, flashboot.flashclone.cloning, flashboot.flashload, flashboot.movers, flashboot.layouts\n"
            "import flashboot.kernels.checksum_gpu, flashboot.integrations.engine_key, flashboot.benchmarks.boot, "
            "flashboot.cli\n"
            "print('\\n'.join(sorted(m.__file__ for n, m in list(sys.modules.items())\n"
            "                        if n.split('.')[0] == 'flashboot' and getattr(m, '__file__', None))))")
    imported = {Path(f).resolve() for f in run_python("-c", code, timeout=300).split()}
    assert len(imported) > 50
    assert imported <= set(sources()), sorted(imported - set(sources()))
    dirs = package_dirs()
    assert len(dirs) == len(set(dirs)) and not any(a in b.parents for a in dirs for b in dirs)


def test_compile_bytecode_writes_every_module_where_python_reads_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "pyc"))
    assert bytecode_status() == {"modules": len(sources()), "with_bytecode": 0}
    written = compile_bytecode()
    assert len(written) == len(sources())
    for source, path in zip(sources(), written):
        assert path == importlib.util.cache_from_source(str(source)) and path.startswith(str(tmp_path / "pyc"))
        raw = Path(path).read_bytes()
        assert raw[:4] == importlib.util.MAGIC_NUMBER and marshal.loads(raw[16:]).co_filename == str(source)
    assert bytecode_status() == {"modules": len(sources()), "with_bytecode": len(sources())}


def test_bytecode_status_counts_only_bytecode_that_matches_its_source(tmp_path, monkeypatch):
    """A module edited after ``flashboot warm`` (another size) is compiled again by a fresh process."""
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    for rel in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (root / rel).write_text(f"X = {rel!r}\n")
    import flashboot.bytecode as bc

    monkeypatch.setattr(bc, "package_dirs", lambda: [root])
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "pyc"))
    assert [p.relative_to(root).as_posix() for p in sources()] == ["__init__.py", "a.py", "sub/__init__.py", "sub/b.py"]
    assert len(compile_bytecode()) == 4
    assert bytecode_status() == {"modules": 4, "with_bytecode": 4}
    (root / "sub" / "b.py").write_text("X = 'changed, longer'\n")
    assert bytecode_status() == {"modules": 4, "with_bytecode": 3}
    Path(importlib.util.cache_from_source(str(root / "a.py"))).write_bytes(b"\0" * 8)  # truncated
    assert bytecode_status() == {"modules": 4, "with_bytecode": 2}


def test_bytecode_that_cannot_be_written_is_named_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "file"))  # a directory that cannot be made
    with pytest.warns(RuntimeWarning) as warned:
        assert compile_bytecode() == []
    messages = [str(w.message) for w in warned]
    assert len(messages) == len(sources()) and all(f"cannot write {tmp_path / 'file'}" in m for m in messages)
    clone_py = str(Path(importlib.util.find_spec("flashboot.flashclone.cloning").origin).resolve())
    assert any(m.endswith(f"a fresh process compiles {clone_py} when it imports it") for m in messages)


def test_a_fresh_process_under_dont_write_bytecode_reads_what_warm_wrote(tmp_path):
    """PYTHONDONTWRITEBYTECODE stops imports writing bytecode, not reading it: after ``flashboot
    warm`` such a process finds every module's bytecode current."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp_path / "pyc")}
    status = ("-c", "import json; from flashboot.bytecode import bytecode_status; print(json.dumps(bytecode_status()))")
    assert '"with_bytecode": 0' in run_python(*status, env=env)
    run_python("-m", "flashboot.cli", "warm", "--device", "cpu", env=env, timeout=600)
    n = len(sources())
    assert f'{{"modules": {n}, "with_bytecode": {n}}}' in run_python(*status, env=env)
