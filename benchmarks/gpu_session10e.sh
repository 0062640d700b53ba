#!/usr/bin/env bash
# 2026-12-02, ninth session, fifth and last device call (<= 4.5 min: what the session's budget
# left). Issue 17 on this session's code: the sleep GPU tests, then flashboot bench swap on two
# 13.76 GB images of shape A, one repeat (its torch per-tensor baseline alone takes ~12 s).
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session10e.sh
BUDGET_S=${BUDGET_S:-250} WARM=0
source "$(dirname "$0")/gpu_prelude.sh"
say "=== 1. sleep GPU tests ($(date +%T))"
timeout "$(left 60)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sleep_gpu.py >/tmp/tests.log 2>&1
say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)" /tmp/tests.log | head -8 | tee -a "$S"
say "=== 2. bench swap ($(date +%T))"
timeout "$(left 240)" flashboot bench swap --scale 1.0 --repeats 1 --json "$OUT/swap.json" >/tmp/swap.log 2>&1
say "bench swap rc=$? ($(date +%T))"
grep -vE "^\s*$" /tmp/swap.log | tail -40 | cut -c1-260 | tee -a "$S"
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
