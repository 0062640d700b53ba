"""The ``flashboot`` console script. Each command lives in its own module exposing
``register(subparsers)``; this file only lists them and dispatches."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import FlashBootError

# Modules that add sub-commands, in the order `flashboot --help` shows them.
COMMAND_MODULES = [
    "flashboot.commands.info",
    "flashboot.commands.prepack",
    "flashboot.commands.preload",
    "flashboot.commands.load",
    "flashboot.commands.clone",
    "flashboot.commands.store",
    "flashboot.commands.bench",
    "flashboot.commands.demo",
    "flashboot.commands.sim",
    "flashboot.commands.warm",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashboot", description="Sub-second weight loading for GPUs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
"""c10d logs a warning (two lines, at times with C++ frames) for every store wait that runs out,
while FlashBoot already raises one error naming what was awaited: commands show c10's errors only,
unless the user set this variable. It is read once, when torch loads, so it is set before that."""


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault(CPP_LOG_LEVEL_ENV, "ERROR")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FlashBootError as exc:
        print(f"flashboot {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
