"""The load path on a machine that runs short, as a cluster node or a container is: an address
space limit (``ulimit -v``), a thread limit, few file descriptors. Each ends in the right bytes
or one clear error naming the resource and the numbers, never a ``.ready`` for bytes that were
not copied, and leaves no file, fd or thread behind; a later load on a healthy machine works.

The limits are set in a fresh process (``run_python``): they stay with the process."""

from __future__ import annotations

import os

import pytest


from _preload_helpers import make_tiny_image  # noqa: E402
from _python import run_python  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("limits"))


_UNDER_AS_LIMIT = """
import resource, sys
import flashboot, flashboot.flashload.staging, flashboot.fileio, numpy, torch
flashboot.load({image!r}, 0, "cpu", stream=True, verify=True).close()  # what a load imports, before the limit
def vm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm() + {extra}, resource.RLIM_INFINITY))
"""
"""A fresh process that has loaded ``image`` once, whose address space may then grow by ``extra``
bytes past what it maps."""


def test_a_load_under_ulimit_v_reads_small_files_without_mapping_their_limit(image, tmp_path):
    """``read_regular`` asked for ``max_bytes + 1`` at once, and Python allocates what is asked
    for before reading: every load mapped 1 GiB for a metadata.json of a few KB, a MemoryError
    under ``ulimit -v`` (or strict overcommit) before any byte of the image moved."""
    out = run_python("-c", _UNDER_AS_LIMIT.format(image=str(image), extra=256 << 20) + f"""
loaded = flashboot.load({str(image)!r}, 0, "cpu", shm_dir={str(tmp_path / "shm")!r}, verify=True)
print(loaded.report.details["verified"], loaded.report.mode)
loaded.close()
""")
    assert out.split()[0] not in ("False", "0"), out
    assert "streamed from disk" in out, out
