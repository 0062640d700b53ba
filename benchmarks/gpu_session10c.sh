#!/usr/bin/env bash
# 2026-12-02, ninth session, third device call (<= 9.5 min, one GPU, every step bounded). Changed
# since the second: a served prepare() starts the daemon's copy before the table is decoded (the
# strict read runs while it copies, before prepare() returns); bench boot --e2e-repeats (each cell
# in N fresh processes, the median reported); triton_tma batches on TMA_TABLE_TUNING. Measured: the
# GPU tests, bench movers --chunked, and bench boot --shapes A C B end to end at W = 0, 0.25, 1 s,
# 2 processes per cell (A first: its W > 0 cells were not measured on the eighth session's code).
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session10c.sh
BUDGET_S=${BUDGET_S:-565}
source "$(dirname "$0")/gpu_prelude.sh"

say "=== 1. GPU tests ($(date +%T))"
timeout "$(left 75)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_boot.py tests/test_load.py \
  tests/test_copy_kernels.py tests/test_triton_movers.py >/tmp/tests.log 2>&1
say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)" /tmp/tests.log | head -12 | tee -a "$S"

say "=== 2. bench movers --chunked ($(date +%T))"
timeout "$(left 60)" flashboot bench movers --chunked --repeats 3 --chunks 1MiB 4MiB --chain-bytes 2GiB --chain-chunk 64MiB \
  --json "$OUT/movers_chunked.json" >/tmp/movers_chunked.log 2>&1
say "bench movers rc=$?"; grep -A8 "host cost of one mover.copy" /tmp/movers_chunked.log | tee -a "$S"
grep -E "ceiling: one|batched" /tmp/movers_chunked.log | grep -vE "unmerged|streams" | cut -c1-200 | tee -a "$S"

say "=== 3. bench boot --shapes A C B, end to end 0 0.25 1, 2 processes per cell ($(date +%T))"
ROOT=/dev/shm/fb-s10c; rm -rf "$ROOT"
timeout "$(left 600)" flashboot bench boot --shapes A C B --loaders "flashload served" "flashload prepared" \
  --end-to-end 0 0.25 1 --e2e-repeats 2 --dir "$ROOT" --json "$OUT/boot.json" >/tmp/boot.log 2>&1
say "bench boot rc=$? ($(date +%T))"
grep -E "ceiling|served:|prepared:|end to end:|FAILED|Error" /tmp/boot.log | cut -c1-600 | tee -a "$S"
rm -rf "$ROOT"
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
