"""The one timing helper: warm-up, repeats, median; CUDA events on a stream, or the host clock.

Every benchmark reports GB/s and a ratio to a ceiling measured in the same run; this module
only measures.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable


_SLEEP_CYCLES_PER_MS = 2.0e6
"""``torch.cuda._sleep`` spins for cycles; about 2e6 per ms at H100/H200 clocks (only needs to outlast the enqueue)."""


@dataclass
class Timing:
    """Samples of one measured operation, in milliseconds."""

    samples_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    def gbps(self, nbytes: int) -> float:
        """Bytes per median time, in GB/s (1e9 bytes)."""
        return nbytes / (self.median_ms * 1e-3) / 1e9


def check_count(value, what: str, least: int = 1) -> int:
    """``value`` as an int >= ``least``, or FlashBootError naming ``what``: zero repeats had ended in
    statistics' 'no median for empty data' after the whole setup ran."""
    from flashboot.errors import FlashBootError

    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise FlashBootError(f"{what} must be an int >= {least}, got {value!r}")
    return value


def check_scale(value, what: str = "--scale") -> float:
    """``value`` as a finite float > 0, or FlashBootError naming ``what``: inf had ended in an
    OverflowError traceback from the checkpoint's dimensions, after the directories were made."""
    from flashboot.errors import FlashBootError
    from flashboot.units import is_finite_number

    if not is_finite_number(value) or value <= 0:
        raise FlashBootError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


def time_cuda(fn: Callable[[Any], None], *, device: int = 0, warmup: int = 2, repeats: int = 7,
              stream=None, inner: int = 1, gate_ms: float = 5.0) -> Timing:
    """Time ``fn(stream)`` on the device with CUDA events recorded on ``stream`` (default: a new one).

    ``fn`` must enqueue its work on the stream it is given. Each sample runs ``fn`` ``inner``
    times back to back and reports the time per call. Before the start event a spin kernel of
    about ``gate_ms`` keeps the stream busy while the host enqueues, so the sample measures the
    device executing the copies, not the host's launch latency (serving code enqueues copies
    ahead in the same way); ``gate_ms=0`` measures host enqueue plus execution instead.
    """
    import torch

    check_count(repeats, "repeats")
    with torch.cuda.device(device):
        stream = stream or torch.cuda.Stream(device=device)
        cycles = int(gate_ms * _SLEEP_CYCLES_PER_MS) if gate_ms > 0 else 0
        for _ in range(warmup):
            fn(stream)
        stream.synchronize()
        out = Timing()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if cycles:
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(cycles)
            start.record(stream)
            for _ in range(inner):
                fn(stream)
            end.record(stream)
            end.synchronize()
            out.samples_ms.append(start.elapsed_time(end) / inner)
        return out


def time_host(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5) -> Timing:
    """Time a synchronous ``fn()`` with the host's monotonic clock."""
    check_count(repeats, "repeats")
    for _ in range(warmup):
        fn()
    out = Timing()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.samples_ms.append((time.perf_counter() - t0) * 1e3)
    return out


def engine_context(device: str, *, loader: bool = False) -> None:
    """Make this fresh process engine-like before anything is timed: torch imported and, on CUDA,
    ``device``'s context created and current (an engine holds both before it loads), and with
    ``loader`` FlashBoot's loader imported as the engine plugins import it at start
    (:func:`flashboot.flashload.warm.import_loader`). Nothing else is warmed."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        torch.zeros(1, device=device)
        torch.cuda.synchronize()
    if loader:
        from flashboot.flashload.warm import import_loader

        import_loader(device)


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """A rich table on stdout."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # titles and cells carry paths and names: '[/x]' in one is text, not markup (MarkupError)
    table = Table(title=escape(title))
    for col in columns:
        table.add_column(escape(col), justify="right" if col not in ("mover", "path", "loader", "what") else "left")
    for row in rows:
        table.add_row(*(f"{v:,.3g}" if isinstance(v, float) else escape(str(v)) for v in row))
    Console(width=160).print(table)


def run_child(cmd: list[str], *, timeout_s: float, what: str) -> dict:
    """Run a benchmark's fresh child process ``cmd`` and return the JSON of its last stdout line;
    FlashBootError naming ``what`` when it outlasts ``timeout_s`` or fails (with its last lines)."""
    import subprocess

    from flashboot.errors import FlashBootError

    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FlashBootError(f"{what} took over {timeout_s:g} s") from None
    if p.returncode != 0:
        tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])
        raise FlashBootError(f"{what} exited {p.returncode}: {tail}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def check_json_path(path: str | None) -> None:
    """FlashBootError now, before the work, where the report cannot be written to ``path`` (a
    missing directory had been found only after a load had run, or a whole benchmark: its figures
    lost). ``path`` is emptied: a run that fails leaves no report, not an earlier run's report
    that reads as this one's."""
    if path in (None, "-"):
        return
    from flashboot.errors import FlashBootError

    import stat

    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise FlashBootError(f"cannot write the JSON report to {path}: {exc.strerror}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        # a FIFO, /dev/stdout, a tty: opened and closed now, a pipe's reader had its EOF before the
        # report, and the report's own write then blocked for ever with no reader; checked, not opened
        if stat.S_ISDIR(st.st_mode):
            raise FlashBootError(f"cannot write the JSON report to {path}: it is a directory")
        if not os.access(path, os.W_OK):
            raise FlashBootError(f"cannot write the JSON report to {path}: permission denied")
        return
    try:
        open(path, "w").close()
    except OSError as exc:
        raise FlashBootError(f"cannot write the JSON report to {path}: {exc.strerror}") from None


def dump_json(obj: Any, path: str | None) -> None:
    """Write ``obj`` as JSON to ``path`` ('-' for stdout); dataclasses are converted."""
    if path is None:
        return
    def default(o):
        if hasattr(o, "__dataclass_fields__"):
            return asdict(o)
        return str(o)
    text = json.dumps(obj, indent=2, default=default)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")
