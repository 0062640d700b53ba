#!/usr/bin/env bash
# 2026-12-04, twenty-ninth session, one device call (<= 9.5 min): issue 19's figures, each step optional.
#   1. (TESTS=1) the one-GPU tests of every path that loads, clones, sleeps or refits; (LOAD_TESTS=1) the load path's only;
#      (TEST_FILES="tests/a.py tests/b.py") the GPU tests of those files;
#      (GIL=1) benchmarks/probes/gil_free_calls.py: W beside a thread making and handing over a 13.76 GB arena, and
#      that thread's CPU inside the calls that release the GIL (GIL_ROUNDS rounds);
#   2. (BOOT=1) bench boot: first served load of SHAPES and the boot end to end at WS (REPEATS fresh processes per cell);
#      (VIEWS=1) then the restart (open_held + metadata + views) on the bench's images;
#   3. (TIMELINE=1) shape B's image (step 2's, or made), then benchmarks/probes/boot_timeline.py at W = TW
#      (W's stalls put against the early call's steps; VARIANTS=1 adds the hand-over or all but the reply's wait in prepare());
#   4. (CLONE=1) a 13.76 GB seed on cuda:0; (ENGINE_CLONE=1) engine-like clones, plain and early; CLONE_PAIRS pairs of
#      a bare `import torch` + CUDA context process and a fresh `flashboot clone --verify`;
#   5. (SERVE=1) many engines at once from one daemon (ENGINES);
#   6. (STREAM=1) bench stream: checkpoint A (STREAM_SCALE) streamed from the machine's disk, the first load in a fresh
#      process and one after a warm-up (reads in flight chosen on the disk), the same with them fixed, against the
#      disk's best O_DIRECT rate;
#   7. (SWAP=1) bench swap: sleep/wake (level 1, from the daemon) and swap of two images of checkpoint A;
#   9. (REFIT=1) bench refit on checkpoint A (REFIT_REPEATS);
#   8. (PROBES=1) the views' first-call page faults (shape B, fresh processes), the level-1 backup's pin by how its
#      memory is made (PIN_GIB), the disk's O_DIRECT rate by reads in flight and read size (DISK_GIB on /var/tmp).
# Usage (repo root, GPU machine): OUT=/some/dir [TESTS=1] [GIL=1] [BOOT=1 SHAPES="B C" WS="0 0.25" REPEATS=5] [CLONE=1] [STREAM=1] bash benchmarks/gpu_session29.sh
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/gpu_prelude.sh"
ROOT=/dev/shm/fb29; rm -rf "$ROOT"

[ "${TESTS:-0}" = 1 ] && loading_gpu_tests "${TESTS_S:-220}"
[ "${LOAD_TESTS:-0}" = 1 ] && load_gpu_tests "${TESTS_S:-90}"
if [ -n "${TEST_FILES:-}" ]; then
  timeout "$(left "${TESTS_S:-120}")" python3 -m pytest -q -p no:cacheprovider -rfE -m "gpu or two_gpus" $TEST_FILES \
    >"$OUT/tests.log" 2>&1
  say "tests of $TEST_FILES rc=$? :: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -12 | cut -c1-400 | tee -a "$S"
fi
if [ "${GIL:-0}" = 1 ]; then
  say "=== 1b. do the hand-over's driver calls and sends leave the GIL to W? ($(date +%T))"
  timeout "$(left 90)" python3 benchmarks/probes/gil_free_calls.py 13.76e9 "${GIL_ROUNDS:-5}" >"$OUT/gil_free.json" 2>/tmp/gil.err
  say "gil_free_calls rc=$?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('cuda_bindings','driver_releases_gil','segments','alone','beside')})" "$OUT/gil_free.json" 2>&1 | tee -a "$S"; tail -3 /tmp/gil.err | tee -a "$S"
fi

if [ "${BOOT:-0}" = 1 ]; then
  say "=== 2. bench boot --end-to-end ${WS:-0 0.25} ($(date +%T))"
  bench_boot_e2e "${BOOT_S:-400}"
  [ "${VIEWS:-0}" = 1 ] && { say "=== 2b. restart views ($(date +%T))"; restart_views; }
fi
if [ "${TIMELINE:-0}" = 1 ]; then
  say "=== 3. shape B's image (unless step 2 made it), then the boot's timeline at W = ${TW:-0.25} s ($(date +%T))"
  [ -d "$ROOT/image-B" ] || timeout "$(left 150)" python3 - "$ROOT" <<'PY' 2>&1 | tail -3 | tee -a "$S"
import sys, time, flashboot
from flashboot.benchmarks.checkpoints import CHECKPOINTS, make_checkpoint
t = time.perf_counter()
make_checkpoint(f"{sys.argv[1]}/ckpt-B", CHECKPOINTS["B"], device="cuda:0")
flashboot.prepack(f"{sys.argv[1]}/ckpt-B", f"{sys.argv[1]}/image-B", progress=False)
print(f"image B made in {time.perf_counter() - t:.1f} s")
PY
  rm -rf "$ROOT/ckpt-B"
  timeout "$(left "${TIMELINE_S:-240}")" python3 benchmarks/probes/boot_timeline.py "$ROOT/image-B" --shm "$ROOT/shm" \
    --w "${TW:-0.25}" --repeats "${TREPEATS:-5}" $([ "${VARIANTS:-0}" = 1 ] && echo --variants) >"$OUT/timeline.jsonl" 2>/tmp/timeline.err
  say "timeline rc=$?"; grep medians "$OUT/timeline.jsonl" | tee -a "$S"; tail -3 /tmp/timeline.err | tee -a "$S"
fi
rm -rf "$ROOT"
if [ "${CLONE:-0}" = 1 ]; then
  say "=== 4. clone: seed of 13.76 GB on cuda:0, engine-like clones (${ENGINE_CLONE:-1}), ${CLONE_PAIRS:-6} CLI pairs ($(date +%T))"
  clone_figures "${CLONE_PAIRS:-6}" "${ENGINE_CLONE:-1}"
fi
if [ "${SERVE:-0}" = 1 ]; then
  say "=== 5. bench serve --engines ${ENGINES:-1 2 4 8} ($(date +%T))"
  serve_engines
fi
if [ "${STREAM:-0}" = 1 ]; then
  say "=== 6. bench stream --scale ${STREAM_SCALE:-1} ($(date +%T))"
  stream_disk "${STREAM_SCALE:-1}"
fi
if [ "${SWAP:-0}" = 1 ]; then
  say "=== 7. bench swap --scale ${SWAP_SCALE:-1} ($(date +%T))"
  swap_figures "${SWAP_SCALE:-1}"
fi
if [ "${PROBES:-0}" = 1 ]; then
  say "=== 8. probes: view faults, backup pin, disk depth ($(date +%T))"
  probe_figures "${PIN_GIB:-12.81}" "${DISK_GIB:-8}"
fi
if [ "${REFIT:-0}" = 1 ]; then
  say "=== 9. bench refit --checkpoint A --repeats ${REFIT_REPEATS:-3} ($(date +%T))"
  bench_refit "${REFIT_REPEATS:-3}"
fi
say "=== done in $(( $(date +%s) - T0 )) s ($(date +%T))"
