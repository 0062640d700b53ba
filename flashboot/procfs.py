"""Another process's state and start time, read from ``/proc/PID/stat``: whether a peer that went
quiet has exited or is stopped, and whether a pid still names the process that wrote it down."""

from __future__ import annotations

PID_MAX = 1 << 22
"""The largest pid Linux gives (``PID_MAX_LIMIT``): a larger one read from a file names no process."""

STOPPED = ("T", "t")
"""Process states of a stopped process: a SIGSTOP, a debugger, a frozen cgroup."""


def _proc_stat(pid) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (``[0]`` the state, ``[19]`` the start
    time in clock ticks), None when there is no such process here."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_state(pid) -> str:
    """The state letter of process ``pid`` (``R``, ``S``, ``T``/``t`` stopped: a SIGSTOP, a
    debugger, a frozen cgroup), or ``X`` when it has exited (gone, or a zombie)."""
    fields = _proc_stat(pid)
    return "X" if fields is None or fields[0] == "Z" else fields[0]


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks), None when the process is gone
    (or has exited and waits, a zombie, to be reaped by its parent)."""
    fields = _proc_stat(pid)
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[19])
