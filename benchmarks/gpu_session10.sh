#!/usr/bin/env bash
# 2026-12-02, ninth session: one device call (<= 9.5 min on one GPU, every step bounded). What
# changed since the eighth session's last run, and is measured here:
#   - a clone's (and a refit's) end of copy is waited for in the driver (wait_events), not polled;
#   - a copy-engine batch of one merged copy is a plain cuMemcpyAsync;
#   - the remap takes its segment references and revokes exports before the device wait;
#   - a probe of TMA copies with one 2-D box per tile (benchmarks/probes/tma_box.py);
#   - bench movers --chunked's per-call cost with spans (never run on an H200).
# The device returns the last 12,000 characters and few files: key lines go to $OUT/summary.txt.
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session10.sh
source "$(dirname "$0")/gpu_prelude.sh"

say "=== 1. GPU tests ($(date +%T))"
timeout "$(left 110)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_streams.py tests/test_clone_gpu.py \
  tests/test_weight_update.py tests/test_arena_remap.py tests/test_triton_movers.py tests/test_copy_kernels.py \
  >/tmp/tests.log 2>&1
say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)" /tmp/tests.log | head -12 | tee -a "$S"

say "=== 2. bench refit A ($(date +%T))"
timeout "$(left 110)" flashboot bench refit --checkpoint A --repeats 3 --json "$OUT/refit_A.json" >/tmp/refit.log 2>&1
say "bench refit rc=$?"
refit_summary

say "=== 3. TMA 2-D boxes probe ($(date +%T))"
timeout "$(left 150)" python3 benchmarks/probes/tma_box.py >"$OUT/tma_box.jsonl" 2>/tmp/tma_box.err
say "probe rc=$? :: $(tail -2 /tmp/tma_box.err | cut -c1-300)"
python3 - "$OUT/tma_box.jsonl" <<'PY' 2>&1 | tee -a "$S"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for r in rows:
    if "shipped" in r["what"] or "ceiling" in r["what"]:
        print(r)
for what in ("2d single", "2d table 4 MiB"):
    ok = sorted((r for r in rows if r["what"] == what and "ratio" in r), key=lambda r: -r["ratio"])
    for r in ok[:4]:
        print(r)
    errs = [r for r in rows if r["what"].startswith(what[:8]) and "error" in r]
    if errs:
        print(what, len(errs), "errors; first:", errs[0])
PY

say "=== 4. bench movers --chunked ($(date +%T))"
movers_chunked
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
