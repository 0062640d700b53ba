#!/usr/bin/env bash
# 2026-12-02, ninth session, second device call (<= 9.5 min, one GPU, every step bounded), after
# gpu_session10.sh's run at 01:52. Changed since: a run of steps that continue one another (a star's
# or a refit's whole image) is one mover.copy, no batch built (the lanes' GPU time included ~0.4 ms
# of issue latency); each unit's event is timed once. Measured: the GPU tests, bench refit A, the
# engine-like clone (issue 19: ready + verify, transfer vs D2D), and the TMA tables' sweep
# (benchmarks/probes/tma_box.py, run 2). Key lines go to $OUT/summary.txt.
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session10b.sh
source "$(dirname "$0")/gpu_prelude.sh"

say "=== 1. GPU tests ($(date +%T))"
timeout "$(left 100)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_streams.py tests/test_clone_gpu.py \
  tests/test_weight_update.py tests/test_arena_remap.py >/tmp/tests.log 2>&1
say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)" /tmp/tests.log | head -12 | tee -a "$S"

say "=== 2. bench refit A ($(date +%T))"
timeout "$(left 110)" flashboot bench refit --checkpoint A --repeats 3 --json "$OUT/refit_A.json" >/tmp/refit.log 2>&1
say "bench refit rc=$?"
refit_summary

say "=== 3. the engine-like clone ($(date +%T))"
mkdir -p /tmp/cb
OUT=/tmp/cb BUDGET_S=$(left 130) TESTS_LIMIT=1 REPEATS=1 timeout "$(left 140)" bash benchmarks/gpu_clone_boot.sh 2>&1 \
  | grep -vE "^(cubin cache|import time)" | tail -24 | tee -a "$S"
cp /tmp/cb/clone_boot.jsonl "$OUT/" 2>/dev/null

say "=== 4. TMA tables probe ($(date +%T))"
timeout "$(left 150)" python3 benchmarks/probes/tma_box.py >"$OUT/tma_box.jsonl" 2>/tmp/tma_box.err
say "probe rc=$? :: $(tail -2 /tmp/tma_box.err | cut -c1-300)"
python3 - "$OUT/tma_box.jsonl" <<'PY' 2>&1 | tee -a "$S"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for r in rows:
    if "shipped" in r["what"] or "ceiling" in r["what"] or r["what"] == "2d single":
        print(r)
for what in ("1d table 4 MiB", "2d table 4 MiB"):
    ok = sorted((r for r in rows if r["what"] == what), key=lambda r: -r["ratio"])
    for r in ok[:5]:
        print(r)
    print(what, "shipped-like:", [r for r in ok if r.get("block") == 32768 and r.get("stages") == 3 and r.get("per_sm") == 2])
errs = [r for r in rows if "error" in r]
print(len(errs), "errors", errs[:1])
PY
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
