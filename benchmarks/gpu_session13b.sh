#!/usr/bin/env bash
# 2026-12-02, twelfth session, second device call (<= 9.5 min): issue 19's figures in one run on
# the views made by 8 threads.
#   1. bench boot: the first served load of C, B, A and the boot end to end at W = 0 and 0.25 s
#      (3 fresh processes per cell), images kept;
#   2. the restart in a fresh process (open the held arena + metadata + views) of those images;
#   3. the checksum kernel's first call in a fresh process after `flashboot warm`.
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmarks/gpu_session13b.sh
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/gpu_prelude.sh"
ROOT=/dev/shm/fb13; rm -rf "$ROOT"

say "=== 1. bench boot --end-to-end ${WS:-0 0.25} ($(date +%T))"
timeout "$(left 430)" flashboot bench boot --shapes ${SHAPES:-C B A} --loaders "flashload served" --end-to-end ${WS:-0 0.25} \
  --e2e-repeats "${REPEATS:-3}" --dir "$ROOT" --keep --json "$OUT/boot.json" >/tmp/boot.log 2>&1
say "bench boot rc=$? ($(date +%T))"
grep -E "end to end|1st|ceiling" /tmp/boot.log | cut -c1-900 | tee -a "$S"
sed -n '/boot end to end on/,$p' /tmp/boot.log | tee -a "$S"

say "=== 2. restart: open + metadata + views ($(date +%T))"
imgs=$(ls -d "$ROOT"/image-* 2>/dev/null)
[ -n "$imgs" ] && timeout "$(left 90)" python3 -m flashboot.benchmarks.first_calls views $imgs --device cuda:0 \
  >"$OUT/first_calls.jsonl" 2>/tmp/first_calls.err
say "restart rc=$?"; tail -2 /tmp/first_calls.err | cut -c1-300 | tee -a "$S"
say "=== 3. checksum first call ($(date +%T))"
timeout "$(left 40)" python3 -m flashboot.benchmarks.first_calls checksum --device cuda:0 >>"$OUT/first_calls.jsonl" 2>>/tmp/first_calls.err
say "checksum rc=$?"
python3 -m flashboot.benchmarks.first_calls summary "$OUT/first_calls.jsonl" 2>&1 | tee -a "$S"
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
