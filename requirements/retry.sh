#!/usr/bin/env bash
# Runs an install command up to RETRY_TRIES times (default 4), RETRY_WAIT_S apart (default 20).
# A CI run once failed because PyPI's connection broke at the same byte six times in a row while
# pip downloaded triton (285 MB); pip's own resume retries did not get past it, a fresh try does.
set -uo pipefail
tries=${RETRY_TRIES:-4}
wait_s=${RETRY_WAIT_S:-20}
for ((try = 1; ; try++)); do
    "$@" && exit 0
    rc=$?
    if ((try >= tries)); then
        echo "retry.sh: '$*' failed $tries times (last exit $rc)" >&2
        exit "$rc"
    fi
    echo "retry.sh: '$*' exited $rc; try $((try + 1)) of $tries in ${wait_s}s" >&2
    sleep "$wait_s"
done
