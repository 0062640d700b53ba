# Sourced by the benchmarks/gpu_session*.sh scripts (repo root, on the GPU machine), one device
# call each. The device returns only the last 12,000 characters of output and a few files, so each
# step's key lines go to $OUT/summary.txt through `say`.
# Sets OUT (default /tmp/out), S (the summary) and T0; defines
#   say LINE...      the line to stdout and the summary;
#   left N           N, or the seconds left of the call's BUDGET_S if fewer (at least 10): a step's timeout;
#   soak_refit       200 refit cycles (`bench soak --kinds refit`), its last lines;
#   bench_refit N    bench refit on checkpoint A with N repeats, then refit_summary;
#   refit_summary    bench refit's $OUT/refit_A.json in a few lines (ceiling, copies, remap, breakdown);
#   movers_chunked   issue 20's `bench movers --chunked` (1 and 4 MiB, a 2 GiB chain), its key lines;
#   load_gpu_tests N the GPU tests of the load path (arena, boot, load, views, load sources), at most N s, their result;
#   loading_gpu_tests N  the one-GPU tests of every path that loads, clones, sleeps or refits, at most N s, into
#                    $OUT/tests.log, their result and failures;
#   bench_boot_e2e N issue 19's `bench boot` (served, first loads and the boot end to end at $WS, $REPEATS
#                    fresh processes per cell, shapes $SHAPES, images under $ROOT), at most N s, its key lines;
#   restart_views    the restart (open_held + metadata + views) on the images under $ROOT, fresh processes;
#   clone_figures P E  a 13.76 GB seed on cuda:0; with E=1 engine-like clones (plain, then with the early call);
#                    with $MAP_AB=1 benchmarks/probes/map_groups_ab.py ($MAP_AB_ROUNDS rounds); then P (0: none) alternating pairs of a bare `import torch` + CUDA context process and a fresh
#                    `flashboot clone --verify` (target: +150 ms);
#   serve_engines    many engines at once from one daemon (`bench serve --engines $ENGINES`), its table;
#   stream_disk F    `bench stream --scale F` on the machine's disk (/var/tmp), its key lines;
#   swap_figures F   `bench swap --scale F` (sleep/wake and swap of two images of checkpoint A), its ratios;
#   probe_figures G D  benchmarks/probes/view_faults.py (shape B, 3 fresh processes per arena device in
#                    $VIEW_DEVICES and view thread count in $VIEW_THREADS), backup_pin.py (G GiB, $PIN_WAYS; 0: none),
#                    disk_depth.py (a D GiB file on /var/tmp; 0: none; $DISK_CONFIGS: its CONFIGS ROUNDS), into $OUT/probes.jsonl.
# Installs the checkout; unless WARM=0, writes FlashBoot's bytecode and caches first (`flashboot warm`).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONSAFEPATH=1  # the checkout root off sys.path: its kernels/ would shadow the kernels package transformers imports
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S="$OUT/summary.txt"
BUDGET_S=${BUDGET_S:-560}
T0=$(date +%s)
say() { echo "$*" | tee -a "$S"; }
left() { local l=$(( BUDGET_S - ($(date +%s) - T0) )); [ "$l" -lt 10 ] && l=10; [ "$1" -lt "$l" ] && l=$1; echo "$l"; }
soak_refit() {
  timeout "$(left 70)" flashboot bench soak --kinds refit --cycles 200 --json "$OUT/soak_refit.json" >/tmp/soak.log 2>&1
  say "soak rc=$?"; grep -vE "^\s*$" /tmp/soak.log | tail -8 | cut -c1-240 | tee -a "$S"
}
bench_refit() {
  timeout "$(left 110)" flashboot bench refit --checkpoint A --repeats "$1" --json "$OUT/refit_A.json" >/tmp/refit.log 2>&1
  say "bench refit rc=$?"
  refit_summary
}
refit_summary() {
  OUT="$OUT" python3 - <<'PY' 2>&1 | tee -a "$S"
import json, os
try:
    r = json.load(open(os.path.join(os.environ["OUT"], "refit_A.json")))["refit"][0]
except Exception as exc:
    print("no refit result:", exc); raise SystemExit
print(f"D2D ceiling {r['d2d_ceiling_ms']} ms, {r['d2d_ceiling_gbps']:.0f} GB/s; pack kernel {r['pack_kernel_vs_d2d']:.3f}x")
for mode in ("atomic", "in_place"):
    m = r[f"refit_{mode}"]
    b = m["breakdown"]
    print(f"{mode}: copy {m['copy_ms']:.3f} ms = {m['copy_vs_d2d']:.3f}x (gpu {b.get('copy_gpu_ms', 0):.3f} ms), "
          f"remap {m['remap_ms']:.3f} ms, verify {m['verify_ms']:.2f}, total {m['total_ms']:.1f}, first {m['first']}")
    print("   ", {k: round(v, 3) for k, v in b.items() if k.startswith("remap") or k in ("clone_other_ms", "map_during_copy_ms")})
print("speed-up", r.get("speedup_vs_baseline"))
PY
}
movers_chunked() {
  timeout "$(left 150)" flashboot bench movers --chunked --repeats 3 --chunks 1MiB 4MiB --chain-bytes 2GiB \
    --chain-chunk 64MiB --json "$OUT/movers_chunked.json" >/tmp/movers_chunked.log 2>&1
  say "bench movers rc=$?"; grep -A8 "host cost of one mover.copy" /tmp/movers_chunked.log | tee -a "$S"
  grep -E "batched" /tmp/movers_chunked.log | grep -vE "unmerged|streams" | tee -a "$S"
}
load_gpu_tests() {
  timeout "$(left "$1")" python3 -m pytest -q -p no:cacheprovider -m "gpu or two_gpus" tests/test_arena_gpu.py \
    tests/test_boot.py tests/test_load.py tests/test_views.py tests/test_load_sources.py >/tmp/tests.log 2>&1
  say "tests rc=$? :: $(tail -1 /tmp/tests.log)"; grep -E "^(FAILED|ERROR)|Error" /tmp/tests.log | head -12 | cut -c1-400 | tee -a "$S"
}
loading_gpu_tests() {
  say "=== the one-GPU tests of every path that loads, clones, sleeps or refits ($(date +%T))"
  timeout "$(left "$1")" python3 -m pytest -q -p no:cacheprovider -rfE -m "gpu or two_gpus" \
    tests/test_arena_gpu.py tests/test_arena_remap.py tests/test_sleep_gpu.py tests/test_boot.py tests/test_load.py \
    tests/test_views.py tests/test_stream.py tests/test_preload_faults.py tests/test_preload_service.py \
    tests/test_checksum.py tests/test_kernel_cubin.py tests/test_clone_gpu.py tests/test_cuda_streams.py \
    tests/test_weight_update.py >"$OUT/tests.log" 2>&1
  say "tests rc=$? (124: out of time) :: $(tail -1 "$OUT/tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -12 | cut -c1-400 | tee -a "$S"
}
bench_boot_e2e() {
  timeout "$(left "$1")" flashboot bench boot --shapes ${SHAPES:-B A C} --loaders "flashload served" \
    --end-to-end ${WS:-0 0.25} --e2e-repeats "${REPEATS:-3}" --dir "$ROOT" --keep --json "$OUT/boot.json" >/tmp/boot.log 2>&1
  say "bench boot rc=$? ($(date +%T))"
  grep -E "end to end|1st|ceiling" /tmp/boot.log | cut -c1-1200 | tee -a "$S"
  sed -n '/boot end to end on/,$p' /tmp/boot.log | tee -a "$S"
}
restart_views() {
  timeout "$(left 60)" python3 -m flashboot.benchmarks.first_calls views $(ls -d "$ROOT"/image-*) --device cuda:0 \
    >"$OUT/first_calls.jsonl" 2>/tmp/first_calls.err
  say "restart views rc=$?"; python3 -m flashboot.benchmarks.first_calls summary "$OUT/first_calls.jsonl" 2>&1 | tee -a "$S"
}
clone_figures() {
  local scratch seed store=127.0.0.1:${PORT:-29731}
  scratch=$(mktemp -d)
  export FLASHBOOT_TOKEN=gpu-session-token-0123456789abcdef TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  timeout "$(left 240)" python3 -m flashboot.benchmarks.clone_boot seed --store "$store" --ready "$scratch/ready" \
    >"$OUT/seed.log" 2>&1 &
  seed=$!
  for _ in $(seq 120); do [ -f "$scratch/ready" ] || ! kill -0 $seed 2>/dev/null && break; sleep 0.5; done
  if [ -f "$scratch/ready" ]; then
    if [ "$2" = 1 ]; then
      for early in "" "--early 0.5"; do
        timeout "$(left 45)" python3 -m flashboot.benchmarks.clone_boot engine --store "$store" $early \
          | tee -a "$OUT/clone_engine.jsonl" | python3 -m flashboot.benchmarks.clone_boot show 2>&1 | tee -a "$S"
      done
    fi
    if [ "${MAP_AB:-0}" = 1 ]; then
      timeout "$(left 120)" python3 benchmarks/probes/map_groups_ab.py --store "$store" --rounds "${MAP_AB_ROUNDS:-3}" \
        2>&1 | tee "$OUT/map_groups_ab.jsonl" | tail -1 | tee -a "$S"
    fi
    [ "$1" -gt 0 ] && timeout "$(left 150)" python3 -m flashboot.benchmarks.clone_boot cli --store "$store" --repeats "$1" \
      | tee -a "$OUT/clone_cli.jsonl" | python3 -m flashboot.benchmarks.clone_boot show 2>&1 | tee -a "$S"
  else
    say "seed did not come up:"; tail -20 "$OUT/seed.log" | tee -a "$S"
  fi
  kill $seed 2>/dev/null; wait $seed 2>/dev/null
  rm -rf "$scratch"
}
serve_engines() {
  timeout "$(left 150)" flashboot bench serve --engines ${ENGINES:-1 2 4 8} --scale 0.15 --repeats 1 \
    --json "$OUT/serve.json" >/tmp/serve.log 2>&1
  say "bench serve rc=$?"; grep -E "^│|ceiling" /tmp/serve.log | tee -a "$S"
}
stream_disk() {
  timeout "$(left 300)" flashboot bench stream --scale "$1" --json "$OUT/stream.json" >/tmp/stream.log 2>&1
  say "bench stream rc=$?"; grep -vE "^[┏┡└]" /tmp/stream.log | tail -16 | tee -a "$S"
}
swap_figures() {
  timeout "$(left 290)" flashboot bench swap --scale "$1" --repeats 3 --json "$OUT/swap.json" >/tmp/swap.log 2>&1
  say "bench swap rc=$?"; tail -20 /tmp/swap.log | tee -a "$S"
}
probe_figures() {
  local P="$OUT/probes.jsonl" R=/dev/shm/fb-probes
  rm -rf "$R"; timeout "$(left 60)" python3 benchmarks/probes/view_faults.py make "$R" B >/tmp/probe.log 2>&1 || tail -3 /tmp/probe.log
  [ -n "${VIEW_DEVICES-x}" ] && for k in 1 2 3; do for d in ${VIEW_DEVICES:-cuda:0}; do for t in ${VIEW_THREADS:-1 4}; do
    timeout "$(left 30)" python3 benchmarks/probes/view_faults.py run "$R" "$d" "$t" 2>>/tmp/probe.log | tee -a "$P" | tee -a "$S"
  done; done; done
  rm -rf "$R"
  [ "$1" != 0 ] && timeout "$(left 120)" python3 benchmarks/probes/backup_pin.py "$1" cuda:0 ${PIN_WAYS:-small,huge,huge+touch} 2>>/tmp/probe.log | tee -a "$P" | tee -a "$S"
  if [ "$2" != 0 ]; then
    dd if=/dev/zero of=/var/tmp/fb-depth.bin bs=64M count=$(( $2 * 16 )) oflag=direct status=none
    timeout "$(left 200)" python3 benchmarks/probes/disk_depth.py /var/tmp/fb-depth.bin cuda:0 $DISK_CONFIGS 2>>/tmp/probe.log | tee -a "$P" | tee -a "$S"
    rm -f /var/tmp/fb-depth.bin
  fi
  tail -3 /tmp/probe.log | tee -a "$S"
}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 \
  || { tail -20 /tmp/install.log; exit 1; }
if [ "${WARM:-1}" = 1 ]; then
  timeout 120 flashboot warm --device cuda:0 >/tmp/warm.log 2>&1
  say "=== warm rc=$? :: $(head -1 /tmp/warm.log) ($(date +%T))"
fi
