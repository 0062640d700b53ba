#!/usr/bin/env bash
# Issue 19 (views, metadata, restart) on one GPU, one device call (< 3 min): makes images C and A
# in /dev/shm, times a restart in fresh processes (open an exported arena and map it, metadata
# from tensors.bin, views) per shape against the target 20 ms + 2 us/tensor and the views against
# 2 us/tensor, measures torch's own cost of a view on CPU and CUDA, then runs the GPU tests of the
# arena, views, restart and load in the time left (every step bounded; 175 s in all).
# Usage (repo root, on the GPU machine):  bash benchmarks/gpu_views.sh
#   SHAPES="C A" (default) | TESTS=0 | REPEATS=2 (fresh processes per shape) | VIEW_THREADS="1 4"
# Logs and JSON go to $OUT (4 files).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-C A}; ROOT=/dev/shm/fb-gpu-views
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
T0=$(date +%s)
limit() {  # a step's timeout: at most $1 s, and within 175 s of the start
  local left=$(( 175 - ($(date +%s) - T0) )); [ "$left" -lt "$1" ] && echo $(( left > 5 ? left : 5 )) || echo "$1"; }
rm -rf "$ROOT"; mkdir -p "$ROOT"

echo "=== images $SHAPES in $ROOT ($(date +%T))"
for s in $SHAPES; do
  timeout "$(limit 70)" python3 - "$ROOT" "$s" <<'PY' 2>&1 | tail -2
import shutil, sys, time
import flashboot
from flashboot.benchmarks.checkpoints import CHECKPOINTS, make_checkpoint
root, name = sys.argv[1], sys.argv[2]
t = time.perf_counter()
make_checkpoint(f"{root}/ckpt-{name}", CHECKPOINTS[name], device="cuda:0")
flashboot.prepack(f"{root}/ckpt-{name}", f"{root}/image-{name}", progress=False)
shutil.rmtree(f"{root}/ckpt-{name}")
print(f"image {name}: {CHECKPOINTS[name].tensor_count} tensors in {time.perf_counter() - t:.1f} s")
PY
done


echo "=== restart in a fresh process: open + map an exported arena, metadata (tensors.bin), views ($(date +%T))"
imgs=$(for s in $SHAPES; do [ -d "$ROOT/image-$s" ] && echo "$ROOT/image-$s"; done)
: >"$OUT/views.jsonl"
if [ -n "$imgs" ]; then
  for r in $(seq "${REPEATS:-2}"); do
    for vt in ${VIEW_THREADS:-1 4}; do
      timeout "$(limit 30)" python3 -m flashboot.benchmarks.first_calls views $imgs --device cuda:0 --view-threads "$vt" \
        >>"$OUT/views.jsonl"
    done
  done
  python3 - "$OUT/views.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "error" in r:
        print("FAILED:", r["error"]); continue
    n = r["tensors"]
    print(f"{r['image'].rsplit('-', 1)[-1]}, {r['view_threads']} view thread(s): {n} tensors: restart {r['restart_ms']:.1f} ms vs target "
          f"{r['restart_target_ms']:.1f} = open {r['open_ms']:.1f} (first segment {r['open_first_segment_ms']:.1f}, "
          f"other {r['segments'] - 1} segments {r['map_rest_ms']:.1f}; {r['open_timings_ms']}) + metadata "
          f"{r['metadata_ms']:.1f} ({r['metadata_us_per_tensor']:.2f} us/t, CPU {r['metadata_cpu_ms']:.1f} ms) + views "
          f"{r['views_ms']:.1f} ({r['views_us_per_tensor']:.2f} us/t vs 2.00, CPU {r['views_cpu_us_per_tensor']:.2f}; "
          f"flat tensor {r['views_flat_ms']:.1f} ms; "
          f"2nd {r['views_second_us_per_tensor']:.2f}); warm-up before {r['warm_ms']:.0f} ms")
PY
fi
echo "=== torch's own cost of a view, CPU against CUDA (40,000 views of one base, best of 5) ($(date +%T))"
timeout "$(limit 25)" python3 - <<'PY' 2>&1 | tee "$OUT/view_cost.txt"
import gc, time
import torch
gc.disable()
N = 40000
for dev in ("cpu", "cuda:0"):
    base = torch.empty(N * 64, dtype=torch.bfloat16, device=dev)
    for label, ctx in (("grad mode", torch.enable_grad), ("no_grad", torch.no_grad),
                       ("inference_mode", torch.inference_mode)):
        for how, make in (("unbind", lambda: base.view(N, 64).unbind(0)),
                          ("as_strided each", lambda: list(map(base.as_strided, [(8, 8)] * N, [(8, 1)] * N,
                                                               range(0, N * 64, 64))))):
            best = 1e9
            with ctx():
                for _ in range(5):
                    t = time.perf_counter(); out = make(); best = min(best, time.perf_counter() - t); del out
            print(f"{dev:7s} {label:15s} {how:16s} {best / N * 1e6:.3f} us/view")
PY
if [ "${TESTS:-1}" != 0 ]; then
echo "=== GPU tests of the arena, views, restart and load ($(date +%T))"
timeout "$(limit 75)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_views.py tests/test_arena_gpu.py tests/test_restart.py \
  tests/test_load.py >"$OUT/tests.log" 2>&1
echo "tests rc=$? :: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10
fi
rm -rf "$ROOT"
echo "=== done in $(( $(date +%s) - T0 )) s"
