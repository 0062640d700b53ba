#!/usr/bin/env bash
# Written 2026-12-02 (eighth session) for the next device call: what the eighth session could not
# run on an H200 (its 30 minutes were spent), in one call of <= 9 min on one GPU, every step
# bounded; the device returns few files, so every step's result line goes to $OUT/summary.txt.
#   1. why cuMemcpyBatchAsync refused checkpoint C's pack batch (benchmarks/probes/batch_copy.py);
#   2. bench movers --chunked: the per-call cost with spans and with tensors (median of 5), batched rows;
#   3. bench boot --shapes A --end-to-end 0.25 1 (run D reached its cap before A's W > 0 cells);
#   4. with two GPUs (nvidia-h200-x2): bench refit --peer cuda:1 on A (issue 18's P2P row) and
#      bench movers --chunked's two-GPU chain (issue 20).
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session9.sh
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/gpu_prelude.sh"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
say "GPUs: $NGPU"

say "=== 1. checkpoint C's copy-engine pack batch ($(date +%T))"
timeout 100 python3 benchmarks/probes/batch_copy.py C 2>&1 | tail -6 | cut -c1-2000 | tee -a "$S"

say "=== 2. bench movers --chunked ($(date +%T))"
timeout 150 flashboot bench movers --chunked --repeats 3 --chunks 1MiB 4MiB --chain-bytes 2GiB --chain-chunk 64MiB \
  --json "$OUT/movers_chunked.json" >/tmp/movers_chunked.log 2>&1
say "bench movers rc=$?"; grep -A8 "host cost of one mover.copy" /tmp/movers_chunked.log | tee -a "$S"
grep -E "batched" /tmp/movers_chunked.log | grep -vE "unmerged|streams" | tee -a "$S"

say "=== 3. bench boot --shapes A --end-to-end 0.25 1 ($(date +%T))"
ROOT=/dev/shm/fb-s9; rm -rf "$ROOT"
timeout 200 flashboot bench boot --shapes A --loaders "flashload served" --end-to-end 0.25 1 --dir "$ROOT" \
  --json "$OUT/boot.json" >/tmp/boot.log 2>&1
say "bench boot rc=$?"; grep -E "ceiling|served:|end to end:" /tmp/boot.log | cut -c1-500 | tee -a "$S"
rm -rf "$ROOT"

if [ "$NGPU" -ge 2 ]; then
  say "=== 4. two GPUs: refit from cuda:1 ($(date +%T))"
  timeout "$(left 540)" flashboot bench refit --checkpoint A --repeats 3 --peer cuda:1 --json "$OUT/refit_p2p.json" \
    >/tmp/refit_p2p.log 2>&1
  say "bench refit --peer rc=$?"; grep -iE "p2p|peer|ceiling" /tmp/refit_p2p.log | head -8 | tee -a "$S"
fi
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
