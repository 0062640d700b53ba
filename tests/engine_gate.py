"""``--require-real-engines``: fail the run unless every ``test_real_*`` test passed.

The real-engine tests skip where SGLang or vLLM is not importable (the project's CPU venv). In
the engine venv (``make test-engines``) such a skip would hide an engine that no longer imports or
a test that no longer runs, so there a skipped, xfailed or missing real-engine test fails the run.
Loaded from conftest.py; off unless the option is given.
"""

from __future__ import annotations

import pytest

REAL_PREFIX = "test_real_"


def pytest_addoption(parser):
    parser.addoption("--require-real-engines", action="store_true", default=False,
                     help="fail the run when any test_real_* test did not pass (skipped, xfailed, deselected "
                          "by an error) or when none was collected")


class RealEngineGate:
    """Tracks every collected ``test_real_*`` item and which of them passed."""

    def __init__(self):
        self.collected: list[str] = []
        self.passed: set[str] = set()
        self.not_passed: dict[str, str] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        self.collected = [item.nodeid for item in items if item.name.startswith(REAL_PREFIX)]

    def pytest_runtest_logreport(self, report):
        if not report.nodeid.rpartition("::")[2].startswith(REAL_PREFIX):
            return
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.not_passed[report.nodeid] = f"skipped ({'xfail' if hasattr(report, 'wasxfail') else reason})"
        elif report.failed:
            self.not_passed[report.nodeid] = f"failed in {report.when}"
        elif report.when == "call":
            self.passed.add(report.nodeid)

    def problems(self) -> list[str]:
        if not self.collected:
            return ["no test_real_* test was collected"]
        out = [f"{nodeid}: {self.not_passed.get(nodeid, 'did not run')}"
               for nodeid in self.collected if nodeid not in self.passed]
        return out

    def pytest_terminal_summary(self, terminalreporter):
        problems = self.problems()
        terminalreporter.section("real-engine gate (--require-real-engines)")
        terminalreporter.line(f"{len(self.passed)} of {len(self.collected)} test_real_* tests passed")
        for line in problems:
            terminalreporter.line(f"NOT PASSED: {line}", red=True)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        if self.problems() and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    if config.getoption("--require-real-engines"):
        config.pluginmanager.register(RealEngineGate(), "real-engine-gate")
