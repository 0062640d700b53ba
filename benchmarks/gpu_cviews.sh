#!/usr/bin/env bash
# Branch cviews on one GPU, in one device call of under 4 minutes: the Python of a load of many
# tensors (shape C: 40,250 tensors, 2.6 GB). Steps, each bounded by `timeout` (60 + 130 + 2 x 20 s):
#   tests  the GPU tests of the views and of the load paths whose views moved (prepare -> load)
#   boot   `flashboot bench boot --shapes $SHAPES` served + prepared, end to end at W = 0 0.25 1
#          (W slowed by the early call, total / max(W alone, bulk), the load, the pass after it)
#   views  restart in fresh processes on the same image: open + metadata + views, 1 and 4 threads
# Usage (repo root, GPU machine): bash benchmarks/gpu_cviews.sh   (SHAPES="C B" adds shape B)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-C}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
ROOT=/dev/shm/fb-gpu-cviews

echo "=== GPU tests: views, prepared and served loads ($(date +%T))"
timeout "${TESTS_LIMIT:-60}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_views.py tests/test_boot.py \
  >"$OUT/tests.log" 2>&1
echo "tests rc=$? :: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10

echo "=== bench boot --shapes $SHAPES served + prepared, end to end 0 0.25 1 ($(date +%T))"
rm -rf "$ROOT"
timeout "${BOOT_LIMIT:-130}" flashboot bench boot --shapes $SHAPES --loaders "flashload served" "flashload prepared" \
  --end-to-end 0 0.25 1 --dir "$ROOT" --keep --json "$OUT/boot.json" >"$OUT/boot.log" 2>&1
echo "bench boot rc=$?"
grep -E "ceiling|served:|prepared:|end to end:|FAILED|Error" "$OUT/boot.log" | head -30

echo "=== restart in fresh processes: open + metadata + views ($(date +%T))"
imgs=$(ls -d "$ROOT"/image-* 2>/dev/null)
[ -n "$imgs" ] && for threads in 1 4; do
  timeout 20 python3 -m flashboot.benchmarks.first_calls views $imgs --device cuda:0 --view-threads $threads \
    >>"$OUT/views.jsonl"
done
[ -s "$OUT/views.jsonl" ] && timeout 10 python3 - "$OUT/views.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "error" in r:
        print("FAILED:", r["error"]); continue
    print(f"threads {r.get('view_threads')} {r['image'].rsplit('/', 1)[-1]}: {r['tensors']} tensors: open {r['open_ms']:.1f}, "
          f"metadata {r['metadata_ms']:.1f} ({r['metadata_us_per_tensor']:.2f} us/t), views {r['views_ms']:.1f} "
          f"({r['views_us_per_tensor']:.2f} us/t; 2nd {r['views_second_us_per_tensor']:.2f}), restart {r['restart_ms']:.1f} "
          f"vs {r['restart_target_ms']:.1f} ms")
PY
rm -rf "$ROOT"
echo "=== done ($(date +%T))"
