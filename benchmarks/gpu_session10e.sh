#!/usr/bin/env bash
# 2026-12-02, ninth session, fifth and last device call (<= 4.5 min: what the session's budget
# left). Issue 17 on this session's code: the sleep GPU tests, then flashboot bench swap on two
# 13.76 GB images of shape A, one repeat (its torch per-tensor baseline alone takes ~12 s).
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session10e.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S="$OUT/summary.txt"
say() { echo "$*" | tee -a "$S"; }
T0=$(date +%s)
left() { local l=$(( ${BUDGET_S:-250} - ($(date +%s) - T0) )); [ "$l" -lt 10 ] && l=10; [ "$1" -lt "$l" ] && l=$1; echo "$l"; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 \
  || { tail -20 /tmp/install.log; exit 1; }
say "=== 1. sleep GPU tests ($(date +%T))"
timeout "$(left 60)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sleep_gpu.py >/tmp/tests.log 2>&1
say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)" /tmp/tests.log | head -8 | tee -a "$S"
say "=== 2. bench swap ($(date +%T))"
timeout "$(left 240)" flashboot bench swap --scale 1.0 --repeats 1 --json "$OUT/swap.json" >/tmp/swap.log 2>&1
say "bench swap rc=$? ($(date +%T))"
grep -vE "^\s*$" /tmp/swap.log | tail -40 | cut -c1-260 | tee -a "$S"
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
