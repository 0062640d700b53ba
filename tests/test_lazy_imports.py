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
