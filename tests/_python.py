"""A fresh Python process for a test: its stdout, or an assertion error showing its stderr."""

from __future__ import annotations

import os
import subprocess
import sys


def run_python(*args: str, timeout: float = 120, env: dict | None = None) -> str:
    """``python *args`` (``-c CODE ...`` or ``-m MODULE ...``) in a fresh process; its stdout."""
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def run_compiling(code: str, *, timeout: float = 600, env: dict | None = None) -> str:
    """``python -c code`` in a fresh process without ``TRITON_INTERPRET``: a test process without
    a GPU runs Triton's interpreter, whose kernels cannot be compiled, and whose runs patch
    ``triton.language`` for as long as they last (a compile beside one, in any thread, fails).
    ``env``: variables set on top of this process's."""
    child = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return run_python("-c", code, timeout=timeout, env={**child, **(env or {})})
