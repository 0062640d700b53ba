"""``flashboot bench load``: registered by :mod:`flashboot.commands.bench`; the code is in
:mod:`flashboot.benchmarks.load`."""

from __future__ import annotations


def register_bench(sub) -> None:
    from flashboot.benchmarks.load import register_bench as register

    register(sub)
