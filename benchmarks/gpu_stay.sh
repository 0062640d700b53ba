#!/usr/bin/env bash
# Issue 17 (weights that stay) on one GPU, from the repo root:  bash benchmarks/gpu_stay.sh
# 1. the gpu-marked sleep/wake tests: arena memory back and addresses kept, a failed wake rolled
#    back, a pipelined wake (each segment's copy issued once it is mapped) byte-exact and rolled
#    back when a copy fails, the pure-torch CUDA graph replayed bitwise after level-1 and level-2
#    cycles; plus the arena's own GPU tests and two clone/holder tests (importers unmap in runs);
# 2. flashboot bench swap on two images of checkpoint A (SWAP_SCALE, default 1.0 = 13.76 GB each);
# 3. flashboot bench soak --kinds sleep: 200 sleep/wake cycles, GPU memory, fds, threads flat.
# Logs and JSON go to $OUT; the summary is printed, with where each sleep and wake went (the
# *_parts of swap.json). Finishes in about 4-5 minutes.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -${TAIL:-25} "$OUT/$name.log"; echo "=== $name rc=$rc"; }
step tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sleep_gpu.py tests/test_arena_gpu.py
# importers unmap their segments in runs now: a seed's clones and a holder's restart on this GPU
TAIL=5 step tests_clone 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_clone_gpu.py \
  -k "seed_and_clones_in_one_process or holder_keeps_gpu_weights"
TAIL=20 step swap "${SWAP_LIMIT:-290}" flashboot bench swap --scale "${SWAP_SCALE:-1.0}" --repeats 3 --json "$OUT/swap.json"
TAIL=6 step soak 80 flashboot bench soak --kinds sleep --cycles 200 --json "$OUT/soak.json"
python3 - "$OUT/swap.json" <<'PY'
import json, sys
try:
    o = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"no swap figures: {exc}")
r, rs = o["ratios"], o["restart"]
print(f"SUMMARY {o['images']} images x {o['nbytes'] / 1e9:.2f} GB, {o['tensors']} tensors, exact={o['exact']}")
print(f"  wake from daemon   {o['wake_served_ms']:.1f} ms (whole wake) = {r['wake_served_x_h2d']:.3f}x bulk H2D (>= 0.95)")
print(f"  level-1 sleep      {o['level1_sleep_ms']:.1f} ms = {r['level1_sleep_x_d2h']:.3f}x bulk D2H (>= 0.90); pin once {o['level1_pin_ms']:.0f} ms")
print(f"  level-1 wake       {o['level1_wake_ms']:.1f} ms (whole wake) = {r['level1_wake_x_h2d']:.3f}x bulk H2D (>= 0.95)")
print(f"  sleep (release)    {o['sleep_release_ms']:.2f} ms (<= 10); free memory back within a segment: {o['free_back_within_segment']}")
print(f"  swap               {o['swap_ms']:.1f} ms = {r['swap_over_h2d']:.3f}x bulk H2D time (<= 1.10)")
print(f"  torch per-tensor   offload {o['torch']['offload_ms']:.0f} ms, reload {o['torch']['reload_ms']:.0f} ms")
print(f"  holder restart     {rs['restart_ms']:.2f} ms vs budget {rs['budget_ms']:.1f} ms (20 ms + 2 us x {rs['tensors']}): "
      f"{'met' if rs['within_budget'] else 'MISSED'}; served load {rs['served_load_ms']:.1f} ms")
from flashboot.benchmarks.swap import print_parts
print_parts(o)  # where each sleep and wake went: the arena's driver calls, the copy, the waits
PY
