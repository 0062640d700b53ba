"""The ``flashboot`` console script. Each command lives in its own module exposing
``register(subparsers)``; this file only lists them and dispatches."""

from __future__ import annotations

import argparse
import importlib
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FlashBootError as exc:
        print(f"flashboot {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
