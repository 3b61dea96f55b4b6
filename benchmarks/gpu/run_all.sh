#!/usr/bin/env bash
# The GPU bundle (issue 38), from the repository root on the GPU machine, one device call a part:
#   BUDGET=540 bash benchmarks/gpu/run_all.sh all  # everything inside BUDGET seconds, bert at BERT-small batch 256 only
#   bash benchmarks/gpu/run_all.sh 1   # install, then tests, fp16, lamb, linalg, hooks, step-cost (about 7 minutes)
#   bash benchmarks/gpu/run_all.sh 2   # install, then bert's whole plan (issue 46: 4x512 at batch 256/1024/4096,
#                                      # 12x768 at 1024; expected 526 s, budget 550 s): a call of its own, 600 s
# `all` runs the three correctness checks side by side (none of them is timed), then linalg, hooks and step-cost
# alone, then bert alone with what is left, each check's launches cut to its share so every check writes its JSON
# before BUDGET runs out.
# Every check writes $OUT/<check>.json; the whole output goes to $OUT/log<part>.txt (lines prefixed by the check's
# name).
# `lamb` runs twice, with TORCH_CUDA_ARCH_LIST unset and set to the GPU's capability (FusedLamb's build, issue 45),
# writing lamb_arch_unset.json and lamb_arch_device.json.
# A failing check does not stop the next; the exit status is non-zero if any failed. DRY_RUN=1 runs the same on the
# CPU at toy sizes (run.py's --device cpu --tiny), to rehearse the script itself.
set -uo pipefail
PART=${1:?usage: run_all.sh 1|2|3|all}
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
LOG=$OUT/log$PART.txt
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
# ttt.versions() asks git for the commit: the copy there has no .git, and the image may have no git.
command -v git >/dev/null || { mkdir -p /tmp/nogit && printf '#!/bin/sh\nexit 128\n' >/tmp/nogit/git \
  && chmod +x /tmp/nogit/git && export PATH=/tmp/nogit:$PATH; }
bash benchmarks/gpu/install.sh 2>&1 | tee -a "$LOG" || exit 1

FAILED=$(mktemp)
check() {  # check SECONDS NAME [run.py arguments...]
  local limit=$1 name=$2
  shift 2
  echo "== $name $* (limit ${limit}s) $(date +%T)" | tee -a "$LOG"
  timeout "$limit" python3 benchmarks/gpu/run.py --check "$name" --device cuda --out "$OUT" "$@" ${DRY_RUN:+--device cpu --tiny} 2>&1 \
    | sed -u "s/^/[$name] /" | tee -a "$LOG" || echo "$name" >>"$FAILED"
}
case $PART in
  1)
    check 90 tests --timeout 80
    check 60 fp16 --timeout 50
    check 90 lamb --arch-list unset
    check 60 lamb --arch-list device  # loads the op the first one built
    check 60 linalg
    check 60 hooks
    check 200 step-cost --timeout 60 --budget 130
    ;;
  all)
    end=$((SECONDS + ${BUDGET:-540}))
    { check 150 lamb --arch-list unset; check 60 lamb --arch-list device; } &  # first: it compiles FusedLamb
    check 150 tests --timeout 140 &
    check 150 fp16 --timeout 140 &
    wait
    check 60 linalg
    check 60 hooks
    left=$((end - SECONDS)) && share=$((left - 150))  # step-cost's: at least 150 s stay for bert
    check $share step-cost --timeout 90 --budget $((share - 100))
    left=$((end - SECONDS))
    check $left bert --timeout 150 --budget $((left - 15)) --plan 4x512:256
    ;;
  3)  # the second call of the first lease: lamb beside step-cost's runs that had not run (none of lamb is timed)
    { check 150 lamb --arch-list unset; check 60 lamb --arch-list device; } &
    check 240 step-cost --timeout 80 --budget 150 --only async_ga8 inverse_ga8 inverse_10_100_ga8 exact_unspread_ga8
    wait
    ;;
  2)  # in-process runs, each stopped when the budget is spent: the JSON is written by 560 s of the check
    check 575 bert --timeout 240 --budget 550
    ;;
  *) echo "part 1, 2, 3 or all" >&2; exit 2 ;;
esac
echo "== done $(date +%T); failed: $(tr '\n' ' ' <"$FAILED")" | tee -a "$LOG"
[ ! -s "$FAILED" ]
