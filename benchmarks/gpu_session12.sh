#!/usr/bin/env bash
# 2026-12-02, eleventh session, first device call (<= 9.5 min on one GPU, every step bounded).
#   1. the GPU tests of streams, clone (flags raised by one memset), weight update, remap, refit in the engines;
#   2. 200 refits (streams and events now lent by a pool: memory, fds and threads must stay flat);
#   3. bench refit A (issue 18: the in-place copy, with the executor's host time cut);
#   4. the Gluon TMA probe (issue 20: TMA straight from shared memory to global, batched at 4 and 1 MiB);
#   5. bench movers --chunked (the shipped TMA batch in the same run).
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session12.sh
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/gpu_prelude.sh"

say "=== 1. GPU tests ($(date +%T))"
timeout "$(left 110)" python3 -m pytest -q -p no:cacheprovider -m "gpu or two_gpus" tests/test_cuda_streams.py \
  tests/test_clone_gpu.py tests/test_weight_update.py tests/test_arena_remap.py tests/test_integrations_refit.py \
  >/tmp/tests.log 2>&1
say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)" /tmp/tests.log | head -12 | tee -a "$S"

say "=== 2. 200 refits ($(date +%T))"
soak_refit

say "=== 3. bench refit A ($(date +%T))"
bench_refit 5

say "=== 4. Gluon TMA probe ($(date +%T))"
timeout "$(left 100)" python3 benchmarks/probes/tma_gluon.py >"$OUT/tma_gluon.jsonl" 2>/tmp/tma_gluon.err
say "tma_gluon rc=$?"; tail -3 /tmp/tma_gluon.err | cut -c1-300 | tee -a "$S"; tail -2 "$OUT/tma_gluon.jsonl" | cut -c1-1500 | tee -a "$S"

say "=== 5. bench movers --chunked ($(date +%T))"
movers_chunked
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
