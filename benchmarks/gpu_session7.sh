#!/usr/bin/env bash
# 2026-12-01, seventh session (written without a device; run it first thing when one is lent):
# one device call (<= 9.5 min, every step bounded) on main, every process importing FlashBoot
# from bytecode as a wheel's install leaves it (`flashboot warm` writes it; until now the GPU
# runs compiled every module in every process: the install is editable and the machine sets
# PYTHONDONTWRITEBYTECODE, so e.g. the clone's executor took 16.5 ms to import instead of ~3):
#   0. the setting: PYTHONDONTWRITEBYTECODE, the bytecode before/after `flashboot warm`, and the fd
#      table (FDSize) and open fds of a fresh process with torch's CUDA context;
#   1. the GPU tests of the boot, load, clone, movers, arena and sleep paths;
#   2. benchmarks/probes/fd_table.py: a take of 52 fds crossing the table's end vs grown ahead;
#   3. benchmarks/gpu_clone_boot.sh without its tests: checksum first call, the engine-like clone
#      of 13.76 GB (no early call: target ready + verify <= 100 ms; its "fd table" warm-up part and
#      pidfd_getfd_ms show whether the table's growth was the 28-31 ms), the fresh CLI clone;
#   4. `flashboot bench boot --shapes $SHAPES`, served + prepared, end to end at $LEVELS;
#   5. host us per mover.copy of 4 KiB for every mover (target <= 15): the Triton movers through the
#      driver runner (kernels/launch.py, new) and through Triton's launcher (FLASHBOOT_TRITON_LAUNCH=triton),
#      same run; then bench movers' chunked mode.
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session7.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-C A}; LEVELS=${LEVELS:-0 0.25}
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
status() { python3 -c 'import json; from flashboot.bytecode import bytecode_status; print(json.dumps(bytecode_status()))'; }
echo "=== 0. setting ($(date +%T)): PYTHONDONTWRITEBYTECODE='${PYTHONDONTWRITEBYTECODE:-}'; bytecode before warm: $(status)"
timeout 120 flashboot warm --device cuda:0 >"$OUT/warm.log" 2>&1
echo "warm rc=$? :: $(head -1 "$OUT/warm.log") :: bytecode after: $(status)"
timeout 60 python3 -c '
import os, torch
torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
fdsize = next(l for l in open("/proc/self/status") if l.startswith("FDSize:")).split()[1]
fds = sorted(int(x) for x in os.listdir("/proc/self/fd"))
print("a fresh torch CUDA process: FDSize", fdsize, "open fds", len(fds), "highest", fds[-1], "threads", len(os.listdir("/proc/self/task")))'

echo "=== 1. GPU tests ($(date +%T))"
timeout "${TESTS_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_cubin.py tests/test_checksum.py \
  tests/test_views.py tests/test_boot.py tests/test_load.py tests/test_preload_service.py tests/test_preload_faults.py \
  tests/test_cuda_streams.py tests/test_arena_gpu.py tests/test_sleep_gpu.py tests/test_clone_gpu.py \
  tests/test_triton_movers.py tests/test_kernel_launch.py tests/test_copy_kernels.py tests/test_flag_copy.py >"$OUT/tests.log" 2>&1
echo "tests rc=$? :: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -12

echo "=== 2. fd table probe ($(date +%T))"
for open_before in 40 220; do
  timeout 30 python3 benchmarks/probes/fd_table.py 52 $open_before | tee -a "$OUT/fd_table.jsonl" | python3 -c '
import json, sys; d = json.load(sys.stdin)
print("52 fds after", d["open_before"], "open: cold take ms", d["cold_take_ms"], "| grown ahead", d["grown_take_ms"], "| growth ms", d["grow_ms"])'
done

echo "=== 3. checksum first call, clone ($(date +%T))"
BUDGET_S=${CLONE_BUDGET:-140} TESTS_LIMIT=1 REPEATS=1 timeout "${CLONE_LIMIT:-150}" bash benchmarks/gpu_clone_boot.sh 2>&1 | tail -40
mv "$OUT/tests.log" "$OUT/tests_all.log" 2>/dev/null  # gpu_clone_boot.sh writes its own tests.log

echo "=== 4. bench boot --shapes $SHAPES, end to end $LEVELS ($(date +%T))"
ROOT=/dev/shm/fb-s7; rm -rf "$ROOT"
timeout "${BOOT_LIMIT:-200}" flashboot bench boot --shapes $SHAPES --loaders "flashload served" "flashload prepared" \
  --end-to-end $LEVELS --dir "$ROOT" --json "$OUT/boot.json" >"$OUT/boot.log" 2>&1
echo "bench boot rc=$?"; grep -E "bytecode|ceiling|served:|prepared:|end to end:|FAILED|Error" "$OUT/boot.log" | head -30
rm -rf "$ROOT"

echo "=== 5. host us per mover.copy, every mover, driver runner vs Triton's launcher ($(date +%T))"
for launch in driver triton; do
  FLASHBOOT_TRITON_LAUNCH=$launch timeout 60 python3 - "$launch" <<'EOF' | tee -a "$OUT/per_call.jsonl"
import json, statistics, sys
import torch
from flashboot.arena import Arena
from flashboot.benchmarks.movers_chunked import per_call_cost_us
from flashboot.movers import create_mover, list_movers
stream, out = torch.cuda.Stream(device=0), {"launch": sys.argv[1]}
with Arena.create(64 << 20, 0) as a, Arena.create(64 << 20, 0) as b:
    a.bytes().random_(0, 255)
    for m in list_movers():
        if m.available and "d2d" in m.paths:
            mover = create_mover(m.name)
            out[m.name] = round(statistics.median(per_call_cost_us(mover, b.span(), a.span(), stream) for _ in range(5)), 2)
            b.bytes().zero_()
            mover.copy(b.span(), a.span(), 1 << 20, stream=stream)
            stream.synchronize()
            out[m.name + " exact"] = bool(torch.equal(b.bytes()[:1 << 20], a.bytes()[:1 << 20]))
print(json.dumps(out))
EOF
done
left=$(( 560 - ($(date +%s) - T0) )); [ "$left" -lt 20 ] && left=20
timeout "$left" flashboot bench movers --chunked --repeats 3 --chunks 1MiB 4MiB --chain-bytes 2GiB --chain-chunk 64MiB \
  --json "$OUT/movers_chunked.json" >"$OUT/movers_chunked.log" 2>&1
echo "bench movers rc=$?"; grep -iE "per call|host|ceiling|batched" "$OUT/movers_chunked.log" | head -20
echo "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
