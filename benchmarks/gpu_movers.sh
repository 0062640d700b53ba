#!/usr/bin/env bash
# Issue 20 on one H200: the mover tests on the GPU, then `bench movers --chunked` (per-call host
# cost, 1 GiB in 1/4/64 MiB chunks per call | batched (copy engine also over 4 streams) |
# flag-driven, copy+checksum vs copy with a few grids, the 3-arena chain: flag kernels vs copy
# engine + stream memops), then the chunk-size notebook on that JSON.
# Usage (repo root, device machine):  bash benchmarks/gpu_movers.sh      -> 6 files in $OUT: tests.log,
# clone_gpu.log, movers_chunked.log, movers_chunked.json (copy to notebooks/data/ for the notebook),
# notebook.log, chunk_size.ipynb (executed on that JSON, figures inline).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
python3 -c 'import torch, triton, cupy; from cuda import bindings; print("torch", torch.__version__, "triton", triton.__version__, "cupy", cupy.__version__, "cuda-bindings", bindings.__version__)'
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -${TAIL:-30} "$OUT/$name.log"; echo "=== $name rc=$rc"; }
# Whole files: with CUDA present the kernel tests run on the GPU, so they exercise the cached launches.
step tests 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_copy_kernels.py tests/test_flag_copy.py \
  tests/test_triton_movers.py tests/test_movers.py tests/test_checksum.py tests/test_kernel_launch.py
# The executor now batches the steps no one waits on: its GPU tests (copy engine + stream memops).
step clone_gpu 60 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_clone_gpu.py
# 1, 4 and 64 MiB chunks (the targets' sizes and a large one) keep the whole script near 3 minutes.
TAIL=80 step movers_chunked 100 flashboot bench movers --chunked --repeats 3 --chunks 1MiB 4MiB 64MiB \
  --chain-bytes 8GiB --chain-chunk 64MiB --json "$OUT/movers_chunked.json"
if python3 -c 'import nbclient, nbformat, ipykernel, matplotlib' 2>/dev/null; then
  FLASHBOOT_MOVERS_JSON="$OUT/movers_chunked.json" FLASHBOOT_NOTEBOOK_OUT=/tmp/figures TAIL=15 step notebook 40 \
    python3 -c "import nbformat, nbclient; nb = nbformat.read('notebooks/chunk_size.ipynb', as_version=4); \
nbclient.NotebookClient(nb, timeout=30, resources={'metadata': {'path': 'notebooks'}}).execute(); \
nbformat.write(nb, '$OUT/chunk_size.ipynb'); print('executed notebook written')"
else
  echo "=== notebook skipped: nbclient/nbformat/ipykernel/matplotlib not all installed here (the JSON above is what it reads)"
fi
ls -la "$OUT"
