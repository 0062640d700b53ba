#!/usr/bin/env bash
# Issue 21 (branch harden-clone) on the GPU machine, one device call, under 6 minutes:
#  - the served-load daemon's CUDA path after its staged-image change (a size check before each
#    copy; the mapping kept only to pin it): the GPU tests of served loads, the new truncated-image
#    test, and `bench serve` (figures comparable with RESULTS.md's);
#  - the store pre-flight (TCPStore's validate+ping spoken first) and the clone warm-up on CUDA:
#    the GPU clone tests.
# Run from the repo root: OUT=/some/dir bash benchmarks/gpu_harden_clone.sh ; logs land in $OUT
# (install.log, tests.log, serve.log, serve.json), a summary on stdout.
set -uo pipefail
export OUT=${OUT:-/tmp/out}
TESTS_LIMIT=${TESTS_LIMIT:-210} SERVE_LIMIT=${SERVE_LIMIT:-110} TAIL=${TAIL:-12} bash benchmarks/gpu_run.sh \
  tests:tests/test_preload_service.py,tests/test_load.py,tests/test_clone_gpu.py serve
