#!/usr/bin/env bash
# The session's closing figures on one GPU, in as few device calls as the budget allows. STEPS
# picks the parts (default: all, about 9 min: split it over two calls):
#   tests   the GPU tests of this session's new code (served pieces, cubin, views, drained sleep)
#   boot    `flashboot bench boot --shapes $SHAPES` served + prepared, end to end at W = 0 0.25 1,
#           then restart (open + metadata + views) in fresh processes on the same images
#   movers  benchmarks/gpu_movers.sh (tests, bench movers --chunked, summary); movers_bench: without the tests
#   views_ab the bulk views made by 1 and by 4 threads, on CUDA, fresh processes
#   swap    `flashboot bench swap --scale 1.0 --repeats 1`
#   clone   benchmarks/gpu_clone_boot.sh (checksum first call, engine-like clone, CLI clone)
#   refit   `flashboot bench refit --checkpoint A --repeats 3`
# Usage (repo root, GPU machine): STEPS="tests boot" bash benchmarks/gpu_final.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-tests boot movers swap clone refit}; SHAPES=${SHAPES:-C A}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
has() { [[ " $STEPS " == *" $1 "* ]]; }
ROOT=/dev/shm/fb-gpu-final

if has tests; then
  echo "=== GPU tests of the new code ($(date +%T))"
  timeout "${TESTS_LIMIT:-90}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_cubin.py tests/test_views.py \
    tests/test_sleep_gpu.py tests/test_arena_gpu.py tests/test_load.py tests/test_boot.py tests/test_preload_faults.py \
    tests/test_checksum.py >"$OUT/tests.log" 2>&1
  echo "tests rc=$? :: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10
fi

if has boot; then
  echo "=== bench boot --shapes $SHAPES served + prepared, end to end 0 0.25 1 ($(date +%T))"
  rm -rf "$ROOT"
  timeout "${BOOT_LIMIT:-200}" flashboot bench boot --shapes $SHAPES --loaders "flashload served" "flashload prepared" \
    --end-to-end 0 0.25 1 --dir "$ROOT" --keep --json "$OUT/boot.json" >"$OUT/boot.log" 2>&1
  echo "bench boot rc=$?"
  grep -E "ceiling|served:|prepared:|end to end:|FAILED|Error" "$OUT/boot.log" | head -30
  echo "=== restart in fresh processes: open + metadata + views ($(date +%T))"
  imgs=$(ls -d "$ROOT"/image-* 2>/dev/null)
  [ -n "$imgs" ] && for threads in 1 4; do
    timeout 60 python3 -m flashboot.benchmarks.first_calls views $imgs --device cuda:0 --view-threads $threads >>"$OUT/views.jsonl"
  done
  python3 - "$OUT/views.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"threads {r.get('view_threads')} {r['image'].rsplit('/', 1)[-1]}: {r['tensors']} tensors: open {r['open_ms']:.1f}, "
          f"metadata {r['metadata_ms']:.1f} ({r['metadata_us_per_tensor']:.2f} us/t), views {r['views_ms']:.1f} "
          f"({r['views_us_per_tensor']:.2f} us/t; 2nd {r['views_second_us_per_tensor']:.2f}), restart {r['restart_ms']:.1f} "
          f"vs {r['restart_target_ms']:.1f} ms")
PY
  rm -rf "$ROOT"
fi

if has views_ab; then
  echo "=== views A/B on a CUDA arena, shape C's 40,250 tensors, fresh processes ($(date +%T))"
  AB=$(mktemp -d); timeout 60 python3 -m flashboot.benchmarks.views_ab make "$AB" >/dev/null 2>&1
  for threads in 1 4 1 4; do timeout 30 python3 -m flashboot.benchmarks.views_ab run "$AB" installed $threads; done
  rm -rf "$AB"
fi
if has movers; then
  echo "=== movers ($(date +%T))"; timeout "${MOVERS_LIMIT:-240}" bash benchmarks/gpu_movers.sh 2>&1 | tail -60
fi
if has movers_bench; then  # the chunked benchmark and its summary alone (gpu_movers.sh without its tests)
  echo "=== movers: bench movers --chunked ($(date +%T))"
  timeout "${MOVERS_LIMIT:-110}" flashboot bench movers --chunked --repeats 3 --chunks 1MiB 4MiB 64MiB \
    --chain-bytes 8GiB --chain-chunk 64MiB --json "$OUT/movers_chunked.json" >"$OUT/movers_chunked.log" 2>&1
  echo "movers rc=$?"; tail -5 "$OUT/movers_chunked.log"
  sed -n "/^TAIL=40 step summary/,/^EOF$/p" benchmarks/gpu_movers.sh | sed '1d;$d' >"$OUT/summary.py"
  timeout 15 python3 "$OUT/summary.py" "$OUT/movers_chunked.json"; rm -f "$OUT/summary.py"
fi
if has swap; then
  echo "=== bench swap ($(date +%T))"
  timeout "${SWAP_LIMIT:-150}" flashboot bench swap --scale 1.0 --repeats 1 --json "$OUT/swap.json" >"$OUT/swap.log" 2>&1
  echo "swap rc=$?"; tail -40 "$OUT/swap.log"
fi
if has clone; then
  echo "=== clone ($(date +%T))"; timeout "${CLONE_LIMIT:-200}" bash benchmarks/gpu_clone_boot.sh 2>&1 | tail -40
fi
if has refit; then
  echo "=== bench refit A ($(date +%T))"
  timeout "${REFIT_LIMIT:-120}" flashboot bench refit --checkpoint A --repeats 3 --json "$OUT/refit.json" >"$OUT/refit.log" 2>&1
  echo "refit rc=$?"; tail -40 "$OUT/refit.log"
fi
echo "=== done ($(date +%T))"
