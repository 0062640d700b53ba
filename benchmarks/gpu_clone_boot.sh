#!/usr/bin/env bash
# Issue 19, the clone's one-time costs and the checksum's first call (branch checksum), one device
# call on one GPU (< 4 min: every step bounded by `timeout` and by what is left of BUDGET_S=205 s
# after the install, so a failing or slow step leaves the others their time):
#  1. the GPU tests of the cubin checksum, the checksum and the clone;
#  2. the checksum's first call in a fresh process: fully cold (no cubin, empty Triton cache), then
#     with an empty Triton cache but the cubin made by `flashboot warm` (target <= 20 ms, no Triton);
#  3. a seed of 13.76 GB on cuda:0, then an engine-like process (torch + context, flashboot
#     imported) cloning it verified, plain and with the early call: ready + verify (target 100 ms),
#     transfer vs the same run's D2D ceiling (target 0.85x);
#  4. fresh `flashboot clone --verify` processes vs bare `import torch; torch.zeros(1, device='cuda')`
#     (target: clone <= bare + 150 ms), then one more under `-X importtime` (its largest imports).
# Fine breakdown (clone2): the checksum's first call taken apart (checksum-parts); per clone the
# exchange's parts, the warm-up's waits by stage, the source segments mapped during the copy, the
# CLI's spawn-to-clone() time, and a sweep of MAP_GROUP_MAX_SEGMENTS (1, 4, 16) in the engine process.
# Usage (repo root, GPU machine):  OUT=/some/dir bash benchmarks/gpu_clone_boot.sh
# $OUT gets install.log, tests.log, first_calls.jsonl, seed.log, clone_boot.jsonl, cli_importtime.log (6 files).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, cupy; print("torch", torch.__version__, "triton", triton.__version__, "cupy", cupy.__version__)'
SCRATCH=$(mktemp -d)
export FLASHBOOT_KERNEL_CACHE=$SCRATCH/kernels   # a fresh cubin cache: built below as a user's machine would
export FLASHBOOT_TOKEN=gpu-clone-boot-token-0123456789abcdef
STORE=127.0.0.1:${PORT:-29731}
T0=$(date +%s); BUDGET_S=${BUDGET_S:-205}
lim() { local left=$((BUDGET_S - ($(date +%s) - T0))); [ "$left" -lt 5 ] && left=5; [ "$1" -lt "$left" ] && left=$1; echo "$left"; }

echo "=== 1. GPU tests: cubin checksum, checksum, clone ($(date +%T))"
timeout "$(lim "${TESTS_LIMIT:-70}")" python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_kernel_cubin.py \
  tests/test_checksum.py tests/test_clone_gpu.py >"$OUT/tests.log" 2>&1
echo "tests rc=$? (124: out of time) :: $(grep -c " PASSED" "$OUT/tests.log") passed :: $(tail -1 "$OUT/tests.log")"
grep -E "(FAILED|ERROR)" "$OUT/tests.log" | head -10

echo "=== 2. checksum first call in a fresh process (64 MiB, 1 MiB chunks; target 20 ms) ($(date +%T))"
FLASHBOOT_KERNEL_CACHE=$SCRATCH/k-cold TRITON_CACHE_DIR=$SCRATCH/t-cold timeout "$(lim 40)" \
  python3 -m flashboot.benchmarks.first_calls checksum --device cuda:0 | sed 's/^/fully-cold  /' | tee "$OUT/first_calls.jsonl"
FLASHBOOT_KERNEL_CACHE=$SCRATCH/k-warm TRITON_CACHE_DIR=$SCRATCH/t-warm timeout "$(lim 40)" flashboot warm --device cuda:0
for i in 1 2; do  # an empty Triton cache each time: the cubin alone must do
  FLASHBOOT_KERNEL_CACHE=$SCRATCH/k-warm TRITON_CACHE_DIR=$SCRATCH/t-empty$i timeout "$(lim 20)" \
    python3 -m flashboot.benchmarks.first_calls checksum --device cuda:0 | sed 's/^/after-warm  /' | tee -a "$OUT/first_calls.jsonl"
done
FLASHBOOT_KERNEL_CACHE=$SCRATCH/k-warm TRITON_CACHE_DIR=$SCRATCH/t-empty3 timeout "$(lim 20)" \
  python3 -m flashboot.benchmarks.first_calls checksum-parts --device cuda:0 | sed 's/^/parts       /' | tee -a "$OUT/first_calls.jsonl"

echo "=== 3. seed of 13.76 GB on cuda:0, engine-like clones, verified ($(date +%T))"
timeout "$(lim 200)" python3 -m flashboot.benchmarks.clone_boot seed --store "$STORE" --ready "$SCRATCH/ready" \
  >"$OUT/seed.log" 2>&1 &
SEED=$!
for _ in $(seq 90); do [ -f "$SCRATCH/ready" ] || ! kill -0 $SEED 2>/dev/null && break; sleep 0.5; done
if [ -f "$SCRATCH/ready" ]; then
  echo "seed ready: $(cat "$SCRATCH/ready")"
  for early in "" "--early 0.5"; do
    timeout "$(lim 45)" python3 -m flashboot.benchmarks.clone_boot engine --store "$STORE" $early | tee -a "$OUT/clone_boot.jsonl" \
      | python3 -m flashboot.benchmarks.clone_boot show
  done
  echo "=== 4. fresh flashboot clone --verify vs bare torch + CUDA context ($(date +%T))"
  timeout "$(lim 80)" python3 -m flashboot.benchmarks.clone_boot cli --store "$STORE" --repeats "${REPEATS:-2}" \
    | tee -a "$OUT/clone_boot.jsonl" | python3 -m flashboot.benchmarks.clone_boot show
  echo "=== 5. one more fresh clone --verify under -X importtime: the largest imports (cumulative us) ($(date +%T))"
  timeout "$(lim 30)" python3 -X importtime -m flashboot.cli clone --store "$STORE" --device cuda:0 --schedule star \
    --verify --timeout 60 2>"$SCRATCH/importtime.log" | head -1
  sort -t'|' -k2 -n "$SCRATCH/importtime.log" | tail -25 | tee "$OUT/cli_importtime.log"
else
  echo "seed did not come up:"; tail -20 "$OUT/seed.log"
fi
kill $SEED 2>/dev/null; wait $SEED 2>/dev/null
tail -3 "$OUT/seed.log"
ls "$FLASHBOOT_KERNEL_CACHE" 2>/dev/null | sed 's/^/cubin cache: /'
rm -rf "$SCRATCH"
echo "=== done ($(date +%T))"
