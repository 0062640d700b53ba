"""The ``flashboot`` console script. Each command lives in its own module exposing
``register(subparsers)``; this file only lists them and dispatches."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading

from .errors import FlashBootError, one_line

# The sub-commands, in the order `flashboot --help` shows them, and the module that adds each.
COMMANDS = {
    "info": "flashboot.commands.info",
    "movers": "flashboot.commands.info",
    "prepack": "flashboot.commands.prepack",
    "inspect": "flashboot.commands.prepack",
    "verify": "flashboot.commands.prepack",
    "preload": "flashboot.commands.preload",
    "load": "flashboot.commands.load",
    "seed": "flashboot.commands.clone",
    "clone": "flashboot.commands.clone",
    "hold": "flashboot.commands.clone",
    "store": "flashboot.commands.store",
    "bench": "flashboot.commands.bench",
    "demo": "flashboot.commands.demo",
    "sim": "flashboot.commands.sim",
    "warm": "flashboot.commands.warm",
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every sub-command, or, where ``argv`` starts with one, of that one's module
    only: a fresh ``flashboot clone`` process reaches its clone without importing (and building
    the parsers of) the other commands' modules, ~40 ms of Python on a 2-core host, all of it
    before its warm-up can start torch's import."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="flashboot", description="Sub-second weight loading for GPUs.")
    parser.add_argument("--version", action="version", version=f"flashboot {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = COMMANDS.get(argv[0]) if argv else None
    for name in dict.fromkeys(COMMANDS.values()):
        if wanted is None or name == wanted:
            importlib.import_module(name).register(sub)
    return parser


CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
"""c10d logs a warning (two lines, at times with C++ frames) for every store wait that runs out,
while FlashBoot already raises one error naming what was awaited: commands show c10's errors only,
unless the user set this variable. It is read once, when torch loads, so it is set before that."""


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault(CPP_LOG_LEVEL_ENV, "ERROR")
    console = argv is None  # the console script, not a caller in Python
    if console:
        _open_closed_std_fds()
    argv = sys.argv[1:] if argv is None else argv
    out = _Stdout(sys.stdout)
    sys.stdout = out
    try:
        with _stop_signals_as_interrupt():
            return _run(argv, console, out)
    finally:
        if sys.stdout is out:
            sys.stdout = out.stream


def _run(argv: list[str], console: bool, out: "_Stdout") -> int:
    command = argv[0] if argv and argv[0] in COMMANDS else None
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit:  # --help, --version, a usage error: argparse's own exit, unless its text was lost
        with contextlib.suppress(OSError):
            out.flush()
        if out.failed is None:
            raise
        return _output_failed(out, command)
    try:
        rc = int(args.func(args) or 0)
        out.flush()  # what is still buffered fails now, said in one line, not at the interpreter's exit
        return rc
    except FlashBootError as exc:
        print(f"flashboot {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        # Ctrl-C, or SIGTERM/SIGHUP (_stop_signals_as_interrupt): the command's own clean-up ran as the
        # interrupt unwound it; say so in one line (a page of threading frames told the user nothing)
        signame = str(exc) if str(exc) in _STOP_SIGNAL_NAMES else "SIGINT"
        print(f"flashboot {args.command}: interrupted ({signame}) before it finished", file=sys.stderr)
        if console and signame == "SIGINT":
            # end as an uncaught interrupt does: the interpreter's exit clean-up, then death by SIGINT, so
            # a shell loop running us stops too (an exit status of 130 let it go on); only the traceback goes
            sys.excepthook = _quiet_interrupt
            raise
        return 128 + signal.Signals[signame]
    except (OSError, SystemExit):
        # rich ends with SystemExit(1) on a broken pipe, after sending stdout to /dev/null itself
        if out.failed is None:  # a file or socket of the command's own: a real failure
            raise
        return _output_failed(out, args.command)


class _Stdout:
    """``sys.stdout`` while a command runs: the same stream, with a write or flush that fails
    remembered as stdout's. A full disk (``> file`` on a full filesystem, ``>/dev/full``) had
    ended a command with a traceback, and ``--help``/``--version`` (argparse drops the error) with
    status 0 and nothing written; told apart from a failure of the command's own files."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.failed: OSError | None = None

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as exc:
            self.failed = self.failed or exc
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as exc:
            self.failed = self.failed or exc
            raise

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _output_failed(out: _Stdout, command: str | None) -> int:
    """The exit of a command whose output could not be written: quietly, with the SIGPIPE status,
    where the reader of a pipe went away (`| head`), as a tool that SIGPIPE ends does; else one
    line naming why, and status 2. Either way stdout goes to /dev/null, so the interpreter's last
    flush of what is still buffered does not fail a second time (a traceback, status 120)."""
    exc = out.failed
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor behind stdout (a test's capture)
        pass
    if isinstance(exc, BrokenPipeError):
        return 128 + signal.SIGPIPE
    with contextlib.suppress(OSError):  # stderr as full as stdout: the status alone says it
        print(f"flashboot{' ' + command if command else ''}: error: cannot write the output to stdout: "
              f"{exc.strerror or exc}", file=sys.stderr)
    return 2


def _quiet_interrupt(kind, value, tb) -> None:
    if not issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)


_STOP_SIGNAL_NAMES = ("SIGTERM", "SIGHUP")


@contextlib.contextmanager
def _stop_signals_as_interrupt():
    """SIGTERM and SIGHUP raise KeyboardInterrupt (named by the signal) while the command runs, as
    Ctrl-C does, so its clean-up runs: by their default action (systemd's stop, timeout(1), a
    closed ssh session) a pre-pack had left its whole partial image behind, and any command its
    temporary files. A signal that is ignored (nohup) stays ignored; the serving loops set their
    own handlers while they serve."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for name in _STOP_SIGNAL_NAMES:
        sig = signal.Signals[name]
        if signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, _raise_interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _open_closed_std_fds() -> None:
    """A closed fd 0, 1 or 2 (``>&-``, ``2>&-``) is opened on /dev/null. Python had set
    ``sys.stdout`` or ``sys.stderr`` to None: a table then crashed on it (AttributeError), an
    error meant for stderr was printed on stdout (``print(file=None)`` writes there, into a
    ``--json`` reader), and the next file opened took the number."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself, the ones below are open
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))


if __name__ == "__main__":
    sys.exit(main())
