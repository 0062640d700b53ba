#!/usr/bin/env bash
# 2026-12-03, nineteenth session, one device call (<= 9.5 min): the arena made batch by batch while
# the daemon copies, the early call without the daemon's modules.
#   1. GPU tests: arena (segments_now), boot, load, views, load sources;
#   2. bench boot: first served load of SHAPES and the boot end to end at W = WS (REPEATS fresh processes per cell);
#   3. restart views by each of THREADS (default "1 2 4 0"; 0: the default count) (VIEWS=1), on the bench's images;
#   4. (SERVE=1) many engines at once through the batch-by-batch hand-over: bench serve of a 2.06 GB image
#      (8 segments: the request carries 4, the rest follow) for ENGINES (default "1 2 4 8").
# Usage (repo root, GPU machine): OUT=/some/dir [SHAPES="B A C"] [WS="0 0.25"] [REPEATS=3] bash benchmarks/gpu_session19.sh
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/gpu_prelude.sh"
ROOT=/dev/shm/fb19; rm -rf "$ROOT"

if [ "${TESTS:-1}" = 1 ]; then
  say "=== 1. GPU tests ($(date +%T))"
  load_gpu_tests 150
fi

say "=== 2. bench boot --end-to-end ${WS:-0 0.25} ($(date +%T))"
bench_boot_e2e 480

if [ "${VIEWS:-1}" = 1 ]; then
  say "=== 3. restart views by ${THREADS:-1 2 4 0} threads (0: the default) ($(date +%T))"
  imgs=$(ls -d "$ROOT"/image-* 2>/dev/null)
  k=0
  for t in ${THREADS:-1 2 4 0}; do
    k=$((k + 1))
    [ -n "$imgs" ] && timeout "$(left 40)" python3 -m flashboot.benchmarks.first_calls views $imgs --device cuda:0 \
      $([ "$t" != 0 ] && echo "--view-threads $t") >"$OUT/first_calls_$k.t$t.jsonl" 2>/tmp/first_calls.err
    say "threads ${t/#0/default} rc=$?"; python3 -m flashboot.benchmarks.first_calls summary "$OUT/first_calls_$k.t$t.jsonl" 2>&1 | tee -a "$S"
  done
fi
if [ "${SERVE:-0}" = 1 ]; then
  say "=== 4. bench serve --engines ${ENGINES:-1 2 4 8} ($(date +%T))"
  serve_engines
fi
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
