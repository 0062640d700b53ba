#!/usr/bin/env bash
# 2026-12-02, twelfth session, first device call (<= 9.5 min).
#   1. the GPU tests of the code merged after the eleventh session's last GPU run (the TMA mover's
#      rest table through table_for, the stream/event pool's lends, Plan.awaited): TMA ring, Triton
#      movers, copy kernels, CUDA streams, clone, weight update, refit in the engines;
#   2. shape C's early call taken apart in fresh processes (benchmarks/probes/early_call_parts.py):
#      metadata read, hash and decode, the strict read, the arena, the views by 1-12 threads;
#   3. issue 19's boot end to end for C at W = 0.25 s (the one cell missed), 3 fresh processes.
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session13.sh
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/gpu_prelude.sh"

say "=== 1. GPU tests ($(date +%T))"
timeout "$(left 200)" python3 -m pytest -q -p no:cacheprovider -m "gpu or two_gpus" tests/test_tma_ring.py \
  tests/test_triton_movers.py tests/test_copy_kernels.py tests/test_cuda_streams.py tests/test_clone_gpu.py \
  tests/test_weight_update.py tests/test_integrations_refit.py >/tmp/tests.log 2>&1
say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)|Error" /tmp/tests.log | head -12 | cut -c1-400 | tee -a "$S"

say "=== 2. the early call's parts, shape C ($(date +%T))"
P=benchmarks/probes/early_call_parts.py
timeout "$(left 60)" python3 "$P" make /tmp/ecp >/tmp/ecp.log 2>&1 || { say "make failed"; tail -5 /tmp/ecp.log | tee -a "$S"; }
for round in 1 2 3; do
  for th in 1 2 4 8 12; do
    timeout "$(left 30)" python3 "$P" run /tmp/ecp "$th" 2>>/tmp/ecp.log | tee -a "$OUT/early_call_parts.jsonl" >>"$S"
  done
done
tail -3 /tmp/ecp.log | cut -c1-300 | tee -a "$S"

SHAPES=C WS=0.25 REPEATS=3 WARM=0 BUDGET_S=$(left 300) bash "$(dirname "$0")/gpu_session11b.sh" >/dev/null 2>&1
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
