#!/usr/bin/env bash
# Issue 19, the served path, on one GPU in one device call (< 4 min): the GPU tests of the
# load / boot / preloader path, `flashboot bench boot` (served and prepared, end to end) with the
# phases of every first call, how much a background prepare slows a GIL-bound W (shape C), and a
# probe of the engine's first alloc + export in a fresh process (cold, then after warm_import).
# Usage (repo root, on the GPU machine):  bash benchmarks/gpu_served.sh
#   SHAPES="C A" (default: C first, its first verified load was 7.8x) | W="0 0.25 1" | TESTS=0 |
#   TESTS_LIMIT=30 | BOOT_LIMIT=125 | GIL_LIMIT=30
# Logs and JSON go to $OUT (at most 6 files).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-C A}; W=${W:-0 0.25 1}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
T0=$(date +%s)

if [ "${TESTS:-1}" != 0 ]; then
echo "=== GPU tests of the served path: load, boot, preloader, checksum warm-up ($(date +%T))"
timeout "${TESTS_LIMIT:-30}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_load.py tests/test_boot.py \
  tests/test_preload_faults.py tests/test_checksum.py -k "served or prepared or piece or warm_chunk" >"$OUT/tests.log" 2>&1
echo "tests rc=$? :: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10
fi

echo "=== flashboot bench boot --shapes $SHAPES --loaders served prepared --end-to-end $W ($(date +%T))"
ROOT=/dev/shm/fb-gpu-served; rm -rf "$ROOT"
timeout "${BOOT_LIMIT:-125}" flashboot bench boot --shapes $SHAPES --loaders "flashload served" "flashload prepared" \
  --end-to-end $W --dir "$ROOT" --keep --json "$OUT/boot.json" >"$OUT/boot.log" 2>&1
echo "bench boot rc=$? (124: BOOT_LIMIT reached)"
grep -E "ceiling|served:|prepared:|FAILED" "$OUT/boot.log" | head -20
sed -n '/boot end to end on/,$p' "$OUT/boot.log" | head -20
python3 - "$OUT/boot.json" <<'EOF'
import json, sys
try:
    out = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"no boot.json: {exc}")
for s in out["shapes"]:
    ceil = s.get("ceiling_ms") or float("nan")
    for res in s["loaders"]:
        for i, c in enumerate(res.get("calls", ())):
            r = c["report"]
            ph = {n: round(r[f"{n}_ms"], 1) for n in ("wait", "metadata", "pin", "alloc", "exchange", "h2d", "verify",
                                                     "bind") if r.get(f"{n}_ms")}
            print(f"{s['shape']} {res['loader']} call {i + 1}: {c['ms']:.1f} ms = {c['ms'] / ceil:.2f}x bulk "
                  f"{ceil:.1f} ms; phases {ph}; daemon map {r['details'].get('daemon_map_ms')}, "
                  f"checksum after copy {r.get('verify_ms')}, setup {r['details'].get('setup_ms')}")
EOF

echo "=== a background prepare beside a GIL-bound W (shape C, W 1 s) ($(date +%T))"
timeout "${GIL_LIMIT:-30}" python3 -m flashboot.benchmarks.prepare_gil --device cuda:0 --w 1 --repeats 1 --profile \
  --dir "$ROOT" --keep --json "$OUT/gil.json" >"$OUT/gil.log" 2>&1
echo "prepare_gil rc=$?"; grep -v "^$" "$OUT/gil.log" | head -40

echo "=== the engine's first alloc + export of 13.8 GB in a fresh process: cold, after warm_import, after a 2 MiB arena ($(date +%T))"
for warm in none small_arena; do
  timeout 12 python3 - "$warm" <<'EOF'
import sys, time, torch
torch.cuda.set_device(0); torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
from flashboot.flashload.warm import import_loader
import_loader("cuda:0")
from flashboot.arena import Arena
t = time.perf_counter()
if sys.argv[1] == "warm_import":
    from flashboot.arena import warm_import
    warm_import("cuda:0", peers=[0])
elif sys.argv[1] == "small_arena":
    with Arena.create(2 << 20, "cuda:0") as small:
        small.export()
warm_ms = (time.perf_counter() - t) * 1e3
for call in (1, 2):
    t0 = time.perf_counter(); a = Arena.create(13_760_000_000, "cuda:0"); t1 = time.perf_counter()
    a.export(); t2 = time.perf_counter(); a.close(); t3 = time.perf_counter()
    print(f"first {sys.argv[1]} ({warm_ms:.1f} ms): call {call}: create {(t1 - t0) * 1e3:.1f} ms, "
          f"export {(t2 - t1) * 1e3:.1f} ms, close {(t3 - t2) * 1e3:.1f} ms")
EOF
done
echo "=== convoy: Arena.create(13.8 GB) + export in a thread beside a GIL-bound loop, by switch interval ($(date +%T))"
timeout 15 python3 - <<'EOF'
import sys, threading, time, torch
torch.cuda.set_device(0); torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
from flashboot.flashload.warm import import_loader
import_loader("cuda:0")
from flashboot.arena import Arena
from flashboot.benchmarks.boot_e2e import calibrate_steps_per_s, engine_workload
Arena.create(2 << 20, "cuda:0").close()
steps = int(calibrate_steps_per_s() * 0.3)
t = time.perf_counter(); engine_workload(steps); alone_ms = (time.perf_counter() - t) * 1e3
a = Arena.create(13_760_000_000, "cuda:0"); a.export(); a.close()
t = time.perf_counter(); a = Arena.create(13_760_000_000, "cuda:0"); a.export(); a.close()
create_alone_ms = (time.perf_counter() - t) * 1e3
print(f"W alone {alone_ms:.0f} ms; create + export + close alone {create_alone_ms:.1f} ms")
for interval in (0.005, 0.0005, 0.0001, 0.00005):
    for rep in range(1):
        sys.setswitchinterval(interval)
        took = {}
        def work():
            t0 = time.perf_counter(); b = Arena.create(13_760_000_000, "cuda:0"); b.export()
            took["create"] = (time.perf_counter() - t0) * 1e3; b.close()
        th = threading.Thread(target=work)
        t = time.perf_counter(); th.start(); engine_workload(steps); w_ms = (time.perf_counter() - t) * 1e3
        th.join()
        sys.setswitchinterval(0.005)
        print(f"interval {interval * 1e3:.2f} ms: create + export beside W took {took['create']:.1f} ms; "
              f"W {w_ms:.0f} ms (+{w_ms - alone_ms:.0f})")
EOF
rm -rf "$ROOT"
echo "=== done in $(( $(date +%s) - T0 )) s"
