#!/usr/bin/env bash
# 2026-12-02, eleventh session, second device call (<= 9.5 min).
#   1. the Gluon TMA probe (issue 20: TMA straight from shared memory to global, one copy and
#      batches of 4 and 1 MiB chunks, against the copy engine of the same run);
#   2. issue 19's boot end to end (gpu_session11b.sh's step: the early call's thread CPU time on the GPU machine).
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session12b.sh
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/gpu_prelude.sh"

say "=== 1. Gluon TMA probe ($(date +%T))"
timeout "$(left 150)" python3 benchmarks/probes/tma_gluon.py >"$OUT/tma_gluon.jsonl" 2>/tmp/tma_gluon.err
say "tma_gluon rc=$?"; tail -3 /tmp/tma_gluon.err | cut -c1-300 | tee -a "$S"; tail -2 "$OUT/tma_gluon.jsonl" | cut -c1-2000 | tee -a "$S"
WARM=0 BUDGET_S=$(left 560) bash "$(dirname "$0")/gpu_session11b.sh" | grep -vE "^$" >/dev/null
cat "$OUT/summary.txt" | tail -40
