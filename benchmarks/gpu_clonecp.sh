#!/usr/bin/env bash
# Issue 19, the clone without CuPy (branch clonecp), one GPU, <= 4 min, every step bounded:
#  1. the GPU tests of the copy-engine mover through the driver and of its streams
#     (tests/test_cuda_streams.py, the copy_engine ones of test_arena_gpu.py and test_triton_movers.py);
#  2. benchmarks/gpu_clone_boot.sh with a shorter budget: the clone's GPU tests, the checksum's
#     first call, then the engine-like clone of 13.76 GB, plain and with the early call: ready +
#     verify (target 100 ms) and its phases, and whether CuPy was imported;
#  3. the host cost of one mover.copy (4 KiB, 2,000 back to back, median of 5; target <= 15 us) on
#     each kind of stream a caller passes, beside a bare CuPy cudaMemcpyAsync loop of the same run.
# Usage (repo root, GPU machine):  OUT=/some/dir bash benchmarks/gpu_clonecp.sh
# $OUT: install.log, movers_tests.log, per_call.json, and gpu_clone_boot.sh's files (tests.log,
# first_calls.jsonl, seed.log, clone_boot.jsonl, cli_importtime.log): 8 files.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }

echo "=== 1. GPU tests: copy engine through the driver, cuda_streams ($(date +%T))"
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_streams.py tests/test_arena_gpu.py \
  tests/test_triton_movers.py -k "copy_engine or cuda_streams" >"$OUT/movers_tests.log" 2>&1
echo "tests rc=$? (124: out of time) :: $(tail -1 "$OUT/movers_tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/movers_tests.log" | head -10

echo "=== 2. gpu_clone_boot.sh (clone GPU tests, checksum first call, engine-like clone) ($(date +%T))"
BUDGET_S=135 TESTS_LIMIT=60 REPEATS=1 timeout 150 bash benchmarks/gpu_clone_boot.sh
echo "gpu_clone_boot rc=$?"

echo "=== 3. host us per mover.copy of 4 KiB (target <= 15) ($(date +%T))"
timeout 30 python3 - "$OUT/per_call.json" <<'EOF'
import json, statistics, sys, time
import torch
import cupy
from flashboot.arena import Arena
from flashboot.benchmarks.movers_chunked import per_call_cost_us
from flashboot.cuda_streams import Stream
from flashboot.movers import create_mover

mover = create_mover("copy_engine")
torch_stream = torch.cuda.Stream(device=0)
with cupy.cuda.Device(0):
    cupy_stream = cupy.cuda.Stream(non_blocking=True)
ours = Stream(0)
out = {}
with Arena.create(64 << 20, 0) as a, Arena.create(64 << 20, 0) as b:
    src, dst = a.bytes(), b.bytes()
    kinds = {"torch stream": torch_stream, "cupy stream": cupy_stream, "flashboot Stream": ours}
    for name, stream in kinds.items():
        out[name] = statistics.median(per_call_cost_us(mover, dst, src, stream) for _ in range(5))

    def bare(n=2000):  # the floor of a Python-issued copy: CuPy's runtime call alone, no checks
        rt, d, s, h = cupy.cuda.runtime, dst.data_ptr(), src.data_ptr(), cupy_stream.ptr
        t0 = time.perf_counter()
        for _ in range(n):
            rt.memcpyAsync(d, s, 4096, 4, h)
        us = (time.perf_counter() - t0) / n * 1e6
        cupy_stream.synchronize()
        return us

    out["bare cupy memcpyAsync"] = statistics.median(bare() for _ in range(5))
    ok = torch.equal(dst[:4096], src[:4096])
print("host us per call:", {k: round(v, 2) for k, v in out.items()}, "verified", ok)
json.dump({"per_call_us": out, "verified": ok}, open(sys.argv[1], "w"), indent=1)
EOF
echo "per-call rc=$?"
echo "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
