#!/usr/bin/env bash
# 2026-12-02, ninth session, fourth device call (<= 9.5 min, one GPU, every step bounded). Changed
# since the third (02:09): a served prepare() decodes the table beside the metadata's hash again
# (before the copy; decoding it after the copy started made prepare() block ~10 ms longer and C's
# W = 0 boot ~8 ms slower), and restores the interpreter's switch interval as soon as the daemon
# copies (the load's view threads ran at 0.5 ms: C's views 46 ms against 41 in a plain load).
# Measured: the GPU tests of boot and load, then bench boot --shapes C B A end to end at W = 0 and
# 0.25 s, 3 fresh processes per cell (the median reported, every total listed).
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session10d.sh
source "$(dirname "$0")/gpu_prelude.sh"

say "=== 1. GPU tests ($(date +%T))"
timeout "$(left 60)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_boot.py tests/test_load.py >/tmp/tests.log 2>&1
say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)" /tmp/tests.log | head -12 | tee -a "$S"

say "=== 2. bench boot --shapes C B A, end to end 0 0.25, 3 processes per cell ($(date +%T))"
ROOT=/dev/shm/fb-s10d; rm -rf "$ROOT"
timeout "$(left 600)" flashboot bench boot --shapes C B A --loaders "flashload served" "flashload prepared" \
  --end-to-end 0 0.25 --e2e-repeats 3 --dir "$ROOT" --json "$OUT/boot.json" >/tmp/boot.log 2>&1
say "bench boot rc=$? ($(date +%T))"
grep -E "ceiling|served:|prepared:|end to end:|FAILED|Error" /tmp/boot.log | cut -c1-600 | tee -a "$S"
cp /tmp/boot.log "$OUT/boot.log"
rm -rf "$ROOT"
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
