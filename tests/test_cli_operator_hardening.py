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

