#!/usr/bin/env bash
# Issue 17's sweep on one GPU, from the repo root:  bash benchmarks/gpu_stay_sweep.sh
# 1. the gpu-marked sleep/wake tests: the drained level-1 sleep (each segment released
#    behind its D2H), the handover of one arena's segments to another (wake(donor=...)), the swap by
#    handover between two images, the CUDA graph replayed bitwise after level-1 and level-2 cycles;
# 2. flashboot bench swap --repeats 2: the figures with the new defaults (level-1 sleep
#    drained, swap by handover; the swap rows also time release during / after / before);
# 3. python3 -m flashboot.benchmarks.stay_sweep, if time is left: the raw driver variants side by
#    side on 13.76 GB ranges (release order and granularity, the H2D d ms after a release, the wake
#    right after one, swap released before / during / after or handed over).
# Logs and JSON go to $OUT. Each step is bounded; the whole finishes in under 4 minutes.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -${TAIL:-25} "$OUT/$name.log"; echo "=== $name rc=$rc"; }
TAIL=15 step tests 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sleep_gpu.py
TAIL=45 step swap $(( 225 - ($(date +%s) - START) )) flashboot bench swap --scale 1.0 --repeats 2 --json "$OUT/swap.json"
LEFT=$(( 228 - ($(date +%s) - START) ))
if [ "$LEFT" -gt 40 ]; then
  TAIL=30 step sweep "$LEFT" python3 -m flashboot.benchmarks.stay_sweep --repeats 2 --json "$OUT/sweep.json"
else
  echo "=== sweep skipped: $LEFT s left"
fi
echo "=== done in $(( $(date +%s) - START )) s"
