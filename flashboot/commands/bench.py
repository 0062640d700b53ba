"""``flashboot bench NAME``: each benchmark module registers one sub-command here."""

from __future__ import annotations

import importlib

# Modules exposing `register_bench(subparsers)`; one per benchmark.
BENCH_MODULES = [
    "flashboot.commands.bench_load",
    "flashboot.benchmarks.movers",
    "flashboot.benchmarks.arena",
    "flashboot.benchmarks.tune_kernels",
    "flashboot.benchmarks.clone",
    "flashboot.benchmarks.boot",
    "flashboot.benchmarks.stream",
    "flashboot.benchmarks.serve",
    "flashboot.benchmarks.soak",
    "flashboot.benchmarks.swap",
    "flashboot.benchmarks.refit",
]


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks: movers, load, clone, stream (table plus --json)")
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name in BENCH_MODULES:
        importlib.import_module(name).register_bench(sub)
    for bench in sub.choices.values():
        bench.set_defaults(func=_json_checked(bench.get_default("func")))


def _json_checked(main):
    """``main`` with its ``--json`` path checked (and emptied) before the benchmark runs: a path
    that cannot be written had failed only at the end, the run's figures lost with it, and a
    report left by an earlier run had stayed in place when this one failed."""
    import functools

    @functools.wraps(main)
    def run(args):
        from flashboot.benchmarks.timing import check_json_path

        check_json_path(getattr(args, "json", None))
        if getattr(args, "json", None) != "-":
            return main(args)
        return _json_alone_on_stdout(main, args)

    return run


def _json_alone_on_stdout(main, args):
    """Run ``main`` with ``--json -`` so that stdout carries the JSON alone (``| jq``): the report
    is written to a temporary file and copied to stdout at the end, the tables and progress lines
    go to stderr (they had come first on stdout, and no JSON reader could read it)."""
    import contextlib
    import os
    import sys
    import tempfile

    fd, path = tempfile.mkstemp(prefix="flashboot-bench-", suffix=".json")
    os.close(fd)
    args.json = path
    try:
        with contextlib.redirect_stdout(sys.stderr):
            rc = main(args)
        with open(path) as f:
            sys.stdout.write(f.read())
        return rc
    finally:
        args.json = "-"
        os.unlink(path)
