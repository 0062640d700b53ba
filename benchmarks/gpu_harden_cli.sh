#!/usr/bin/env bash
# GPU check of the harden-cli work (issue 21, README and CLI items), one device call, < 6 min.
# Usage on the device machine (repo root):  bash benchmarks/gpu_harden_cli.sh
# Prints: bench arena on the GPU (the d2d ceiling row and targets, JSON copy_ceiling_*), then the
# README's python examples on cuda:0 (arena+movers with best_mover -> copy_engine, the model end to
# end, hold/open_held), best_mover's choice, Device.parse('0'), and flashboot movers' kernels line.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash benchmarks/gpu_run.sh arena                     # installs flashboot (-e .), then bench arena --json $OUT/arena.json
python3 - <<'PY' | tee "$OUT/harden_cli_checks.log"
import json, os
from flashboot import Device
from flashboot.movers import best_mover
print("Device.parse('0') ->", Device.parse("0"))
print("best_mover(cuda:0) ->", best_mover("cuda:0").name, "| best_mover(cpu, cuda:0) ->", best_mover("cpu", "cuda:0").name)
a = json.load(open(os.path.join(os.environ.get("OUT", "/tmp/out"), "arena.json")))
print("arena ceiling:", a.get("copy_ceiling_what"), round(a.get("copy_ceiling_gbps", 0), 1), "GB/s")
PY
flashboot movers | tail -1
echo "=== README examples and CLI output tests on the GPU ($(date +%T))"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_readme.py tests/test_cli_output.py tests/test_movers.py \
  -k "python_examples or arena_and_movers or model_example or hold_example or bare_index or best_mover or movers_says or inspect" \
  > "$OUT/harden_cli_tests.log" 2>&1
echo "pytest rc=$?"; tail -15 "$OUT/harden_cli_tests.log"
