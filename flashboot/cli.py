"""The ``flashboot`` console script. Each command lives in its own module exposing
``register(subparsers)``; this file only lists them and dispatches."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from .errors import FlashBootError

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
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FlashBootError as exc:
        print(f"flashboot {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C: the command's own clean-up ran as the interrupt unwound it; say so in one line
        # (a page of threading frames told the user nothing), and exit as a shell reports SIGINT
        print(f"flashboot {args.command}: interrupted (SIGINT) before it finished", file=sys.stderr)
        if console:
            # end as an uncaught interrupt does: the interpreter's exit clean-up, then death by SIGINT, so
            # a shell loop running us stops too (an exit status of 130 let it go on); only the traceback goes
            sys.excepthook = _quiet_interrupt
            raise
        return 128 + signal.SIGINT
    except BrokenPipeError:
        if not _stdout_closed():  # a socket or pipe of the command's own: a real failure
            raise
        # the reader of our output went away (`| head`): stop quietly, as a tool that SIGPIPE
        # ends does, and keep the interpreter's last flush from printing a second traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _quiet_interrupt(kind, value, tb) -> None:
    if not issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)  # POLLERR and POLLHUP are always reported
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError):  # no file descriptor behind stdout (a test's capture): not ours to hide
        return False


if __name__ == "__main__":
    sys.exit(main())
