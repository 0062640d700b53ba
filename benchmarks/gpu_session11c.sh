#!/usr/bin/env bash
# 2026-12-02, tenth session, third device call (<= 9.5 min). The early call's steps up to the
# copy's start now run on the caller's thread (a served prepare), the arena's flat tensor is made
# once the daemon copies, verify_default no longer imports the checksum module for a served load.
#   1. the GPU tests of boot, load and views;
#   2. issue 19's boot end to end, W = 0 and 0.25 s, REPEATS fresh processes per cell (default 4).
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session11c.sh
BUDGET_S=${BUDGET_S:-575}
source "$(dirname "$0")/gpu_prelude.sh"

say "=== 1. GPU tests ($(date +%T))"
timeout "$(left 90)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_boot.py tests/test_load.py \
  tests/test_views.py >/tmp/tests.log 2>&1
say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)" /tmp/tests.log | head -12 | tee -a "$S"
REPEATS=${REPEATS:-4} BUDGET_S=$(left 600) WARM=0 bash "$(dirname "$0")/gpu_session11b.sh" 2>&1 | grep -vE "^=== warm"
