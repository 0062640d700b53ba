"""FlashBoot's own imports stay lazy: CuPy, Triton and numba are imported only by the mover or
kernel that needs them. Each check runs in a fresh interpreter (host backend)."""

import subprocess
import sys

from _io_helpers import image, image_master, shm  # noqa: F401  (fixtures)

_SCRIPT = """
import sys
HEAVY = ("cupy", "triton", "numba")

def loaded():
    return sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))

import flashboot
print("import", loaded())
image, shm = sys.argv[1], sys.argv[2]
handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)     # nothing staged: streamed from disk
with flashboot.load(image, 0, "cpu", prepared=handle) as loaded_image:
    assert len(loaded_image.tensors) > 0
print("prepare+load", loaded())
with flashboot.load(image, 0, "cpu", shm_dir=shm, verify=True) as checked:  # the host checksum: numba only
    assert checked.report.details["verified"]
print("verified load", loaded())
"""


def test_cupy_triton_and_numba_are_imported_only_where_needed(image, shm):
    p = subprocess.run([sys.executable, "-c", _SCRIPT, str(image), str(shm)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = dict(line.split(" [", 1) for line in p.stdout.splitlines() if " [" in line)
    assert lines["import"] == "]"
    assert lines["prepare+load"] == "]"  # the stream's copy is numpy's; the views are torch's
    assert lines["verified load"] == "'numba']"  # the host checksum; never Triton for host memory


_CLONE_SCRIPT = """
import sys
HEAVY = ("cupy", "triton", "numba")

def loaded():
    return sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))

import flashboot, flashboot.flashclone, flashboot.cli
from flashboot.commands import clone as clone_command  # noqa: F401  (flashboot seed / clone / hold)
print("import", loaded())
from flashboot.arena import Arena
from flashboot.flashclone.manifest import Manifest
from flashboot.kernels.checksum_spec import checksum_reference

arena = Arena.create(1 << 20, "cpu")
data = arena.bytes().numpy()
data[:] = 7
chunk = 1 << 18
sums = tuple(checksum_reference(data[i:i + chunk]) for i in range(0, 1 << 20, chunk))
seed = flashboot.seed(sys.argv[1], arena, "cpu", manifest=Manifest(1 << 20, arena.nbytes, chunk, sums))
print("seed", loaded())
with flashboot.clone(sys.argv[1], "cpu", "star", verify=True, timeout_s=30) as r:
    assert bytes(r.arena.bytes().numpy()[:16]) == bytes([7] * 16)
print("clone", loaded())
seed.close()
"""


def test_clone_and_seed_import_no_cupy_triton_or_numba_until_a_mover_or_kernel_needs_it():
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "FLASHBOOT_TOKEN": "lazy-imports-test-token-0123456789"}
    p = subprocess.run([sys.executable, "-c", _CLONE_SCRIPT, f"127.0.0.1:{port}"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = dict(line.split(" [", 1) for line in p.stdout.splitlines() if " [" in line)
    assert lines["import"] == "]"
    assert lines["seed"] == "]"  # its manifest given: nothing to checksum
    assert lines["clone"] == "'numba']"  # the host mover's copy and the host checksum; never CuPy or Triton


def _imports_cupy(path) -> list[int]:
    """Lines of ``path`` that import CuPy, at module level or inside a function."""
    import ast

    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "cupy" or n.startswith("cupy.") for n in names):
            lines.append(node.lineno)
    return lines


def test_the_clones_cuda_path_has_no_cupy_import_anywhere(tmp_path):
    """What a clone or a seed on a GPU runs (the copy-engine mover, its streams, the executor, the
    warm-up, the transports, the arena) imports no CuPy, not even lazily: a CuPy import in a clone
    costs ~0.2 s with the GIL held."""
    from pathlib import Path

    import flashboot
    import flashboot.movers

    root, movers = Path(flashboot.__file__).parent, Path(flashboot.movers.__file__).parent
    files = [*(root / "flashclone").rglob("*.py"), *(root / "arena").glob("*.py"), root / "cuda_streams.py",
             root / "_cuda.py", *(movers / n for n in ("base.py", "batch.py", "copy_engine.py", "registry.py"))]
    assert len(files) > 20 and all(f.exists() for f in files)
    found = {str(f.relative_to(root.parent)): _imports_cupy(f) for f in files}
    assert {f: lines for f, lines in found.items() if lines} == {}
    lazy = tmp_path / "lazy.py"  # the check sees an import inside a function, and a from-import
    lazy.write_text("import os\n\ndef f():\n    import cupy.cuda\n\nfrom cupy import ndarray\n")
    assert sorted(_imports_cupy(lazy)) == [4, 6]


def test_asking_the_holder_imports_none_of_the_clone_machinery():
    """A restarted engine asks the holder first: importing ``flashboot.flashclone.holder`` ran the
    package's eager imports (the clone, its executor, the schedulers, the transports, the
    rendezvous: ~23 ms of a 31 ms first restart on the 2-core host)."""
    code = ("import sys, flashboot.flashload.restart, flashboot.flashclone.holder\n"
            "print(sorted(m for m in sys.modules if m.startswith(('flashboot.flashclone.', 'flashboot.schedulers'))))\n"
            "from flashboot.flashclone import clone, seed, CloneError\n"
            "print(callable(clone), callable(seed), CloneError.__name__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    first, second = p.stdout.splitlines()[-2:]
    assert first == ("['flashboot.flashclone.holder', 'flashboot.flashclone.holder_client', "
                     "'flashboot.flashclone.holder_refit', 'flashboot.flashclone.holder_registry']")
    assert second == "True True CloneError"  # the package's names resolve on first use, to the functions
