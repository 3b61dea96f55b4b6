#!/usr/bin/env bash
# The GPU bundle in two device calls of under 10 minutes each (issue 38), from the repository root on the GPU machine:
#   bash benchmarks/gpu/run_all.sh 1   # install, then tests, fp16, lamb, step-cost    (about 6 minutes)
#   bash benchmarks/gpu/run_all.sh 2   # install (skipped when warm), then bert [peer configs...]  (about 6 minutes)
# Part 2 takes the peer arms' phase-2 configs as further arguments (paths from the repository root). Every check
# writes $OUT/<check>.json; the whole output goes to $OUT/log<part>.txt. A failing check does not stop the next;
# the exit status is non-zero if any failed. The per-check limits (timeout(1)) keep each part inside its call.
set -uo pipefail
PART=${1:?usage: run_all.sh 1|2 [peer configs...]}
shift
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
LOG=$OUT/log$PART.txt
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
# ttt.versions() asks git for the commit: the copy there has no .git, and the image may have no git.
command -v git >/dev/null || { mkdir -p /tmp/nogit && printf '#!/bin/sh\nexit 128\n' >/tmp/nogit/git \
  && chmod +x /tmp/nogit/git && export PATH=/tmp/nogit:$PATH; }
bash benchmarks/gpu/install.sh 2>&1 | tee -a "$LOG" || exit 1

failed=()
check() {  # check SECONDS NAME [run.py arguments...]
  local limit=$1 name=$2
  shift 2
  echo "== $name (limit ${limit}s) $(date +%T)" | tee -a "$LOG"
  timeout "$limit" python3 benchmarks/gpu/run.py --check "$name" --device cuda --out "$OUT" "$@" 2>&1 | tee -a "$LOG" \
    || failed+=("$name")
}
case $PART in
  1)
    check 90 tests --timeout 80
    check 60 fp16 --timeout 50
    check 90 lamb
    check 200 step-cost --timeout 60 --budget 130
    ;;
  2)
    peers=()
    for config in "$@"; do peers+=(--peer-config "$config"); done
    check 330 bert --timeout 150 "${peers[@]}" --phase1-steps 600 --phase2-steps 150
    ;;
  *) echo "part 1 or 2" >&2; exit 2 ;;
esac
echo "== done $(date +%T); failed: ${failed[*]:-none}" | tee -a "$LOG"
[ ${#failed[@]} -eq 0 ]
