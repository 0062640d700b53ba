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
pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 60)  # one command may take RUN_TIMEOUT_S


def readme_blocks(lang: str) -> list[str]:
    """The fenced code blocks of README.md opened with ```lang (``""``: the plain ones)."""
    blocks, current, opened = [], None, None
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            if current is None:
                current, opened = [], line[3:].strip()
            else:
                if opened == lang:
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _env() -> dict[str, str]:
    """This process's environment, the checkout's root kept off the children's ``sys.path``
    (``PYTHONSAFEPATH``): its ``kernels/`` folder would shadow Hugging Face's ``kernels``, which
    transformers >= 5.25 imports. The examples get FlashBoot as a user does, installed."""
    return dict(os.environ, PYTHONSAFEPATH="1")


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
        import threading

        self.proc = subprocess.Popen([sys.executable, "-m", "flashboot.cli", *argv], cwd=cwd, env=env or _env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def wait_for(self, text: str, timeout_s: float = RUN_TIMEOUT_S) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None or self._reader.is_alive(), \
                f"{self.proc.args} exited {self.proc.returncode}: {self.lines}"
            assert time.monotonic() < deadline, f"{self.proc.args} did not print {text!r} within {timeout_s:g} s: {self.lines}"
            time.sleep(0.05)

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> int:
        """Wait for it to exit by itself; its exit status."""
        code = self.proc.wait(timeout_s)
        self._reader.join(30)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self._reader.join(30)


def _terminate(pid: int, timeout_s: float = 60) -> None:
    """SIGTERM a detached process (not our child) and wait until it is gone."""
    import signal
    import time

    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):  # exited; its parent (init) reaps it
            return
        assert time.monotonic() < deadline, f"pid {pid} did not exit within {timeout_s:g} s of SIGTERM"
        time.sleep(0.05)


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


MODEL_CHECK = """
import glob
from safetensors.torch import load_file
params = dict(model.named_parameters())
assert not any(p.is_meta for p in params.values())
checked = 0
for f in glob.glob("hf/Qwen3-30B-A3B/*.safetensors"):
    for name, want in load_file(f).items():
        if name in params:
            assert torch.equal(params[name].cpu(), want), name
            checked += 1
assert checked >= len(params) // 2, (checked, len(params))
print("checked", checked, "of", len(params))
"""
"""Appended to the model example: every parameter is bound, and the ones the checkpoint names alike
hold its bytes."""


def test_the_model_example_runs_end_to_end(readme_cwd):
    out = _run_python(_on_this_machine(readme_blocks("python")[1]) + MODEL_CHECK, readme_cwd).stdout
    assert "ms" in out and "checked" in out, out  # the load report's summary, then the check


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


# ----------------------------------------------------------------------------- command lines
NOT_FLASHBOOT = {
    "make demo": "builds .venv and runs `flashboot demo`, which runs below",
    "make test": "builds .venv and runs this very suite",
}
"""Lines of README.md's shell blocks that are not ``flashboot`` commands, and why this test does
not run them. (Inline ``pip install ...`` and the engines' launchers are prose, not lines; the
engines run in ``make test-engines``.)"""

STORE_PORT_IN_README = "127.0.0.1:29600"


def readme_command_lines() -> list[str]:
    """Every ``flashboot`` command README.md shows, as written (comments stripped, whitespace
    joined): the lines of its shell blocks, commented commands in its python blocks, and inline
    code that starts with ``flashboot ``."""
    text = README.read_text()
    lines = []
    for block in readme_blocks(""):
        for line in block.splitlines():
            command = re.split(r"\s+#\s", line)[0].strip()
            if command.startswith("#") or not command:
                continue
            assert command.startswith("flashboot ") or command in NOT_FLASHBOOT, f"README line not run: {command!r}"
            if command.startswith("flashboot "):
                lines.append(command)
    for block in readme_blocks("python"):
        lines += [re.split(r"\s+#\s", m)[0].strip() for m in re.findall(r"^#\s*(flashboot .*)$", block, flags=re.M)]
    lines += [" ".join(m.split()) for m in re.findall(r"`(flashboot [^`]+)`", text)]
    return list(dict.fromkeys(lines))


