#!/usr/bin/env bash
# Issue 18 (refit) on one H200 (two when lent: the P2P row): the gpu-marked refit tests (refit
# byte-exact vs a fresh pre-pack, the remap under a captured CUDA graph, logits after a refit
# bitwise equal to a from-scratch load), `bench refit` on checkpoint shapes A (3,170 tensors /
# 13.8 GB) and C (40,250 tensors / 2.6 GB), 200 refit soak cycles, then one summary against the
# issue's targets. Usage (repo root, device machine):  bash benchmarks/gpu_refit.sh  -> $OUT
# The summary adds the pack table's word width and grid, the pack launch sweep, the first refit
# (which maps the trainer's arena) and each refit's median breakdown of its total. A runs with
# --sweep: 16 pack launch settings (programs/SM x warps x tile x stages) and the refit copy's mover x
# chunk (atomic and in place), so the defaults can be picked from this one run. The tests include
# the engine refit (tests/test_integrations_refit.py: a bound model refit on cuda:0, bitwise).
# STEPS="tests A C" (default; add logits, soak) picks steps; SCALE_A / SCALE_C shrink the bytes
# (tensor counts kept). At most 4 minutes: each step bounded by timeout (40 + 130 + 50 s).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T))"; timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -${TAIL:-25} "$OUT/$name.log"; echo "=== $name rc=$rc"; }
PEER=(); [ "$NGPU" -ge 2 ] && PEER=(--peer cuda:1)
for s in ${STEPS:-tests A C}; do
  case "$s" in
    tests) TAIL=15 step tests 40 python3 -m pytest -q -p no:cacheprovider -m "gpu or two_gpus" \
             tests/test_integrations_refit.py tests/test_weight_update.py tests/test_arena_remap.py ;;
    logits) TAIL=10 step logits 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_weight_update_logits.py ;;
    A) TAIL=22 step bench_A 130 flashboot bench refit --checkpoint A --scale "${SCALE_A:-1}" --repeats 3 --sweep \
         ${PEER[@]+"${PEER[@]}"} --json "$OUT/refit_A.json" ;;
    C) TAIL=20 step bench_C 50 flashboot bench refit --checkpoint C --scale "${SCALE_C:-1}" --repeats 3 \
         --json "$OUT/refit_C.json" ;;
    soak) TAIL=12 step soak 60 flashboot bench soak --kinds refit --cycles 200 --json "$OUT/soak_refit.json" ;;
  esac
done
echo "=== summary (targets: pack A >= 0.9x D2D, pack C >= 0.8x, refit atomic >= 0.85x + remap <= 5 ms, in place >= 0.9x)"
OUT="$OUT" python3 - <<'PY'
import json, os
for name, target in (("A", 0.9), ("C", 0.8)):
    path = os.path.join(os.environ["OUT"], f"refit_{name}.json")
    if not os.path.exists(path):
        print(f"{name}: no result"); continue
    r = json.load(open(path))["refit"][0]
    a, i = r["refit_atomic"], r["refit_in_place"]
    print(f"{name}: {r['tensors']:,} tensors {r['nbytes'] / 1e9:.2f} GB, D2D {r['d2d_ceiling_gbps']:.0f} GB/s | "
          f"pack kernel {r['pack_kernel_vs_d2d']:.2f}x (target {target}), copy_ per tensor "
          f"{r['pack_copy_per_tensor_vs_d2d']:.2f}x, copy engine {r.get('pack_copy_engine_vs_d2d') or 0:.2f}x | "
          f"refit atomic copy {a['copy_vs_d2d']:.2f}x remap {a['remap_ms']:.2f} ms verify {a['verify_ms']:.1f} ms | "
          f"in place {i['copy_vs_d2d']:.2f}x | baseline {r['baseline_per_parameter_ms']:.1f} ms, speed-up copy "
          f"{r['speedup_vs_baseline']['copy_atomic']:.2f}x, pack+refit {r['speedup_vs_baseline']['pack_plus_refit_atomic']:.2f}x"
          + (f" | P2P {r['p2p']['vs_p2p']:.2f}x" if "p2p" in r else ""))
    t = r.get("pack_table", {})
    print(f"  pack table: {t.get('elem_bytes')}-byte words, align16 {t.get('align16')}, grid {t.get('grid')}, "
          f"{t.get('tiles')} tiles, tuning {t.get('tuning')}; sweep (per SM/warps/KiB: x D2D): "
          + ", ".join(f"{s['programs_per_sm']}/{s['num_warps']}/{s['block_bytes'] >> 10}"
                      f"{'/' + str(s['num_stages']) if 'num_stages' in s else ''}: {s['vs_d2d']:.2f}"
                      for s in sorted(r.get("pack_sweep", []), key=lambda s: -s["vs_d2d"])))
    for mode in ("atomic", "in_place"):
        rows = sorted((s for s in r.get("refit_sweep", []) if s["mode"] == mode), key=lambda s: -s["vs_d2d"])
        if rows:
            print(f"  refit sweep {mode} (mover/chunk MiB: wall x D2D, GPU x D2D): " + ", ".join(
                f"{s['mover']}/{s['chunk_bytes'] >> 20}: {s['vs_d2d']:.3f}, {s['gpu_vs_d2d']:.3f}" for s in rows))
    for mode in ("atomic", "in_place"):
        m = r[f"refit_{mode}"]
        print(f"  {mode} first refit: copy {m['first']['copy_ms']:.2f} ms, total {m['first']['total_ms']:.2f} ms; "
              "median breakdown (ms): " + ", ".join(f"{k.replace('_ms', '')} {v:.2f}" for k, v in m["breakdown"].items()))
PY
ls -la "$OUT"
