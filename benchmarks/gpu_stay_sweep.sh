#!/usr/bin/env bash
# Issue 17's sweep on one GPU, from the repo root:  bash benchmarks/gpu_stay_sweep.sh
# 1. the gpu-marked sleep/wake and arena tests (the arena's release and wake paths on the device);
# 2. python3 -m flashboot.benchmarks.stay_sweep: the driver's variants side by side on 13.76 GB
#    ranges (release order and granularity; the H2D d ms after a release; the wake right after a
#    release, bulk or pipelined, copy engine or SM kernel; swap with A released before / during /
#    after B's copy or A's physical handles handed to B), against the H2D ceiling of the same run;
# 3. flashboot bench swap --repeats 1 (the production figures with the defaults), if time is left.
# Logs and JSON go to $OUT. Each step is bounded; the whole finishes in under 5 minutes.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -${TAIL:-25} "$OUT/$name.log"; echo "=== $name rc=$rc"; }
TAIL=40 step sweep 150 python3 -m flashboot.benchmarks.stay_sweep --repeats 3 --json "$OUT/sweep.json"
TAIL=8 step tests 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sleep_gpu.py tests/test_arena_gpu.py
LEFT=$(( 285 - ($(date +%s) - START) ))
if [ "$LEFT" -gt 60 ]; then
  TAIL=30 step swap "$LEFT" flashboot bench swap --scale 1.0 --repeats 1 --json "$OUT/swap.json"
else
  echo "=== swap skipped: $LEFT s left"
fi
echo "=== done in $(( $(date +%s) - START )) s"