def _split_outside_brackets(text: str, sep: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    i = 0
    while i < len(text):
        if text[i] == "[":
            depth += 1
        elif text[i] == "]":
            depth -= 1
        if depth == 0 and text.startswith(sep, i):
            parts.append(cur)
            cur, i = "", i + len(sep)
            continue
        cur += text[i]
        i += 1
    return parts + [cur]


def expand(line: str) -> list[list[str]]:
    """The concrete commands a template line stands for: ``A | B`` (two commands), ``[x|y]`` (none,
    x or y), ``a|b`` (each); placeholders filled by :func:`_fill`."""
    commands = []
    for k, part in enumerate(_split_outside_brackets(line, " | ")):
        part = part.strip()
        if k and not part.startswith("flashboot "):
            part = "flashboot " + part
        variants = [[]]
        for token in re.findall(r"\[[^\]]*\]|\S+", part):
            if token.startswith("["):
                inner = token[1:-1].split("|")
                options = [[]] + [alt.split() for alt in inner]
            else:
                options = [[alt] for alt in token.split("|")]
            variants = [v + o for v in variants for o in options]
        commands += variants
    return [_fill(c[1:]) for c in commands]


def _fill(argv: list[str]) -> list[str]:
    out = []
    for i, token in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev == "--registry" and token == "DIR":
            token = "held"
        elif prev in ("--tp", "--ep") and token == "N":
            token = "1"
        elif prev == "--clones" and token in ("N", "8") and argv[0] == "clone":
            token = "2"
        elif prev == "--device":
            token = DEVICE if DEVICE == "cpu" or token == "D" else token
        else:
            token = {"DIR": "images/qwen3", "DIR_OR_FILE": "images/qwen3", "HF": "hf/Qwen3-30B-A3B",
                     "HOST:PORT": STORE_PORT_IN_README, "R": "0", "NAME": "qwen3-rank0"}.get(token, token)
        out.append(token)
    return out


BENCH_SMALL = {
    "movers": ["--sizes", "1MB", "--repeats", "1"],
    "arena": ["--size", "8MiB", "--repeats", "1"],
    "tune": ["--size", "1MB", "--checksum-size", "1MB", "--quick"],
    "load": ["--scale", "0.0005", "--checkpoints", "A", "--warmup", "0", "--repeats", "1", "--dir", "load"],
    "boot": ["--shapes", "A", "--scale", "1e-4", "--loaders", "flashload prepared", "--dir", "boot"],
    "stream": ["--scale", "0.0005", "--ckpt-dir", "stream-ckpt", "--image-root", "stream-image"],
    "serve": ["--engines", "1", "--scale", "0.0005", "--repeats", "1", "--dir", "serve"],
    "soak": ["--cycles", "10", "--kinds", "load"],
    "clone": ["--nbytes", "1MB", "--clones", "1", "--sections", "clone", "--repeats", "1"],
    "swap": ["--scale", "0.0005", "--repeats", "1"],
    "refit": ["--checkpoint", "A", "--scale", "0.0005", "--repeats", "1"],
}
"""Appended to each ``bench`` line: the smallest run it takes (the README line gives no size; the
defaults are the GPU's, minutes long)."""


def readme_commands(store: str) -> dict[str, str]:
    """Every concrete command of the README (argv joined by spaces, without ``flashboot``) -> the
    README line it comes from; the README's store address replaced by ``store``."""
    expected = {}
    for line in readme_command_lines():
        for argv in expand(line):
            argv = [store if a == STORE_PORT_IN_README else a for a in argv]
            expected.setdefault(" ".join(argv), line)
    return expected


README_BENCHES = sorted({c.split()[1] for c in readme_commands(STORE_PORT_IN_README) if c.startswith("bench ")})


@pytest.mark.parametrize("what", README_BENCHES)
def test_a_readme_bench_line_runs(what, tmp_path):
    argv = ["bench", what, *BENCH_SMALL[what]]
    if DEVICE == "cpu" and what == "clone":
        argv += ["--device", "cpu"]  # its default is the GPUs
    proc = subprocess.run([sys.executable, "-m", "flashboot.cli", *argv], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if what == "tune" and not cuda_available():  # it tunes GPU kernels: refused, by name, here
        assert proc.returncode == 2 and "no CUDA device" in proc.stderr, proc.stdout + proc.stderr
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)  # some forty commands, each a fresh interpreter, on a shared machine
def test_every_command_line_of_the_readme_runs(tmp_path):
    import socket

    from flashboot.flashclone.holder import hand_over

    import flashboot

    with socket.socket() as s:  # a free port in place of the README's 29600 (the machine is shared)
        s.bind(("127.0.0.1", 0))
        store = f"127.0.0.1:{s.getsockname()[1]}"
    expected = {c: line for c, line in readme_commands(store).items() if not c.startswith("bench ")}  # see above
    ran: set[str] = set()
    env = _env() | {"FLASHBOOT_SHM": str(tmp_path / "shm"), "FLASHBOOT_TOKEN": "readme-test-token-0123456789"}
    from flashboot.layouts.tiny import save_tiny_model

    save_tiny_model("qwen3_moe", tmp_path / "hf" / "Qwen3-30B-A3B")

    def known(command: str) -> list[str]:
        assert command in expected, f"{command!r} is not a README line; README lines: {sorted(expected)}"
        ran.add(command)
        return command.split()

    def run(command: str, *extra: str, code: int = 0) -> str:
        proc = subprocess.run([sys.executable, "-m", "flashboot.cli", *known(command), *extra], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert proc.returncode == code, f"{command} {' '.join(extra)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout + proc.stderr

    def start(command: str, ready: str) -> Background:
        bg = Background(known(command), tmp_path, env)
        bg.wait_for(ready)
        return bg

    def stop(bg: Background) -> None:
        bg.stop()
        assert bg.proc.returncode == 0, bg.lines

    run("info")
    assert "host" in run("movers")
    for command in sorted(c for c in expected if c.startswith("prepack ")):
        run(command, "--no-progress")
    assert "non-expert region" in run("inspect images/qwen3")
    assert "OK" in run("verify images/qwen3")
    sim = "sim --topology gb300-nvl72 --schedule chain --clones 8 --model-bytes 217GB"
    run(sim)

    # the preloader: stage, stage in the background, serve, load from it, stop
    run("preload images/qwen3")
    assert "no preloader runs" in run("preload images/qwen3 --stop")
    run("preload images/qwen3 --background")
    served = start("preload images/qwen3 --serve", "serving")
    try:
        assert "ms" in run(f"load images/qwen3 --rank 0 --device {DEVICE}")
    finally:
        run("preload images/qwen3 --stop")
        served.proc.wait(60)
    run("preload images/qwen3 --serve --background")
    run("preload images/qwen3 --stop")
    assert "rank 0: staged" in run("preload images/qwen3 --status")
    assert "rank-0.img" in run("preload images/qwen3 --unstage")

    # FlashClone: a store of its own, a seed, clones of every schedule
    store_bg = start(f"store {store}", "store listening")
    seed = start(f"seed images/qwen3 --device {DEVICE} --store {store}", "seed ready")
    try:
        for command in sorted(c for c in expected if c.startswith("clone ") and "ring" not in c):
            out = run(command)
            assert ("verified byte-exact" in out) == ("--verify" in command), out
        for k, command in enumerate(sorted(c for c in expected if "--schedule ring" in c)):
            # each member runs the line (--clones 2); each run its own name, or a second would be a third member
            members = [Background(known(command) + ["--name", f"ring-{k}"], tmp_path, env) for _ in range(2)]
            for member in members:
                assert member.wait() == 0, member.lines
    finally:
        stop(seed)
        stop(store_bg)
    out = run(f"store {store} --background")
    _terminate(int(re.search(r"pid (\d+)", out).group(1)))

    # hold: hand an arena over, seed from it, list it
    holder = start("hold --registry held", "holder ready")
    try:
        with flashboot.load(tmp_path / "images" / "qwen3", 0, DEVICE, shm_dir=tmp_path / "shm") as loaded:
            hand_over(loaded.arena, "qwen3-rank0", registry=tmp_path / "held")
        seeded = start(f"seed --held qwen3-rank0 --registry held --device {DEVICE} --store {store}", "seed ready")
        stop(seeded)
        assert "qwen3-rank0:" in run("hold --registry held --list")
    finally:
        stop(holder)

    for command in sorted(c for c in expected if c.startswith("warm")):
        assert "checksum" in run(command)
    run("demo", "--size", "8MB")
    assert not set(expected) - ran, f"README lines this test did not run: {sorted(set(expected) - ran)}"
