#!/usr/bin/env bash
# 2026-12-02, tenth session, second device call (<= 9.5 min). Issue 19's boot end to end with
# the new control: each W > 0 process also runs W beside a bare daemon copy of the same image
# (no early call), so W's slowdown splits into the copy's own (host memory shared with its DMA)
# and the early call's thread's. Fresh processes, REPEATS per cell (3), W = WS (0 0.25 s), shapes SHAPES (C B A).
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session11b.sh
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/gpu_prelude.sh"

say "=== 1. bench boot --end-to-end ($(date +%T))"
timeout "$(left 520)" flashboot bench boot --shapes ${SHAPES:-C B A} --loaders "flashload served" --end-to-end ${WS:-0 0.25} \
  --e2e-repeats "${REPEATS:-3}" --json "$OUT/boot.json" >/tmp/boot.log 2>&1
say "bench boot rc=$? ($(date +%T))"
grep -E "end to end|1st|ceiling" /tmp/boot.log | cut -c1-700 | tee -a "$S"
OUT="$OUT" python3 - <<'PY' 2>&1 | tee -a "$S"
import json, os
try:
    out = json.load(open(os.path.join(os.environ["OUT"], "boot.json")))
except Exception as exc:
    raise SystemExit(f"no boot result: {exc}")
for s in out["shapes"]:
    for r in (s.get("end_to_end") or {}).get("rows", []):
        keys = ("w_s", "early", "total_ms", "totals_ms", "w_ms", "w_alone_ms", "w_after_ms", "w_beside_copy_ms",
                "w_taken_by_prepare_ms", "x_bound", "x_bound_same", "x_bound_beside_copy", "copy_request_ms",
                "load_ms", "prepare_call_ms", "prepare_thread_cpu_ms", "prepare_gil_bound_ms", "w_cpu_ms",
                "w_off_cpu_ms", "w_alone_cpu_ms", "w_after_cpu_ms", "w_beside_copy_cpu_ms", "error")
        print(s["shape"], {k: (round(r[k], 2) if isinstance(r.get(k), float) else r.get(k)) for k in keys if k in r})
PY
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
