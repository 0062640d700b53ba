"""The ``--require-real-engines`` gate (tests/engine_gate.py) that ``make test-engines`` uses:
a real-engine test that skips, fails or is missing fails the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _pytest(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_gate_case.py").write_text(body)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["engine_gate"]\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                           str(tmp_path), str(tmp_path), *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


PASSING = "def test_real_ok():\n    assert 1 + 1 == 2\n\ndef test_plain():\n    pass\n"
SKIPPING = PASSING + "import pytest\n\ndef test_real_engine_absent():\n    pytest.skip('engine not installed')\n"


@pytest.mark.parametrize("body, gate, rc, says", [
    (PASSING, True, 0, "1 of 1 test_real_* tests passed"),
    (SKIPPING, False, 0, "2 passed, 1 skipped"),
    (SKIPPING, True, 1, "test_real_engine_absent: skipped (Skipped: engine not installed)"),
    ("import pytest\n\n@pytest.mark.xfail\ndef test_real_x():\n    assert 0\n", True, 1, "test_real_x: skipped (xfail)"),
    ("def test_plain():\n    pass\n", True, 1, "no test_real_* test was collected"),
])
def test_the_gate_fails_a_run_whose_real_engine_tests_did_not_all_pass(tmp_path, body, gate, rc, says):
    proc = _pytest(tmp_path, body, *(["--require-real-engines"] if gate else []))
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert says in proc.stdout
