#!/usr/bin/env bash
# 2026-12-02, twelfth session, third device call (<= 9.5 min).
#   1. bench boot C B A: the first served load and the boot end to end at W = 1 s (3 fresh
#      processes per cell), images kept;
#   2. the restart in a fresh process as restart does it (the table decoded beside the hash, the
#      views by make_views' default threads), then with 4 view threads: C, B, A;
#   3. the views' threads A/B inside the load: shape C's boot at W = 0 with FLASHBOOT_VIEW_THREADS
#      4 and 8, twice each, interleaved (the daemon's DMA runs beside the views there).
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session13c.sh
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/gpu_prelude.sh"
ROOT=/dev/shm/fb13; rm -rf "$ROOT"

say "=== 1. bench boot --end-to-end 1 ($(date +%T))"
timeout "$(left 330)" flashboot bench boot --shapes C B A --loaders "flashload served" --end-to-end 1 \
  --e2e-repeats 3 --dir "$ROOT" --keep --json "$OUT/boot.json" >/tmp/boot.log 2>&1
say "bench boot rc=$? ($(date +%T))"
grep -E "end to end|1st|ceiling" /tmp/boot.log | cut -c1-900 | tee -a "$S"
sed -n '/boot end to end on/,$p' /tmp/boot.log | tee -a "$S"

say "=== 2. restart: open + metadata + views, default threads then 4 ($(date +%T))"
imgs=$(ls -d "$ROOT"/image-* 2>/dev/null)
for th in "" 4; do
  timeout "$(left 60)" python3 -m flashboot.benchmarks.first_calls views $imgs --device cuda:0 ${th:+--view-threads $th} \
    >>"$OUT/first_calls.jsonl" 2>>/tmp/first_calls.err
  say "restart (threads ${th:-default}) rc=$?"
done
python3 -m flashboot.benchmarks.first_calls summary "$OUT/first_calls.jsonl" 2>&1 | tee -a "$S"

say "=== 3. views' threads in the load, C at W = 0 ($(date +%T))"
for round in 1 2; do
  for th in 4 8; do
    FLASHBOOT_VIEW_THREADS=$th timeout "$(left 60)" flashboot bench boot --shapes C --loaders "flashload served" \
      --end-to-end 0 --e2e-repeats 3 --dir "$ROOT" --keep >/tmp/boot_c.log 2>&1
    say "threads $th rc=$?"; grep -E "1st|end to end" /tmp/boot_c.log | cut -c1-420 | tee -a "$S"
  done
done
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
