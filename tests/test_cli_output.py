"""What the command line prints and accepts: a device given as a bare index, one unit system for
sizes, inspect's table at full width, one message for a missing image directory."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _io_helpers import image, image_master  # noqa: F401  (fixtures)

from flashboot import CapabilityError, Device
from flashboot.cli import main
from flashboot.flashload import shm as shm_files
from flashboot.layouts import read_image


def test_a_bare_index_names_a_cuda_device(monkeypatch):
    import flashboot._cuda as cuda

    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    assert Device.parse("0") == Device("cuda", 0) == Device.parse(0)
    assert Device.parse(" 1 ") == Device("cuda", 1)
    with pytest.raises(CapabilityError, match="has 2 CUDA device"):
        Device.parse("2")


def test_a_bare_index_without_cuda_says_there_is_no_device_not_that_it_cannot_parse(monkeypatch):
    import flashboot._cuda as cuda

    monkeypatch.setattr(cuda, "cuda_available", lambda: False)
    with pytest.raises(CapabilityError, match="cuda:0 was asked for but this machine has no CUDA device"):
        Device.parse("0")


def test_inspect_prints_full_column_names_and_binary_sizes_when_piped(image, capsys):
    assert main(["inspect", str(image)]) == 0  # capsys: not a tty, as in a pipe
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if " rank " in line and "┃" in line)
    for name in ("experts", "image", "expert region", "non-expert region", "tensors", "dtypes", "chunks"):
        assert f" {name} " in header, header
    assert "…" not in out
    img = read_image(image, 0)
    chunk_kib = img.metadata.checksums.chunk_bytes // 1024
    assert f"{len(img.metadata.checksums.digests)} x {chunk_kib} KiB" in out  # as --chunk-bytes 4KiB was written
    assert " KB" not in out and " MB" not in out


def test_prepack_and_inspect_print_markup_in_paths_and_names_as_text(tmp_path, capsys):
    # '[/x]' in a path raised rich's MarkupError after the image was written; '[red]' vanished
    from flashboot.benchmarks.checkpoints import make_checkpoint
    from _io_helpers import TINY

    make_checkpoint(str(tmp_path / "ckpt"), TINY, device="cpu")
    out = tmp_path / "img[/x]"
    assert main(["prepack", str(tmp_path / "ckpt"), "--out", str(out), "--model-id", "org/model[/bold]",
                 "--revision", "[red]rev", "--chunk-bytes", "4KiB", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "img[/x]" in text
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "img[/x]" in text and "org/model[/bold]@[red]rev" in text


def test_a_benchmark_table_prints_markup_in_its_title_and_cells_as_text(capsys):
    from flashboot.benchmarks.timing import print_table

    print_table("load of /data/img[/x]", ["what", "ms"], [["[red]ckpt", 1.5]])
    text = capsys.readouterr().out
    assert "/data/img[/x]" in text and "[red]ckpt" in text


@pytest.mark.parametrize("argv", [["verify", "{d}"], ["inspect", "{d}"], ["load", "{d}", "--device", "cpu"],
                                  ["preload", "{d}"], ["preload", "{d}", "--status"]])
def test_every_command_names_a_missing_image_directory_in_the_same_words(argv, tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    assert main([a.format(d=missing) for a in argv]) == 2
    assert f"{missing}: no such image directory" in capsys.readouterr().err
    assert not shm_files.staging_dir(missing).exists()


def test_movers_says_where_the_triton_kernels_run_and_it_is_true(capsys):
    import torch

    from flashboot._cuda import cuda_available
    from flashboot.kernels.copy import interpreting, sm_copy

    assert main(["movers"]) == 0
    lines = capsys.readouterr().out.splitlines()
    sm_line = next(line for line in lines if line.startswith("triton_sm "))
    kernels = lines[-1]
    if cuda_available():
        assert "available" in sm_line and "compiled for the GPU" in kernels
        return
    assert "unavailable" in sm_line and "GPU memory" in kernels
    assert interpreting()  # the tests' conftest sets TRITON_INTERPRET=1 without CUDA
    assert "run here under TRITON_INTERPRET=1" in kernels
    src = torch.arange(10_000, dtype=torch.int32).view(torch.uint8)  # and so they do, on host memory
    dst = torch.zeros_like(src)
    sm_copy(dst, src, stream=None, block_bytes=4096)
    assert torch.equal(dst, src)


def test_the_command_table_names_every_command_each_module_adds():
    from flashboot import cli

    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert list(sub.choices) == list(cli.COMMANDS)  # --help's order is the table's
    for command, module in cli.COMMANDS.items():
        only = next(a for a in cli.build_parser([command])._actions if a.dest == "command")
        assert command in only.choices
        assert {cli.COMMANDS[c] for c in only.choices} == {module}


def test_a_command_imports_only_its_own_module():
    code = ("import sys; from flashboot import cli; a = cli.build_parser(['clone', '--store', 'h:1']).parse_args("
            "['clone', '--store', 'h:1']); print(a.func.__module__, sorted(m for m in sys.modules "
            "if m.startswith('flashboot.commands.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["flashboot.commands.clone", "['flashboot.commands.clone']"]


def test_version_prints_the_installed_distributions_version():
    from importlib.metadata import version

    run = subprocess.run([sys.executable, "-m", "flashboot.cli", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"flashboot {version('flashboot')}"
