#!/usr/bin/env bash
# 2026-12-03, twenty-second session, one device call (<= 9.5 min): issue 19 after the views made below
# torch's view tracking and the early call's hand-over and metadata moved to its background thread.
#   1. (TESTS=1) the one-GPU tests of every path that loads, clones, sleeps or refits (gpu_session16.sh's first group);
#   2. bench boot: first served load of SHAPES and the boot end to end at WS (REPEATS fresh processes per cell);
#   2c. (VIEWS=1) restart (open_held + metadata + views) on the bench's images;
#   2d. (VIEW_SWEEP=1) the same with 1, 2, 4 and 8 view threads, two rounds;
#   2b. (HANDOVER=1) benchmarks/probes/handover_parts.py: the later batches' hand-over taken apart;
#   3. (CLONE=1) a 13.76 GB seed on cuda:0, then CLONE_PAIRS alternating pairs of a bare
#      `import torch` + CUDA context process and a fresh `flashboot clone --verify` (target: +150 ms).
# Usage (repo root, GPU machine): OUT=/some/dir [SHAPES="C B"] [WS="0 0.25"] [REPEATS=5] bash benchmarks/gpu_session22.sh
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/gpu_prelude.sh"
ROOT=/dev/shm/fb22; rm -rf "$ROOT"

[ "${TESTS:-0}" = 1 ] && loading_gpu_tests "${TESTS_S:-220}"

if [ "${HANDOVER:-0}" = 1 ]; then
  say "=== 2b. the later batches' hand-over in parts ($(date +%T))"
  timeout "$(left 60)" python3 benchmarks/probes/handover_parts.py 2>&1 | tail -3 | tee "$OUT/handover_parts.jsonl" | tee -a "$S"
fi
if [ "${BOOT:-1}" = 1 ]; then
  say "=== 2. bench boot --end-to-end ${WS:-0 0.25} ($(date +%T))"
  bench_boot_e2e "${BOOT_S:-400}"
  if [ "${VIEWS:-0}" = 1 ]; then  # restart (open_held + metadata + views) on the bench's images, default view threads
    say "=== 2c. restart views ($(date +%T))"
    restart_views
  fi
  if [ "${VIEW_SWEEP:-0}" = 1 ]; then  # the same restart with 1, 2, 4 and 8 view threads, twice each (fresh processes)
    say "=== 2d. restart views by thread count ($(date +%T))"
    for round in 1 2; do for t in 1 2 4 8; do
      timeout "$(left 40)" python3 -m flashboot.benchmarks.first_calls views $(ls -d "$ROOT"/image-*) --device cuda:0 \
        --view-threads "$t" >>"$OUT/view_sweep.jsonl" 2>>/tmp/first_calls.err
    done; done
    python3 -m flashboot.benchmarks.first_calls summary "$OUT/view_sweep.jsonl" 2>&1 | tee -a "$S"
  fi
  rm -rf "$ROOT"
fi

if [ "${CLONE:-1}" = 1 ]; then
  say "=== 3. fresh flashboot clone --verify vs bare torch + context, ${CLONE_PAIRS:-6} pairs ($(date +%T))"
  clone_figures "${CLONE_PAIRS:-6}" 0
fi
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
