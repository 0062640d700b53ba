"""``flashboot._lazy.import_early``: a long import started in the background, which the caller's
own import then waits for (a fresh ``flashboot clone`` starts torch's this way)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from flashboot._lazy import import_early


def _run(tmp_path, body: str) -> str:
    (tmp_path / "slowmod.py").write_text(textwrap.dedent("""
        import threading, time
        IMPORTED_BY = threading.current_thread().name
        time.sleep(0.3)
        LOADS = globals().get("LOADS", 0) + 1
    """))
    (tmp_path / "brokenmod.py").write_text("import time\ntime.sleep(0.2)\nraise RuntimeError('broken on purpose')\n")
    code = "import sys, time\nsys.path.insert(0, %r)\nfrom flashboot._lazy import import_early\n" % str(tmp_path)
    res = subprocess.run([sys.executable, "-c", code + textwrap.dedent(body)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and not res.stderr, res.stderr[-2000:]
    return res.stdout.split()


def test_the_callers_import_waits_for_the_early_one_and_gets_its_module(tmp_path):
    out = _run(tmp_path, """
        t0 = time.perf_counter()
        thread = import_early("slowmod")
        returned = time.perf_counter() - t0
        import slowmod
        print(slowmod.IMPORTED_BY, slowmod.LOADS, returned < 0.2, thread.is_alive())
    """)
    assert out == ["flashboot-import-slowmod", "1", "True", "False"]


def test_a_failed_early_import_raises_in_the_caller_not_in_the_thread(tmp_path):
    """The thread drops the error (no traceback on stderr) and leaves nothing in sys.modules;
    the caller's own import then runs it again and raises. (An import racing with the failure
    itself can get the half-run module: a CPython race, so the caller imports after the end.)"""
    out = _run(tmp_path, """
        thread = import_early("brokenmod")
        thread.join(5)
        print("alive:", thread.is_alive(), "in_sys_modules:", "brokenmod" in sys.modules)
        try:
            import brokenmod
        except RuntimeError as exc:
            print("raised:", exc.args[0].replace(" ", "_"))
    """)
    assert out == ["alive:", "False", "in_sys_modules:", "False", "raised:", "broken_on_purpose"]


def test_only_top_level_modules():
    with pytest.raises(ValueError, match="top-level module, not 'torch.distributed'"):
        import_early("torch.distributed")
