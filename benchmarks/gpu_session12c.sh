#!/usr/bin/env bash
# 2026-12-02, eleventh session, third device call (<= 9.5 min).
#   1. the GPU tests of the TMA ring (the mover's batches through Gluon), the Triton movers and copy kernels;
#   2. bench movers --chunked: the ring against the descriptor table ("triton_tma table") in the same run;
#   3. bench refit A again (issue 18's in-place copy, a second run on the executor with its host time cut).
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session12c.sh
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/gpu_prelude.sh"

say "=== 1. GPU tests ($(date +%T))"
timeout "$(left 150)" python3 -m pytest -q -p no:cacheprovider -m "gpu or two_gpus" tests/test_tma_ring.py \
  tests/test_triton_movers.py tests/test_copy_kernels.py >/tmp/tests.log 2>&1
say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)|Error" /tmp/tests.log | head -12 | cut -c1-400 | tee -a "$S"

say "=== 2. bench movers --chunked ($(date +%T))"
movers_chunked  # its batched rows include "triton_tma table"

say "=== 3. bench refit A ($(date +%T))"
bench_refit 5
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
