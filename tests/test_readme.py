"""The README runs as written: its python blocks, and every ``flashboot`` command line it shows,
taken from README.md itself, on the host backend (``cpu`` where a line names a GPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashboot._cuda import cuda_available

README = Path(__file__).resolve().parents[1] / "README.md"
DEVICE = "cuda:0" if cuda_available() else "cpu"
RUN_TIMEOUT_S = 600  # generous: the machine may be shared


def readme_blocks(lang: str) -> list[str]:
    """The fenced code blocks of README.md opened with ```lang."""
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(README.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.fixture(scope="module")
def readme_cwd(tmp_path_factory):
    """A working directory holding what the README's examples name: ``hf/Qwen3-30B-A3B`` (a tiny
    Qwen3-MoE of the same architecture, random weights)."""
    from flashboot.layouts.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("readme")
    save_tiny_model("qwen3_moe", root / "hf" / "Qwen3-30B-A3B")
    return root


def test_the_readme_has_the_python_examples_this_test_runs():
    blocks = readme_blocks("python")
    assert len(blocks) == 2, "a python block was added to or removed from README.md: run it here too"
    assert "best_mover" in blocks[0] and "flashboot.prepack" in blocks[1]


@pytest.mark.parametrize("index", [0, 1], ids=["arena-and-movers", "model-end-to-end"])
def test_a_readme_python_block_runs_as_written(index, readme_cwd):
    code = readme_blocks("python")[index]
    if DEVICE == "cpu":  # the model example names the GPU; the arena example picks its device itself
        code = code.replace('"cuda:0"', '"cpu"') if index == 1 else code
    proc = subprocess.run([sys.executable, "-c", code], cwd=readme_cwd, env=_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if index == 1:
        assert "ms" in proc.stdout  # the load report's summary
        assert (readme_cwd / "images" / "qwen3" / "prepack.json").is_file()
