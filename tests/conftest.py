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


@pytest.fixture(scope="session")
def sglang_run(tmp_path_factory):
    """Real SGLang in one child process (_engine_helpers.SGLANG_SCRIPT): its plugin, pre-pack, load,
    refusals and release/resume of the weights. Here so that the SGLang tests and the vLLM tests
    (which refuse its image) share one run a session."""
    from _engine_helpers import HAVE_SGLANG, RESTART_CHECKS, SGLANG_SCRIPT, SLEEP_CHECKS, run_engine_script

    if not HAVE_SGLANG:
        pytest.skip("SGLang is not installed here (see docs/engines.md for the engine test venv)")
    return run_engine_script(SLEEP_CHECKS + RESTART_CHECKS + SGLANG_SCRIPT, tmp_path_factory.mktemp("sglang"))
