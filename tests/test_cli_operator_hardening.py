"""The command line as an operator scripts it: output into a full disk, a closed pipe or a closed
descriptor, ``--json -`` read by ``jq``, SIGTERM from systemd or timeout(1), SIGHUP from a closed ssh
session, logs read from a file. Each ends with one line and a status a script can act on, never a
traceback, a success that wrote nothing, or a partial output left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from _clone_helpers import fake_clone
from _io_helpers import TINY, image, image_master, shm  # noqa: F401  (fixtures)

from flashboot.cli import main

SIM = ["sim", "--topology", "h200-x8", "--schedule", "chain", "--clones", "4", "--model-bytes", "1GB"]


def _cli(argv, *, env=None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashboot.cli", *map(str, argv)], env=env, text=True,
                          timeout=120, **kwargs)


@pytest.mark.parametrize("unbuffered", ["1", None])
@pytest.mark.parametrize("argv", [[*SIM, "--json"], ["--version"], ["sim", "--help"]])
def test_output_into_a_full_disk_is_one_line_and_a_failure(argv, unbuffered):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    with open("/dev/full", "w") as full:
        run = _cli(argv, env=env, stdout=full, stderr=subprocess.PIPE)
    # it had been a traceback (status 1), or with buffered stdout "Exception ignored" (status 120);
    # --help and --version had said nothing and exited 0 (argparse drops the error)
    assert run.returncode == 2, run.stderr
    who = "flashboot sim" if argv[0] == "sim" else "flashboot"
    assert run.stderr == f"{who}: error: cannot write the output to stdout: No space left on device\n"


def test_a_table_piped_into_a_reader_that_left_ends_with_the_sigpipe_status(image):
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head -1` that has already exited
    try:
        run = _cli(["inspect", image], stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    # rich's own broken-pipe exit had made it status 1 (verify's "FAILED"), where sim's was 141
    assert run.returncode == 128 + signal.SIGPIPE, run.stderr
    assert run.stderr == ""


def _close(fd):
    return lambda: os.close(fd)


def test_a_closed_stdout_or_stderr_is_no_crash_and_no_error_on_stdout(image, tmp_path):
    run = _cli(["inspect", image], stderr=subprocess.PIPE, preexec_fn=_close(1))  # `>&-`
    assert run.returncode == 0, run.stderr  # AttributeError: 'NoneType' object has no attribute 'isatty'
    assert run.stderr == ""
    # `2>&-` and a JSON reader on stdout: the error had been printed on stdout, into the reader
    run = _cli(["inspect", tmp_path / "missing", "--json"], stdout=subprocess.PIPE, preexec_fn=_close(2))
    assert run.returncode == 2 and run.stdout == ""


def _prepack_signalled_midway(ckpt, out, signum: int, *, ignored: bool = False) -> subprocess.CompletedProcess:
    """``flashboot prepack`` that receives ``signum`` once every byte is written, before the commit."""
    code = ("import os, signal, sys, time\n"
            "import flashboot.flashload.prepack as p\n"
            "real = p._write_all\n"
            "def write_all(*a, **k):\n"
            "    r = real(*a, **k)\n"
            f"    os.kill(os.getpid(), {int(signum)})\n"
            "    time.sleep(0.5)\n"
            "    return r\n"
            "p._write_all = write_all\n"
            f"sys.argv = ['flashboot', 'prepack', {str(ckpt)!r}, '--out', {str(out)!r}, '--no-progress',\n"
            "            '--chunk-bytes', '4KiB']\n"
            "from flashboot.cli import main\n"
            "sys.exit(main())\n")
    ignore = (lambda: signal.signal(signum, signal.SIG_IGN)) if ignored else None  # as nohup starts it
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          preexec_fn=ignore)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from flashboot.benchmarks.checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    make_checkpoint(str(root), TINY, device="cpu")
    return root


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_clean_up_a_prepack_as_ctrl_c_does(ckpt, tmp_path, signum):
    out = tmp_path / "out"
    run = _prepack_signalled_midway(ckpt, out, signum)
    # killed by the default action, it had left the whole partial image in OUT/.tmp-* (systemd's stop,
    # timeout(1), a closed ssh session), kept until some later pre-pack into OUT swept it
    assert run.returncode == 128 + signum, run.stderr
    name = signal.Signals(signum).name
    assert run.stderr == f"flashboot prepack: interrupted ({name}) before it finished\n"
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_a_signal_ignored_at_start_stays_ignored(ckpt, tmp_path):
    out = tmp_path / "out"
    run = _prepack_signalled_midway(ckpt, out, signal.SIGHUP, ignored=True)  # `nohup flashboot prepack`
    assert run.returncode == 0, run.stderr
    assert (out / "prepack.json").is_file() and not list(out.glob(".tmp-*"))


def test_load_json_to_stdout_is_the_json_alone(image, shm, capsys):
    assert main(["load", str(image), "--device", "cpu", "--shm-dir", str(shm), "--json", "-"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # the phases' table had come first on stdout: `| jq` failed
    assert report["nbytes"] > 0 and report["rank"] == 0
    assert f"rank 0 -> cpu ({report['mode']}): {report['nbytes']:,} bytes" in captured.err
    assert "phases" in captured.err


def test_clone_json_to_stdout_is_the_report_alone(monkeypatch, capsys):
    report = fake_clone(monkeypatch, "star")
    assert main(["clone", "--store", "127.0.0.1:9", "--device", "cpu", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == report  # the summary line had come first
    assert captured.err.strip() == "star #1 on cpu: 4,096 bytes"


def test_clone_stopped_by_sighup_says_so_with_its_status(monkeypatch, capsys):
    import flashboot.flashclone as flashclone

    def hung_up(*args, **kwargs):
        raise KeyboardInterrupt("SIGHUP")  # what the command line's handler raises

    monkeypatch.setattr(flashclone, "prepare_clone", lambda *a, **k: None)
    monkeypatch.setattr(flashclone, "clone", hung_up)
    assert main(["clone", "--store", "127.0.0.1:9", "--device", "cpu"]) == 128 + signal.SIGHUP  # had been 130
    assert capsys.readouterr().err.strip() == "flashboot clone: stopped by SIGHUP before the clone finished"


def test_bench_json_to_stdout_is_the_json_alone(capsys, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["bench", "movers", "--paths", "host", "--sizes", "1MB", "--repeats", "1", "--json", "-"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)["rows"]  # the table had come first on stdout
    assert rows and rows[0]["mover"] == "host" and rows[0]["path"] == "host"
    assert "movers vs bare copy_" in captured.err
    assert list(tmp_path.iterdir()) == []  # its temporary report is gone


def test_preload_log_lines_are_text_on_one_line_in_a_file(image, tmp_path, capsys):
    from flashboot.flashload import shm as shm_files

    (tmp_path / "q[").mkdir()
    root = tmp_path / "q[" / ("x]" + "-long" * 20)  # '[/x]' in the path; longer than 80 columns
    assert main(["preload", str(image), "--shm-dir", str(root)]) == 0  # MarkupError after the pid file
    lines = capsys.readouterr().out.splitlines()
    # the warning that the root is no tmpfs names it, on one line (cut at 80 columns, it had not)
    warning = shm_files.not_shared_memory_warning(str(root))
    if warning is not None:
        assert warning in lines and f"{root} (from --shm-dir)" in warning, lines
    assert any(line.startswith("rank 0: staged 126,976 bytes in ") for line in lines), lines
    assert shm_files.staging_dir(image, root).is_dir()


def test_an_error_naming_a_path_with_a_newline_or_an_escape_sequence_is_one_line(tmp_path):
    """Printed raw, the newline split the error into a second line that read as a record of its own
    (`flashboot load: ok` forged by a directory's name), and ESC [31m restyled the terminal."""
    for name in ("a\nflashboot load: ok", "x\x1b[31mred\r"):
        (tmp_path / name).mkdir()
        run = _cli(["load", tmp_path / name], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert run.returncode == 2 and run.stdout == "", run
        assert run.stderr.count("\n") == 1 and "\x1b" not in run.stderr and "\r" not in run.stderr, run.stderr
        shown = name.encode("unicode_escape").decode()  # a\nflashboot..., x\x1b[31mred\r
        assert run.stderr == f"flashboot load: error: {tmp_path / shown}: no prepack.json: not a complete " \
                             "pre-packed image directory\n", run.stderr


def test_preload_log_and_status_lines_escape_a_newline_in_the_staging_root(image, tmp_path, capsys):
    root = tmp_path / "shm\nrank 0: staged 1 bytes"  # a forged log record, were the newline kept
    assert main(["preload", str(image), "--shm-dir", str(root)]) == 0
    logged = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("rank 0: staged 1 bytes") for line in logged), logged
    assert any(line.startswith("rank 0: staged 126,976 bytes in ") for line in logged), logged
    assert main(["preload", str(image), "--shm-dir", str(root), "--status"]) == 0
    status = capsys.readouterr().out.splitlines()
    assert status[0].startswith("preloader for ") and all(line.startswith("  ") for line in status[1:]), status
    assert any("shm\\nrank 0: staged 1 bytes/image-" in line for line in status), status


def test_warm_that_cannot_write_the_bytecode_says_so_in_one_line(monkeypatch, capsys, recwarn):
    import warnings

    import flashboot.bytecode
    import flashboot.kernels.warm

    def unwritable():  # as for a user who may not write the installed package
        for name in ("a", "b", "c"):
            warnings.warn(f"flashboot warm: cannot write /pkg/__pycache__/{name}.pyc (PermissionError: [Errno 13] "
                          f"Permission denied); a fresh process compiles /pkg/{name}.py when it imports it",
                          RuntimeWarning, stacklevel=2)
        return []

    monkeypatch.setattr(flashboot.bytecode, "compile_bytecode", unwritable)
    monkeypatch.setattr(flashboot.kernels.warm, "warm_checksum", lambda device: {})
    assert main(["warm", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("bytecode of 0 modules written in ")
    # a two-line warning per module had been shown: some 400 lines for the installed package
    assert err == ("flashboot warm: cannot write /pkg/__pycache__/a.pyc (PermissionError: [Errno 13] Permission "
                   "denied); a fresh process compiles /pkg/a.py when it imports it; and 2 more module(s) alike\n")
    assert not [w for w in recwarn if "cannot write" in str(w.message)]


def test_a_foreground_preload_stopped_by_sigterm_says_so_with_143_and_leaves_no_partial(image, tmp_path):
    """systemd stops a foreground ``flashboot preload``: its own SIGTERM handler stopped the copy,
    which then failed as "staging ... was interrupted", status 2, as if the stage had broken; a unit
    or script could not tell a stop from a failure."""
    shm = tmp_path / "shm"
    code = ("import os, signal, sys, time\n"
            "import flashboot.flashload.stage_copy as c\n"
            "real = c._pwrite\n"
            "def pwrite(fd, data, off):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(0.3)\n"
            "    return real(fd, data, off)\n"
            "c._pwrite = pwrite\n"
            f"sys.argv = ['flashboot', 'preload', {str(image)!r}, '--shm-dir', {str(shm)!r}, '--chunk-bytes', '4096']\n"
            "from flashboot.cli import main\n"
            "sys.exit(main())\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 128 + signal.SIGTERM, run.stderr
    assert "flashboot preload: interrupted (SIGTERM) before it finished" in run.stderr
    assert not [p for p in shm.rglob("*") if p.name.startswith("rank-")], list(shm.rglob("*"))
