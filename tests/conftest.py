"""Capability gating for GPU tests. Without CUDA, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before anything imports triton: Triton picks the interpreter
when a kernel is decorated.
"""

import os

import pytest

from flashboot._cuda import cuda_available, device_count

pytest_plugins = ["engine_gate"]  # --require-real-engines (make test-engines)

if not cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    n = device_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_two = pytest.mark.skip(reason=f"needs two CUDA devices, found {n}")
    for item in items:
        if "gpu" in item.keywords and n < 1:
            item.add_marker(skip_gpu)
        if "two_gpus" in item.keywords and n < 2:
            item.add_marker(skip_two)
