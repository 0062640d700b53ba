#!/usr/bin/env bash
# Issue 19 on one GPU, one device call (< 6 min): the GPU tests of the load/boot/stream path, the
# checksum kernel's first call in a fresh process (cold Triton cache, then cached), metadata +
# views + restart in a fresh process, and `flashboot bench boot` with its end-to-end mode.
# Usage (repo root, on the GPU machine):  bash benchmarks/gpu_boot.sh
#   then, for shape B (13.8 GB images take time to create):  SHAPES=B TESTS=0 COLD=0 bash benchmarks/gpu_boot.sh
#   SHAPES="A C" (default) | W="0 0.25 1" | BOOT_LIMIT=190 | TESTS_LIMIT=90 | TESTS=0 | COLD=0
# Logs and JSON go to $OUT (at most 6 files).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-A C}; W=${W:-0 0.25 1}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
T0=$(date +%s)

if [ "${TESTS:-1}" != 0 ]; then
echo "=== GPU tests of the load / boot / stream path, the arena and the checksum ($(date +%T))"
timeout "${TESTS_LIMIT:-90}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_boot.py tests/test_load.py \
  tests/test_stream.py tests/test_arena_gpu.py tests/test_checksum.py >"$OUT/tests.log" 2>&1
echo "tests rc=$? :: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10
fi

if [ "${COLD:-1}" != 0 ]; then
echo "=== checksum first call in a fresh process (64 MiB, 1 MiB chunks): cold Triton cache, then after flashboot warm"
CACHE=$(mktemp -d); WARM=$(mktemp -d)
TRITON_CACHE_DIR=$CACHE timeout 120 python3 -m flashboot.benchmarks.first_calls checksum --device cuda:0 \
  | sed 's/^/cold   /' | tee "$OUT/first_calls.jsonl"
TRITON_CACHE_DIR=$WARM timeout 120 flashboot warm --device cuda:0
TRITON_CACHE_DIR=$WARM timeout 60 python3 -m flashboot.benchmarks.first_calls checksum --device cuda:0 \
  | sed 's/^/cached /' | tee -a "$OUT/first_calls.jsonl"
rm -rf "$CACHE" "$WARM"
fi

echo "=== flashboot bench boot --shapes $SHAPES --end-to-end $W ($(date +%T))"
ROOT=/dev/shm/fb-gpu-boot; rm -rf "$ROOT"
timeout "${BOOT_LIMIT:-190}" flashboot bench boot --shapes $SHAPES --loaders "flashload served" "flashload prepared" \
  --end-to-end $W --dir "$ROOT" --keep --json "$OUT/boot.json" >"$OUT/boot.log" 2>&1
rc=$?; echo "bench boot rc=$rc (124: BOOT_LIMIT reached; run again with fewer SHAPES)"
grep -E "ceiling|served:|prepared:|end to end:|FAILED" "$OUT/boot.log" | head -40
sed -n '/boot end to end on/,$p' "$OUT/boot.log" | head -30

echo "=== restart in a fresh process: open an exported arena + metadata (tensors.bin) + views ($(date +%T))"
imgs=$(ls -d "$ROOT"/image-* 2>/dev/null)
if [ -n "$imgs" ]; then
  timeout 90 python3 -m flashboot.benchmarks.first_calls views $imgs --device cuda:0 | tee -a "$OUT/first_calls.jsonl"
  python3 -m flashboot.benchmarks.first_calls summary "$OUT/first_calls.jsonl"
fi
rm -rf "$ROOT"
echo "=== done in $(( $(date +%s) - T0 )) s"
