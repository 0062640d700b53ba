"""FlashBoot's own bytecode, written ahead of time as a wheel's install writes it.

pip compiles every module of a wheel it installs, so a fresh process imports bytecode. An editable
install (``pip install -e``, what CI and the GPU scripts use) compiles nothing, and under
``PYTHONDONTWRITEBYTECODE`` (set on our CPU and GPU machines) no import ever writes it: every
fresh process then compiles each module it imports. Measured on a 2-core host, ``import
flashboot.flashclone`` after torch took 68–78 ms from source and 26–31 ms from bytecode; on an
H200 host the clone's warm-up threads compiled its modules while the clone's own thread waited
for the GIL. ``flashboot warm`` calls :func:`compile_bytecode`; :func:`bytecode_status` says how
many modules have bytecode that Python would use, so a benchmark can say which case it measured.
"""

from __future__ import annotations

import importlib.util
import os
import py_compile
import warnings
from pathlib import Path

PACKAGES = ("flashboot", "flashboot.kernels", "flashboot.movers", "flashboot.layouts", "flashboot.benchmarks")
"""The distribution's top-level packages (pyproject's ``package-dir``: each may live in its own folder)."""


def package_dirs() -> list[Path]:
    """The folder of each of :data:`PACKAGES` that is installed, each once (a wheel nests them
    all under ``flashboot/``; an editable install maps each to its own top-level folder)."""
    dirs: list[Path] = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for location in spec.submodule_search_locations:
            path = Path(location).resolve()
            if not any(path == d or d in path.parents for d in dirs):
                dirs.append(path)
    return dirs


def sources() -> list[Path]:
    """Every ``.py`` file of the installed distribution, sorted."""
    found = []
    for root in package_dirs():
        for folder, subdirs, files in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__" and not d.startswith("."))
            found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found)


def compile_bytecode() -> list[str]:
    """Write the bytecode of every module of :func:`sources` where Python reads it
    (``__pycache__``, or under ``sys.pycache_prefix``), as pip does when it installs a wheel;
    returns the files written. One that cannot be written is a RuntimeWarning naming it and why
    (a fresh process then compiles that module when it imports it)."""
    written = []
    for source in sources():
        target = importlib.util.cache_from_source(str(source))
        try:
            written.append(py_compile.compile(str(source), cfile=target, doraise=True))
        except (py_compile.PyCompileError, OSError) as exc:
            warnings.warn(f"flashboot warm: cannot write {target} ({type(exc).__name__}: {exc}); a fresh process "
                          f"compiles {source} when it imports it", RuntimeWarning, stacklevel=2)
    return written


def bytecode_status() -> dict[str, int]:
    """``{"modules": N, "with_bytecode": M}``: of the distribution's N modules, how many have
    bytecode that matches their source (its recorded mtime and size), which a fresh process loads
    instead of compiling."""
    have = 0
    all_sources = sources()
    for source in all_sources:
        try:
            with open(importlib.util.cache_from_source(str(source)), "rb") as f:
                header = f.read(16)
        except OSError:
            continue
        if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
            continue
        if int.from_bytes(header[4:8], "little") & 1:  # hash-based (pip under SOURCE_DATE_EPOCH)
            fresh = header[8:16] == importlib.util.source_hash(source.read_bytes())
        else:
            st = source.stat()
            fresh = (int.from_bytes(header[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
                     and int.from_bytes(header[12:16], "little") == st.st_size & 0xFFFFFFFF)
        have += fresh
    return {"modules": len(all_sources), "with_bytecode": have}


__all__ = ["PACKAGES", "bytecode_status", "compile_bytecode", "package_dirs", "sources"]
