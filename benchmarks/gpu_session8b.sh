#!/usr/bin/env bash
# 2026-12-02, eighth session, second call (<= CAP_S = 300 s + 10): the GPU tests of this session's changes,
# then `flashboot bench boot` on shapes $SHAPES (C, A, B) with the end-to-end cells at W = $LEVELS,
# after prepare() decodes the binary table while the metadata is hashed (before it returns).
# $OUT gets 4 files (summary.txt, tests.log, boot.log, boot.json): the device returns only a few.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-C B A}; LEVELS=${LEVELS:-0 0.25 1}
T0=$(date +%s)
S="$OUT/summary.txt"
say() { echo "$*" | tee -a "$S"; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 \
  || { tail -20 /tmp/install.log; exit 1; }
timeout 120 flashboot warm --device cuda:0 >/tmp/warm.log 2>&1
say "=== warm rc=$? :: $(head -1 /tmp/warm.log) ($(date +%T))"
timeout "${TESTS_LIMIT:-110}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_views.py tests/test_boot.py \
  tests/test_load.py tests/test_cuda_streams.py tests/test_clone_gpu.py tests/test_triton_movers.py \
  tests/test_kernel_launch.py tests/test_copy_kernels.py tests/test_weight_update.py >"$OUT/tests.log" 2>&1
say "=== GPU tests rc=$? :: $(tail -1 "$OUT/tests.log") ($(date +%T))"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -12 | tee -a "$S"
ROOT=/dev/shm/fb-s8b; rm -rf "$ROOT"
left=$(( ${CAP_S:-300} - ($(date +%s) - T0) )); [ "$left" -lt 60 ] && left=60
timeout "$left" flashboot bench boot --shapes $SHAPES --loaders "flashload served" "flashload prepared" \
  --end-to-end $LEVELS --dir "$ROOT" --json "$OUT/boot.json" >"$OUT/boot.log" 2>&1
say "=== bench boot rc=$? ($(date +%T))"
grep -E "ceiling|served:|prepared:|end to end:|FAILED|Error" "$OUT/boot.log" | cut -c1-420 | tee -a "$S"
rm -rf "$ROOT"
say "=== done in $(( $(date +%s) - T0 )) s"
