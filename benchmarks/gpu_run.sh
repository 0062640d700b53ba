#!/usr/bin/env bash
# One device call: install, then run the named steps, logs and JSON into $OUT.
# Usage on the device machine (repo root):  bash benchmarks/gpu_run.sh STEP...
#   STEP = tests:FILES | tune | arena | movers | load | boot | stream | clone | sweep | demo | serve | soak
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, cupy; print("torch", torch.__version__, "triton", triton.__version__, "cupy", cupy.__version__, "gpus", torch.cuda.device_count())'
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -${TAIL:-25} "$OUT/$name.log"; echo "=== $name rc=$rc"; }
for s in "$@"; do
  case "$s" in
    tests:*) files=${s#tests:}; step tests "${TESTS_LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider -m "gpu or two_gpus" --ignore=tests/test_notebooks.py ${files//,/ } ;;  # notebooks: nbclient is a dev extra, not on the GPU image
    tune)   step tune 200 flashboot bench tune --json "$OUT/tune.json" ;;
    arena)  step arena 90 flashboot bench arena --json "$OUT/arena.json" ;;
    movers) step movers 200 flashboot bench movers --repeats 5 --json "$OUT/movers.json" ;;
    load)   step load 400 flashboot bench load --json "$OUT/load.json" ;;
    clone)  step clone "${CLONE_LIMIT:-300}" flashboot bench clone --json "$OUT/clone.json" ;;
    sweep)  step sweep "${SWEEP_LIMIT:-150}" flashboot bench clone --sweep 16MiB 64MiB 256MiB 1GiB --json "$OUT/sweep.json" ;;
    boot)   step boot "${BOOT_LIMIT:-420}" flashboot bench boot --json "$OUT/boot.json" ;;
    stream) step stream "${STREAM_LIMIT:-240}" flashboot bench stream ${STREAM_ARGS:-} --json "$OUT/stream.json" ;;
    demo)   step demo "${DEMO_LIMIT:-120}" flashboot demo ;;
    serve)  step serve "${SERVE_LIMIT:-110}" flashboot bench serve --repeats 3 --json "$OUT/serve.json" ;;
    soak)   step soak "${SOAK_LIMIT:-45}" flashboot bench soak --cycles "${SOAK_CYCLES:-50}" --json "$OUT/soak.json" ;;
  esac
done
