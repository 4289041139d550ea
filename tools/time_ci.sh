#!/usr/bin/env bash
# Time a clean-clone CI run of a commit, step by step (tools/ci_phases.py sums it). Not part of CI.
#   tools/time_ci.sh SRC_REPO REF WORKDIR [SHARED_DIR]
# clones SRC_REPO at REF into WORKDIR/ci-clone, links WORKDIR/shared -> SHARED_DIR (default: ../shared of this
# checkout; the repo expects it beside itself), runs `CI=true bash -x .ci/run` with pytest's --durations=30, every
# output line prefixed with the epoch second it was read; the log is WORKDIR/ci.log, the load average every 30 s
# WORKDIR/load.txt. Then: python tools/ci_phases.py WORKDIR/ci.log
set -euo pipefail
src=$1 ref=$2 work=$3
shared=${4:-$(cd "$(dirname "$0")/../.." && pwd)/shared}
rm -rf "$work" && mkdir -p "$work"
git clone -q "$src" "$work/ci-clone" && git -C "$work/ci-clone" checkout -q "$ref"
ln -s "$shared" "$work/shared"
cd "$work/ci-clone"
export PYTEST_ADDOPTS="--durations=30"
start=$(date +%s)
( while true; do echo "$(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"; sleep 30; done ) > "$work/load.txt" &
monitor=$!
set +e
CI=true bash -x .ci/run 2>&1 | while IFS= read -r line; do printf '%(%s)T %s\n' -1 "$line"; done > "$work/ci.log"
rc=${PIPESTATUS[0]}
set -e
kill "$monitor"
echo "rc=$rc total=$(( $(date +%s) - start ))s" | tee -a "$work/ci.log"
