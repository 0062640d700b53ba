#!/usr/bin/env bash
# 2026-12-02, eighth session: one device call (<= 9.5 min, every step bounded) on main, after
# gpu_session7.sh's run of 23:12 (2026-12-01). What changed since, and is measured here:
#   - the ctypes driver runner is gone (Triton's launcher measured faster): per-call us per mover, 21 samples;
#   - a star (or a chain of one clone) defaults to 1 GiB chunks: the engine-like clone, plus a sweep of
#     its chunk (256 MiB, 1 GiB, 4 GiB) with the lanes' GPU time beside the host's;
#   - the binary table is decoded while metadata.json is read and hashed: bench boot C and A,
#     served + prepared, end to end at $LEVELS (C's first served load was 2.08x, target 2.0);
#   - why cuMemcpyBatchAsync refused checkpoint C's pack batch (benchmarks/probes/batch_copy.py), and
#     bench refit on A and C (C's copy-engine pack row is reported, no longer fatal).
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session8.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-C A}; LEVELS=${LEVELS:-0 0.25}
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
timeout 120 flashboot warm --device cuda:0 >"$OUT/warm.log" 2>&1
echo "=== 0. warm rc=$? :: $(head -1 "$OUT/warm.log") ($(date +%T))"

echo "=== 1. GPU tests ($(date +%T))"
timeout "${TESTS_LIMIT:-140}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_views.py tests/test_boot.py \
  tests/test_load.py tests/test_preload_service.py tests/test_cuda_streams.py tests/test_arena_gpu.py tests/test_clone_gpu.py \
  tests/test_triton_movers.py tests/test_kernel_launch.py tests/test_copy_kernels.py tests/test_flag_copy.py \
  tests/test_weight_update.py >"$OUT/tests_all.log" 2>&1
echo "tests rc=$? :: $(tail -1 "$OUT/tests_all.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests_all.log" | head -12

echo "=== 2. checkpoint C's copy-engine pack batch ($(date +%T))"
timeout 90 python3 benchmarks/probes/batch_copy.py C 2>&1 | tail -6 | cut -c1-1500

echo "=== 3. host us per mover.copy of 4 KiB, 21 samples each ($(date +%T))"
timeout 60 python3 - <<'PY' | tee "$OUT/per_call.json"
import json, statistics, torch
from flashboot.arena import Arena
from flashboot.benchmarks.movers_chunked import per_call_cost_us
from flashboot.movers import create_mover, list_movers
stream, out = torch.cuda.Stream(device=0), {}
with Arena.create(64 << 20, 0) as a, Arena.create(64 << 20, 0) as b:
    a.bytes().random_(0, 255)
    for m in list_movers():
        if m.available and "d2d" in m.paths:
            mover = create_mover(m.name)
            xs = [per_call_cost_us(mover, b.span(), a.span(), stream) for _ in range(21)]
            b.bytes().zero_()
            mover.copy(b.span(), a.span(), 1 << 20, stream=stream)
            stream.synchronize()
            out[m.name] = {"median": round(statistics.median(xs), 2), "min": round(min(xs), 2),
                           "max": round(max(xs), 2), "exact": bool(torch.equal(b.bytes()[:1 << 20], a.bytes()[:1 << 20]))}
print(json.dumps(out))
PY

echo "=== 4. the engine-like clone, chunk sweep ($(date +%T))"
BUDGET_S=${CLONE_BUDGET:-120} TESTS_LIMIT=1 REPEATS=1 timeout "${CLONE_LIMIT:-130}" bash benchmarks/gpu_clone_boot.sh 2>&1 \
  | grep -vE "^(cubin cache|import time)" | tail -24
mv "$OUT/tests.log" "$OUT/tests_clone_boot.log" 2>/dev/null

echo "=== 5. bench boot --shapes $SHAPES, end to end $LEVELS ($(date +%T))"
ROOT=/dev/shm/fb-s8; rm -rf "$ROOT"
timeout "${BOOT_LIMIT:-190}" flashboot bench boot --shapes $SHAPES --loaders "flashload served" "flashload prepared" \
  --end-to-end $LEVELS --dir "$ROOT" --json "$OUT/boot.json" >"$OUT/boot.log" 2>&1
echo "bench boot rc=$?"; grep -E "ceiling|served:|prepared:|end to end:|FAILED|Error" "$OUT/boot.log" | head -24 | cut -c1-700
rm -rf "$ROOT"

echo "=== 6. bench refit A, C ($(date +%T))"
left=$(( 565 - ($(date +%s) - T0) )); [ "$left" -lt 30 ] && left=30
STEPS="A C" SCALE_A=1 timeout "$left" bash benchmarks/gpu_refit.sh 2>&1 | grep -vE "^\s*$" | tail -45 | cut -c1-400
echo "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
