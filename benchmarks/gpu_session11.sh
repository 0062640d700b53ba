#!/usr/bin/env bash
# 2026-12-02, tenth session, first device call (<= 9.5 min on one GPU, every step bounded). The
# ninth session's last changes ran on the CPU host only: the executor's backends moved to
# flashclone/lanes.py and cuda_streams.wait_events starts a thread per wait. Here, on its code:
#   1. the GPU tests of streams, clone, weight update, remap, refit in the engines, stream;
#   2. issue 18's logits after a refit (bitwise against a from-scratch load) and 200 refit cycles;
#   3. bench refit A (its copy, remap and the per-parameter baseline);
#   4. bench movers --chunked (issue 20's per-call cost and batched copies, TMA at 4 MiB).
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session11.sh
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/gpu_prelude.sh"

say "=== 1. GPU tests ($(date +%T))"
timeout "$(left 110)" python3 -m pytest -q -p no:cacheprovider -m "gpu or two_gpus" tests/test_cuda_streams.py \
  tests/test_clone_gpu.py tests/test_weight_update.py tests/test_arena_remap.py tests/test_integrations_refit.py \
  tests/test_stream.py >/tmp/tests.log 2>&1
say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)" /tmp/tests.log | head -12 | tee -a "$S"

say "=== 2. logits after a refit, 200 refits ($(date +%T))"
timeout "$(left 90)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_weight_update_logits.py >/tmp/logits.log 2>&1
say "logits rc=$? :: $(tail -1 /tmp/logits.log)"; grep -E "^(FAILED|ERROR)|bitwise" /tmp/logits.log | head -6 | tee -a "$S"
soak_refit

say "=== 3. bench refit A ($(date +%T))"
bench_refit 3

say "=== 4. bench movers --chunked ($(date +%T))"
movers_chunked
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
