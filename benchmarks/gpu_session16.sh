#!/usr/bin/env bash
# 2026-12-03, fifteenth session: where a same-GPU star clone's transfer loses time (issue 19, 0.85x D2D).
#   1. a seed of 13.76 GB on cuda:0 (benchmarks/clone_boot.py seed);
#   2. benchmarks/probes/clone_gaps.py: the clone's copies and gaps by CUDA events, the mapping
#      during the transfer, in modes first / again / all-ahead / chunk4g, then the D2D ceiling;
#   3. (ENGINE=1) the engine-like clone of clone_boot (plain and with the early call);
#   4. (CLI=1) fresh `flashboot clone --verify` processes against bare torch + CUDA context, CLI_REPEATS pairs;
#   5. (START=1) benchmarks/probes/clone_start.py: a plain clone's first phase in parts, 3 processes and one profiled;
#   6. (TESTS=1) every one-GPU test, in two groups (each bounded by its own timeout).
# With SEED=0 no seed is started (steps 2-4 need it).
# Usage (repo root, GPU machine): OUT=/some/dir [SEED=0] [GAPS=0] [MODES="..."] [ENGINE=0] [CLI=1] [START=1] [TESTS=1] bash benchmarks/gpu_session16.sh
BUDGET_S=${BUDGET_S:-300}
WARM=${WARM:-0}
source "$(dirname "$0")/gpu_prelude.sh"
export FLASHBOOT_TOKEN=gpu-session16-token-0123456789abcdef
STORE=127.0.0.1:${PORT:-29733}
SCRATCH=$(mktemp -d)
if [ "${START:-0}" = 1 ]; then
  say "=== 5. a plain clone's first phase in parts ($(date +%T))"
  for i in 1 2 3; do timeout "$(left 30)" python3 benchmarks/probes/clone_start.py | tee -a "$OUT/clone_start.jsonl" >>"$S"; done
  timeout "$(left 30)" python3 benchmarks/probes/clone_start.py --profile >"$OUT/clone_start_profile.txt" 2>&1
  tail -1 "$OUT/clone_start_profile.txt" >>"$S"
fi
if [ "${TESTS:-0}" = 1 ]; then
  say "=== 6. every one-GPU test ($(date +%T))"
  G1="tests/test_arena_gpu.py tests/test_arena_remap.py tests/test_sleep_gpu.py tests/test_boot.py tests/test_load.py
      tests/test_views.py tests/test_stream.py tests/test_preload_faults.py tests/test_preload_service.py
      tests/test_checksum.py tests/test_kernel_cubin.py tests/test_clone_gpu.py tests/test_cuda_streams.py
      tests/test_weight_update.py"
  G2="tests/test_triton_movers.py tests/test_copy_kernels.py tests/test_tma_ring.py tests/test_bench_movers.py
      tests/test_flag_copy.py tests/test_kernel_launch.py tests/test_weight_update_logits.py
      tests/test_integrations_refit.py tests/test_clone_nixl_gpu.py tests/test_integrations_engine_load.py"
  for g in G1 G2; do
    timeout "$(left "${TESTS_LIMIT:-250}")" python3 -m pytest -q -p no:cacheprovider -rfE -m "gpu or two_gpus" ${!g} \
      >"$OUT/tests_$g.log" 2>&1
    say "tests $g rc=$? (124: out of time) :: $(tail -1 "$OUT/tests_$g.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/tests_$g.log" | head -12 | cut -c1-400 | tee -a "$S"
  done
fi
[ "${SEED:-1}" = 1 ] || { rm -rf "$SCRATCH"; say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"; exit 0; }
say "=== 1. seed ($(date +%T))"
timeout "$(left 280)" python3 -m flashboot.benchmarks.clone_boot seed --store "$STORE" --ready "$SCRATCH/ready" \
  >"$OUT/seed.log" 2>&1 &
SEED=$!
for _ in $(seq 90); do [ -f "$SCRATCH/ready" ] || ! kill -0 $SEED 2>/dev/null && break; sleep 0.5; done
if [ -f "$SCRATCH/ready" ]; then
  say "seed ready: $(cat "$SCRATCH/ready")"
  for round in $( [ "${GAPS:-1}" = 1 ] && echo 1 2); do
    say "=== 2. clone gaps, fresh process $round ($(date +%T))"
    timeout "$(left 60)" python3 benchmarks/probes/clone_gaps.py --store "$STORE" ${MODES:+--modes "$MODES"} $( [ "$round" = 1 ] && [ -n "${PROFILE:-}" ] && echo --profile "$OUT/profile.txt") \
      >"$OUT/clone_gaps$round.jsonl" 2>/tmp/gaps.err
    say "probe rc=$?"; tail -3 /tmp/gaps.err | cut -c1-300 | tee -a "$S"
    python3 - "$OUT/clone_gaps$round.jsonl" <<'PY' 2>&1 | tee -a "$S"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["mode"] == "ceiling":
        print("ceiling", r); continue
    print(r["mode"], {k: r[k] for k in ("transfer_ms", "gbps", "stream_gbps", "ready_ms", "alloc_ms", "map_ahead",
                                       "map_during_copy", "copies", "gpu_copy_ms", "gpu_gap_ms")})
    print("   gaps", r["gaps_ms"][:16], "copies", r["copy_ms_each"][:16], "MiB", r["copy_mb_each"][:16])
    print("   issue", r["issue_host_ms"][:16], "executor", r["executor"], "profiled", r["profiled"])
PY
  done
  if [ "${ENGINE:-1}" = 1 ]; then
    for early in "" "--early 0.5"; do
      say "=== 3. engine-like clone ${early:-plain} ($(date +%T))"
      timeout "$(left 45)" python3 -m flashboot.benchmarks.clone_boot engine --store "$STORE" $early \
        | tee -a "$OUT/clone_boot.jsonl" | python3 -m flashboot.benchmarks.clone_boot show | tee -a "$S"
    done
  fi
  if [ "${CLI:-0}" = 1 ]; then
    say "=== 4. fresh flashboot clone --verify vs bare torch + CUDA context, ${CLI_REPEATS:-5} pairs ($(date +%T))"
    timeout "$(left 200)" python3 -m flashboot.benchmarks.clone_boot cli --store "$STORE" --repeats "${CLI_REPEATS:-5}" \
      | tee -a "$OUT/clone_cli.jsonl" | python3 -m flashboot.benchmarks.clone_boot show | cut -c1-400 | tee -a "$S"
  fi
else
  say "seed did not come up:"; tail -20 "$OUT/seed.log" | tee -a "$S"
fi
kill $SEED 2>/dev/null; wait $SEED 2>/dev/null
rm -rf "$SCRATCH"
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
