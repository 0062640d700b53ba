#!/usr/bin/env bash
# 2026-12-01, sixth session: one device call (<= 9 min, every step bounded) for the merged main:
#   1. the GPU tests of what changed (streamed hand-over to the daemon, views made by the load,
#      the checksum's ctypes launch, the copy engine and clone through the driver, sleep/arena);
#   2. benchmarks/gpu_clone_boot.sh without its tests: the checksum's first call (cold, after
#      `flashboot warm`, its parts), the engine-like clone of 13.76 GB and the fresh CLI clone;
#   3. `flashboot bench boot --shapes $SHAPES`, served + prepared, end to end at $LEVELS.
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session6.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-C A}; LEVELS=${LEVELS:-0 0.25}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
echo "=== 1. GPU tests ($(date +%T))"
timeout "${TESTS_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_cubin.py tests/test_checksum.py \
  tests/test_views.py tests/test_boot.py tests/test_load.py tests/test_preload_service.py tests/test_preload_faults.py \
  tests/test_cuda_streams.py tests/test_arena_gpu.py tests/test_sleep_gpu.py tests/test_clone_gpu.py \
  tests/test_triton_movers.py >"$OUT/tests.log" 2>&1
echo "tests rc=$? :: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -12
echo "=== 2. checksum first call, clone ($(date +%T))"
BUDGET_S=${CLONE_BUDGET:-140} TESTS_LIMIT=1 REPEATS=1 timeout "${CLONE_LIMIT:-150}" bash benchmarks/gpu_clone_boot.sh 2>&1 | tail -40
echo "=== 3. bench boot --shapes $SHAPES, end to end $LEVELS ($(date +%T))"
ROOT=/dev/shm/fb-s6; rm -rf "$ROOT"
timeout "${BOOT_LIMIT:-200}" flashboot bench boot --shapes $SHAPES --loaders "flashload served" "flashload prepared" \
  --end-to-end $LEVELS --dir "$ROOT" --keep --json "$OUT/boot.json" >"$OUT/boot.log" 2>&1
echo "bench boot rc=$?"; grep -E "ceiling|served:|prepared:|end to end:|FAILED|Error" "$OUT/boot.log" | head -30
imgs=$(ls -d "$ROOT"/image-* 2>/dev/null)
[ -n "$imgs" ] && timeout 40 python3 -m flashboot.benchmarks.first_calls views $imgs --device cuda:0 --view-threads 4 >"$OUT/views.jsonl"
python3 -c "
import json,sys
for l in open('$OUT/views.jsonl'):
    r=json.loads(l); print(r['image'].rsplit('/',1)[-1], r['tensors'], 'open %.1f metadata %.1f views %.1f restart %.1f vs %.1f' % (r['open_ms'], r['metadata_ms'], r['views_ms'], r['restart_ms'], r['restart_target_ms']))
" 2>/dev/null
rm -rf "$ROOT"; echo "=== done ($(date +%T))"
