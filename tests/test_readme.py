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
    Qwen3-MoE of the same architecture, random weights) and its image ``images/qwen3``."""
    import flashboot
    from flashboot.layouts.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("readme")
    save_tiny_model("qwen3_moe", root / "hf" / "Qwen3-30B-A3B")
    flashboot.prepack(str(root / "hf" / "Qwen3-30B-A3B"), str(root / "images" / "qwen3"), progress=False)
    return root


class Background:
    """A ``flashboot`` command that runs until stopped, started in ``cwd``; :meth:`wait_for` a line
    of its output; :meth:`stop` sends SIGTERM and waits."""

    def __init__(self, argv: list[str], cwd, env=None):
        self.proc = subprocess.Popen([sys.executable, "-m", "flashboot.cli", *argv], cwd=cwd, env=env or _env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []

    def wait_for(self, text: str, timeout_s: float = RUN_TIMEOUT_S) -> None:
        import selectors
        import time

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, f"{self.proc.args} exited {self.proc.returncode}: {self.lines}"
            left = deadline - time.monotonic()
            assert left > 0, f"{self.proc.args} did not print {text!r} within {timeout_s:g} s: {self.lines}"
            if sel.select(min(left, 1.0)):
                self.lines.append(self.proc.stdout.readline())
        sel.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.proc.stdout.close()


def _run_python(code: str, cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _on_this_machine(code: str) -> str:
    """A block that names the GPU, with ``cpu`` in its place where there is none."""
    return code if DEVICE != "cpu" else code.replace('"cuda:0"', '"cpu"')


def test_the_readme_has_the_python_examples_this_test_runs():
    blocks = readme_blocks("python")
    assert len(blocks) == 5, "a python block was added to or removed from README.md: run it here too"
    assert "best_mover" in blocks[0] and "flashboot.prepack" in blocks[1] and "hand_over" in blocks[2]
    assert "loaded.sleep" in blocks[3]
    assert "flashboot.publish" in blocks[4] and "loaded.refit" in blocks[4]


def test_the_arena_and_movers_example_runs_as_written(readme_cwd):
    _run_python(readme_blocks("python")[0], readme_cwd)  # it picks its device itself


def test_the_model_example_runs_end_to_end(readme_cwd):
    out = _run_python(_on_this_machine(readme_blocks("python")[1]), readme_cwd).stdout
    assert "ms" in out  # the load report's summary
    assert (readme_cwd / "images" / "qwen3" / "prepack.json").is_file()


def test_the_hold_example_hands_an_arena_over_and_reopens_the_same_bytes(readme_cwd):
    from flashboot.layouts import read_image

    holder = Background(["hold", "--registry", "held"], readme_cwd)
    try:
        holder.wait_for("holder ready")
        image = read_image(readme_cwd / "images" / "qwen3", 0)
        check = (f"\nassert bytes(arena.bytes()[:{image.nbytes}].cpu().numpy()) == "
                 f"open({str(image.path)!r}, 'rb').read()\narena.close()\n")
        _run_python(_on_this_machine(readme_blocks("python")[2]) + check, readme_cwd)
        assert oct((readme_cwd / "held").stat().st_mode & 0o777) == "0o700"
    finally:
        holder.stop()


def test_the_sleep_example_wakes_the_same_bytes_at_the_same_addresses(readme_cwd):
    from flashboot.layouts import read_image

    image = read_image(readme_cwd / "images" / "qwen3", 0)
    check = (f"\nassert bytes(loaded.arena.bytes()[:{image.nbytes}].cpu().numpy()) == "
             f"open({str(image.path)!r}, 'rb').read()\nloaded.close()\n")
    out = _run_python(_on_this_machine(readme_blocks("python")[3]) + check, readme_cwd).stdout
    assert "backup" in out  # a level-1 sleep wakes from its own backup, and the summary says so


def test_the_refit_example_publishes_and_refits_the_trainers_tensors(readme_cwd):
    from flashboot.flashclone.rendezvous import free_port

    code = _on_this_machine(readme_blocks("python")[4]).replace("127.0.0.1:29650", f"127.0.0.1:{free_port()}")
    token = "import os\nos.environ['FLASHBOOT_TOKEN'] = 'readme-refit-token-0123456789'\n"
    check = ("\nimport torch\ncommon = [n for n in loaded.tensors if n in weights]\n"
             "assert common and loaded.version == 1\n"
             "assert all(torch.equal(loaded.tensors[n], weights[n]) for n in common)\n")
    out = _run_python(token + code + check, readme_cwd).stdout
    assert "published v1" in out and "refit v0 -> v1 (atomic" in out
