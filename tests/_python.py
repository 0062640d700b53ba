"""A fresh Python process for a test: its stdout, or an assertion error showing its stderr."""

from __future__ import annotations

import subprocess
import sys


def run_python(*args: str, timeout: float = 120, env: dict | None = None) -> str:
    """``python *args`` (``-c CODE ...`` or ``-m MODULE ...``) in a fresh process; its stdout."""
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout
