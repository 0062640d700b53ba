"""The command line misused as people do: Ctrl-C midway, output piped into `head`, numbers that
mean nothing, options that name nothing. Each gets one line naming the problem and a non-zero
exit, never a traceback, a hang or a success that did nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from _clone_helpers import fake_clone
from _io_helpers import image, image_master, shm  # noqa: F401  (fixtures)

from flashboot.cli import main


def test_ctrl_c_midway_ends_a_command_with_one_line_and_the_sigint_status(monkeypatch, tmp_path, capsys):
    import flashboot.flashload.prepack as prepack_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepack_module, "prepack", interrupted)
    try:
        rc = main(["prepack", str(tmp_path), "--out", str(tmp_path / "out")])
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped main(): the user sees a traceback")
    assert rc == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert err.strip() == "flashboot prepack: interrupted (SIGINT) before it finished"


def test_ctrl_c_ends_the_console_script_by_sigint_so_a_shell_loop_running_it_stops_too(tmp_path):
    code = ("import sys\n"
            "import flashboot.flashload.prepack as prepack_module\n"
            "def interrupted(*args, **kwargs):\n"
            "    raise KeyboardInterrupt\n"
            "prepack_module.prepack = interrupted\n"
            f"sys.argv = ['flashboot', 'prepack', {str(tmp_path)!r}, '--out', {str(tmp_path / 'out')!r}]\n"
            "from flashboot.cli import main\n"
            "sys.exit(main())\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # an exit status of 130 made bash go on to a loop's next command: only death by the signal stops it
    assert run.returncode == -signal.SIGINT, (run.returncode, run.stderr)
    assert run.stderr.strip() == "flashboot prepack: interrupted (SIGINT) before it finished", run.stderr


def test_output_piped_into_a_reader_that_left_ends_quietly_with_the_sigpipe_status():
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head -1` that has already exited: every write fails with EPIPE
    try:
        run = subprocess.run([sys.executable, "-m", "flashboot.cli", "sim", "--topology", "h200-x8", "--schedule",
                              "chain", "--clones", "2000", "--model-bytes", "1GB"],
                             stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert run.returncode == 128 + signal.SIGPIPE, run.stderr
    assert "Traceback" not in run.stderr and "BrokenPipeError" not in run.stderr, run.stderr


def test_a_broken_pipe_that_is_not_stdout_is_not_hidden(monkeypatch):
    import flashboot.commands.sim as sim

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")  # a socket of the command's own, say

    monkeypatch.setattr(sim, "main", broken)
    with pytest.raises(BrokenPipeError):
        main(["sim", "--topology", "h200-x8", "--schedule", "chain", "--clones", "2", "--model-bytes", "1GB"])


@pytest.mark.parametrize("timeout", ["nan", "-1", "0", "inf"])
def test_preload_refuses_a_timeout_that_is_no_wait_before_starting_a_preloader(image, shm, timeout, capsys):
    from flashboot.flashload import shm as shm_files

    with pytest.raises(SystemExit) as exc:
        main(["preload", str(image), "--shm-dir", str(shm), "--background", "--timeout", timeout])
    assert exc.value.code == 2
    assert "--timeout must be a finite number of seconds" in capsys.readouterr().err
    # nothing was started: a NaN had launched a background preloader and then killed it ("within nan s")
    assert not shm_files.staging_dir(image, shm).exists()


def test_hold_release_of_a_name_nothing_holds_is_an_error_not_released(tmp_path, capsys):
    from flashboot.flashclone.holder import REQUESTS

    registry = tmp_path / "held"
    assert main(["hold", "--registry", str(registry), "--release", "nosuch", "--timeout", "1"]) == 2
    captured = capsys.readouterr()
    assert "released" not in captured.out
    assert f"nothing is held as 'nosuch' in registry {str(registry)!r}" in captured.err
    # no release request left for a later holder (a read-only ask creates no registry folder either)
    assert not (registry / REQUESTS).exists() or list((registry / REQUESTS).iterdir()) == []


def test_hold_release_of_an_empty_name_is_refused_not_a_holder_started(tmp_path):
    # `--release ""` had been read as no --release at all: a holder started and served until killed
    run = subprocess.run([sys.executable, "-m", "flashboot.cli", "hold", "--registry", str(tmp_path / "held"),
                          "--release", ""], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "held-arena name must be" in run.stderr and "holder ready" not in run.stdout


def test_hold_release_waits_for_the_store_no_longer_than_its_timeout(monkeypatch, capsys):
    from flashboot.errors import RendezvousError
    from flashboot.flashclone.rendezvous import Rendezvous

    asked = []

    def silent_store(cls, address, token=None, **kw):
        asked.append(kw.get("timeout_s"))
        raise RendezvousError(f"no rendezvous store answered at {address}")

    monkeypatch.setattr(Rendezvous, "connect", classmethod(silent_store))
    monkeypatch.setenv("FLASHBOOT_TOKEN", "0123456789abcdef0123")
    # the connect had waited the store's own 60 s default (31 s against a silent listener), whatever --timeout said
    assert main(["hold", "--store", "127.0.0.1:9", "--release", "x", "--timeout", "1"]) == 2
    assert "no rendezvous store answered at 127.0.0.1:9" in capsys.readouterr().err
    assert asked == [1.0]


@pytest.mark.parametrize("schedule", [["--schedule", "ring", "--clones", "2"], ["--schedule", "chain"]])
def test_clone_names_a_missing_image_before_it_reaches_the_store(schedule, tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    # an unreachable store: only a check made before connecting can answer with the path
    argv = ["clone", "--store", "127.0.0.1:9", "--device", "cpu", "--image", str(missing), "--timeout", "1", *schedule]
    assert main(argv) == 2
    assert f"--image {missing}: no such image directory or file" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    ([], "seed needs an image DIR or --held NAME (with --registry)"),
    (["{d}", "--held", "x", "--registry", "r"], "not both (got '{d}' and --held 'x')"),
    (["{d}", "--registry", "r"], "--registry r is where --held NAME is looked up"),
])
def test_seed_says_which_of_dir_and_held_is_wrong(argv, says, tmp_path, capsys):
    d = str(tmp_path / "image")
    assert main(["seed", "--store", "127.0.0.1:9", "--device", "cpu", *(a.format(d=d) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert says.format(d=d) in err
    assert "not both" not in err or "--held 'x'" in err  # "not both" had been said when neither was given


@pytest.mark.parametrize("devices, says", [
    (["3=cpu"], "--device names rank(s) [3], which this preload does not stage (ranks [0])"),
    (["0=cpu", "0=cuda:1"], "--device names rank 0 twice ('cpu' and 'cuda:1')"),
])
def test_preload_refuses_a_device_for_a_rank_it_does_not_stage_or_named_twice(image, shm, devices, says, capsys):
    from flashboot.flashload import shm as shm_files

    argv = ["preload", str(image), "--shm-dir", str(shm)]
    for d in devices:
        argv += ["--device", d]
    assert main(argv) == 2  # both had been ignored (the last one winning), and the rank staged
    assert says in capsys.readouterr().err
    assert not shm_files.staging_dir(image, shm).exists()


@pytest.mark.parametrize("mode", ["--no-stream", "--served", "--pin-early"])
def test_load_refuses_a_stream_buffer_for_a_load_that_never_streams(image, shm, mode, capsys):
    argv = ["load", str(image), "--device", "cpu", "--shm-dir", str(shm), "--timeout", "1", mode,
            "--stream-buffer", "64MiB"]
    assert main(argv) == 2
    assert f"--stream-buffer sizes a streamed load's ring; a {mode} load never streams" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", ["chain", "star"])
def test_clone_refuses_pin_early_outside_a_ring(schedule, capsys):
    argv = ["clone", "--store", "127.0.0.1:9", "--device", "cpu", "--schedule", schedule, "--pin-early",
            "--timeout", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--pin-early pins a ring member's shard of --image; a {schedule} clone has no shard to pin" in err


@pytest.mark.parametrize("extra, says", [
    (["--store", "127.0.0.1:9", "--list"], "in --registry DIR or in --store HOST:PORT, not both"),
    (["--list", "--release", "x"], "--list and --release NAME are two commands: give one"),
])
def test_hold_refuses_options_it_would_ignore(extra, says, tmp_path, capsys):
    assert main(["hold", "--registry", str(tmp_path / "held"), *extra]) == 2
    assert says in capsys.readouterr().err


def test_hold_list_and_release_say_a_killed_holders_record_is_stale(tmp_path, capsys):
    from _clone_helpers import spawn_cli, stop, wait_until

    from flashboot.arena import Arena
    from flashboot.flashclone.holder import hand_over

    registry = tmp_path / "held"
    holder = spawn_cli("hold", "--registry", registry)
    try:
        wait_until(lambda: (registry / "held").is_dir(), 15, "the holder registry", holder)
        with Arena.create(2 << 20, "cpu") as arena:
            hand_over(arena, "weights", registry=str(registry), timeout_s=10)
        holder.kill()  # SIGKILL: its record stays behind it, and its memory is gone
        holder.wait(10)
    finally:
        stop(holder)
    assert main(["hold", "--registry", str(registry), "--list"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("weights: ") and f"STALE: its holder (pid {holder.pid}) has exited" in line, line
    # the release had waited out --timeout and blamed a holder for not answering
    assert main(["hold", "--registry", str(registry), "--release", "weights", "--timeout", "30"]) == 2
    err = capsys.readouterr().err
    assert f"'weights' is held no more: its holder (pid {holder.pid}) has exited" in err
    assert str(registry / "held" / "weights.json") in err


def test_ctrl_c_while_a_background_store_starts_leaves_no_store_running(monkeypatch, capsys):
    import flashboot.commands.store as store_command
    import flashboot.fdshare as fdshare

    started = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the parent waits for the store's ready line

    monkeypatch.setattr(store_command.subprocess, "Popen", popen)
    monkeypatch.setattr(fdshare, "readable", interrupted)
    try:
        assert main(["store", "127.0.0.1:0", "--background", "--timeout", "30"]) == 128 + signal.SIGINT
        assert len(started) == 1
        assert started[0].poll() is not None, "the detached store was left running"
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()


def test_clone_writes_its_json_report_into_a_pipe(monkeypatch, capsys):
    import json

    # the clone itself is not what is tested: only how its report reaches a pipe (`--json /dev/stdout | jq`)
    report = fake_clone(monkeypatch, "chain")
    read_end, write_end = os.pipe()
    try:
        rc = main(["clone", "--store", "127.0.0.1:9", "--device", "cpu", "--json", f"/dev/fd/{write_end}"])
        os.close(write_end)
        write_end = None
        with os.fdopen(read_end, "r") as pipe:
            read_end = None
            text = pipe.read()
    finally:
        for fd in (read_end, write_end):
            if fd is not None:
                os.close(fd)
    assert rc == 0  # seek() on the pipe had raised io.UnsupportedOperation once the clone was done
    assert json.loads(text) == report
    assert "chain #1 on cpu: 4,096 bytes" in capsys.readouterr().out


def test_warm_refuses_a_bad_device_before_writing_any_bytecode(monkeypatch, capsys):
    """`flashboot warm --device foo` wrote every module's bytecode (~0.5-0.9 s) and only then said
    the device could not be parsed."""
    import flashboot.bytecode

    monkeypatch.setattr(flashboot.bytecode, "compile_bytecode", lambda: pytest.fail("bytecode written"))
    assert main(["warm", "--device", "foo"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "cannot parse device 'foo'" in err
