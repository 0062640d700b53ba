#!/usr/bin/env bash
# 2026-12-02, fourteenth session: issue 17's wake right after a release.
#   1. benchmarks/probes/release_then_copy.py: a bulk H2D right after a release of 14 GB by the copy
#      engine, two copy-engine streams, or the SM kernel on one stream beside the copy engine on another;
#   2. (SWAP=1) flashboot bench swap --scale 1.0 --repeats ${SWAP_REPEATS:-1} (its restart row maps the
#      held arena through load_or_restore on CUDA);
#   3. (TESTS=1) the GPU tests of sleep/wake and the arena.
# Usage (repo root, GPU machine): OUT=/some/dir [PROBE=1] [SWAP=0] [TESTS=0] bash benchmarks/gpu_session15.sh
BUDGET_S=${BUDGET_S:-560}
WARM=${WARM:-0}
source "$(dirname "$0")/gpu_prelude.sh"
if [ "${PROBE:-1}" = 1 ]; then
  say "=== 1. release then copy ($(date +%T))"
  timeout "$(left 200)" python3 benchmarks/probes/release_then_copy.py "${PROBE_REPEATS:-3}" >"$OUT/release_then_copy.json" 2>/tmp/rtc.err
  say "probe rc=$?"; tail -3 /tmp/rtc.err | cut -c1-300 | tee -a "$S"
  python3 - "$OUT/release_then_copy.json" <<'PY' 2>&1 | tee -a "$S"
import json, sys
r = json.loads(open(sys.argv[1]).read())
for k, v in r.items():
    print(k, v)
PY
fi
if [ "${SWAP:-0}" = 1 ]; then
  say "=== 2. bench swap ($(date +%T))"
  timeout "$(left 250)" flashboot bench swap --scale 1.0 --repeats "${SWAP_REPEATS:-1}" --json "$OUT/swap.json" >/tmp/swap.log 2>&1
  say "bench swap rc=$?"; grep -vE "^\s*$" /tmp/swap.log | tail -30 | cut -c1-300 | tee -a "$S"
fi
if [ "${TESTS:-0}" = 1 ]; then
  say "=== 3. GPU tests of sleep/wake and the arena ($(date +%T))"
  timeout "$(left 150)" python3 -m pytest -q -p no:cacheprovider -m "gpu or two_gpus" tests/test_sleep_gpu.py \
    tests/test_arena_gpu.py tests/test_arena_remap.py >/tmp/tests.log 2>&1
  say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)" /tmp/tests.log | head -12 | cut -c1-400 | tee -a "$S"
fi
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
