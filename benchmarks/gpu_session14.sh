#!/usr/bin/env bash
# 2026-12-02, thirteenth session, first device call (<= 9.5 min): the served copy started before the
# metadata is read (copy_first), in the plain and the prepared load.
#   1. GPU tests of boot, load, views;
#   2. views made beside W in a background thread vs after W on the caller's (16 cores, host arena;
#      benchmarks/probes/views_beside_w.py, shape B's 18,722 tensors);
#   3. bench boot: first served load of B, A, C (SHAPES) and the boot end to end at W = WS (3 fresh processes per cell).
# Usage (repo root, GPU machine): OUT=/some/dir [WS="0 0.25"] bash benchmarks/gpu_session14.sh
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/gpu_prelude.sh"
ROOT=/dev/shm/fb14; rm -rf "$ROOT"

if [ "${TESTS:-1}" = 1 ]; then
say "=== 1. GPU tests ($(date +%T))"
timeout "$(left 120)" python3 -m pytest -q -p no:cacheprovider -m "gpu or two_gpus" tests/test_boot.py tests/test_load.py \
  tests/test_views.py tests/test_load_sources.py >/tmp/tests.log 2>&1
say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)|Error" /tmp/tests.log | head -12 | cut -c1-400 | tee -a "$S"
fi

if [ "${VIEWS_PROBE:-1}" = 1 ]; then
  say "=== 2. views beside W ($(date +%T))"
  P=benchmarks/probes/views_beside_w.py
  timeout "$(left 60)" python3 "$P" make /tmp/vbw B >/tmp/vbw.log 2>&1 || { say "make failed"; tail -3 /tmp/vbw.log | tee -a "$S"; }
  for round in 1 2; do
    for m in "caller 8 5" "beside 1 5" "beside 8 5" "beside 1 0.5" "beside 8 0.5"; do
      timeout "$(left 20)" python3 "$P" run /tmp/vbw $m 0.25 2>>/tmp/vbw.log | tee -a "$OUT/views_beside_w.jsonl" >>"$S"
    done
  done
fi

say "=== 3. bench boot --end-to-end ${WS:-0 0.25} ($(date +%T))"
bench_boot_e2e 520
if [ "${RESTART:-0}" = 1 ]; then
  say "=== 4. restart: open + metadata + views ($(date +%T))"
  imgs=$(ls -d "$ROOT"/image-* 2>/dev/null)
  [ -n "$imgs" ] && timeout "$(left 90)" python3 -m flashboot.benchmarks.first_calls views $imgs --device cuda:0 \
    >"$OUT/first_calls.jsonl" 2>/tmp/first_calls.err
  say "restart rc=$?"; python3 -m flashboot.benchmarks.first_calls summary "$OUT/first_calls.jsonl" 2>&1 | tee -a "$S"
fi
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
