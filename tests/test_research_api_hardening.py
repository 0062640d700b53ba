"""The research API used as a researcher would: the movers benchmark at odd sizes, the chunked
benchmark's host fallback at odd chunk sizes, movers registered with bad names or signatures,
and plans with malformed steps or queries."""

from __future__ import annotations

import numpy as np
import pytest

import flashboot.movers  # noqa: F401  (registers every built-in mover)


# ---------------------------------------------------------------------------- bench movers
@pytest.mark.parametrize("sizes", [[1], [7, 4097], [1_000_003]])
def test_bench_movers_measures_a_size_that_is_not_a_multiple_of_8(sizes):
    """``--sizes 1`` had ended in torch's 'must be divisible by 8 to view Byte as Long' traceback."""
    from flashboot.benchmarks.movers import run

    rows = run(["host"], sizes, ["host"], repeats=1)
    assert [(r.mover, r.nbytes, r.verified) for r in rows] == [("host", n, True) for n in sizes]
