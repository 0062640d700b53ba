#!/usr/bin/env bash
# Issue 20 on one H200 (or two: the flag chain's P2P rows run when a second GPU is there): the mover
# tests on the GPU, then `bench movers --chunked` (per-call host cost; 1 GiB in 1/4/64 MiB chunks per
# call | batched, the copy engine merged (the default), unmerged, and unmerged over 4 and 8 streams |
# flag-driven; copy+checksum vs copy; two copies at once per mover (the aggregate two hops share);
# the 3-arena chain, flag kernels vs copy engine + stream memops, each hop beside the first hop alone
# and the two hops' aggregate), a compact summary with the chunk-size model's predictions, then the
# chunk-size notebook executed on that JSON.
# Usage (repo root, device machine):  bash benchmarks/gpu_movers.sh   (<= 4 min; every step bounded)
# -> $OUT: tests.log, clone_gpu.log, movers_chunked.log, movers_chunked.json (commit it as
# notebooks/data/movers_chunked.json), summary.log, notebook.log, chunk_size.ipynb (executed on it).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
python3 -c 'import torch, triton, cupy; from cuda import bindings; print("torch", torch.__version__, "triton", triton.__version__, "cupy", cupy.__version__, "cuda-bindings", bindings.__version__, "gpus", torch.cuda.device_count())'
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -${TAIL:-30} "$OUT/$name.log"; echo "=== $name rc=$rc"; }
# Whole files, this session's first (a timeout cuts the last): with CUDA present the kernel tests run
# on the GPU, so they exercise the kept runners and the direct launcher calls.
step tests 70 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_launch.py tests/test_bench_movers.py \
  tests/test_movers.py tests/test_mover_fit.py tests/test_triton_movers.py tests/test_flag_copy.py tests/test_copy_kernels.py \
  tests/test_checksum.py
# The executor batches the steps no one waits on (a batch now merges contiguous chunks): its GPU tests.
step clone_gpu 25 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_clone_gpu.py
# 1, 4 and 64 MiB chunks (the targets' sizes and a large one) keep the whole script near 3 minutes.
TAIL=100 step movers_chunked 100 flashboot bench movers --chunked --repeats 3 --chunks 1MiB 4MiB 64MiB \
  --chain-bytes 8GiB --chain-chunk 64MiB --json "$OUT/movers_chunked.json"
TAIL=40 step summary 10 python3 - "$OUT/movers_chunked.json" <<'EOF'
import sys
from flashboot.benchmarks.movers_chunked import load_report
from flashboot.sim.mover_fit import predict_measured_chains
r = load_report(sys.argv[1])
ceiling = max(r["ceiling_gbps_before"], r["ceiling_gbps_after"])
print(f"ceiling {r['ceiling_gbps_before']:,.0f} / {r['ceiling_gbps_after']:,.0f} GB/s (before / after)")
for e in r.get("errors", []):
    print("FAILED section", e.splitlines()[0])
print("host us per mover.copy (target <= 15):", {m: round(us, 1) for m, us in r["per_call_us"].items()})
for row in r["rows"]:
    if row["mode"] == "batched" and row["chunk_bytes"] in (1 << 20, 4 << 20):
        print(f"batched {row['chunk_bytes'] >> 20} MiB  {row['mover']:34s} {row.get('copies', '?'):>5} copies  "
              f"{row['ratio']:.3f}x  verified {row['verified']}")
for c in r["concurrent"]:
    print(f"two {c['mover']} copies at once: {c['aggregate_gbps']:,.0f} GB/s = {c['ratio']:.3f}x  verified {c['verified']}")
for c in r["chain"]:
    if "alone_ratio" in c:
        print(f"chain {c['method']} GPUs {c['devices']}: hop1 {c['hop1_ratio']:.3f}x  alone {c['alone_ratio']:.3f}x  "
              f"aggregate {c['aggregate_ratio']:.3f}x of {c['ceiling_gbps']:,.0f} GB/s  verified {c['verified']}")
for p in predict_measured_chains(r):
    if p["fit"] is not None:
        print(f"model {p['method']}: measured {p['measured_s'] * 1e3:.2f} ms, predicted "
              f"{p['predicted_s'] * 1e3:.2f} ms ({p['error']:+.1%}; target within 10 %), aggregate {p['aggregate']}")
    else:
        print(f"model {p['method']}: {p['why']}")
EOF
if python3 -c 'import nbclient, nbformat, ipykernel, matplotlib' 2>/dev/null; then
  FLASHBOOT_MOVERS_JSON="$OUT/movers_chunked.json" FLASHBOOT_NOTEBOOK_OUT=/tmp/figures TAIL=15 step notebook 25 \
    python3 -c "import nbformat, nbclient; nb = nbformat.read('notebooks/chunk_size.ipynb', as_version=4); \
nbclient.NotebookClient(nb, timeout=30, resources={'metadata': {'path': 'notebooks'}}).execute(); \
nbformat.write(nb, '$OUT/chunk_size.ipynb'); print('executed notebook written')"
else
  echo "=== notebook skipped: nbclient/nbformat/ipykernel/matplotlib not all installed here (the JSON above is what it reads)"
fi
ls -la "$OUT"
