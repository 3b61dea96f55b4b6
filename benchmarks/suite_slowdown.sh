#!/bin/bash
# Issue 48: how the suite's time grows on a slower machine, emulated three ways on a 2-core Linux machine (root,
# cgroup v1 cpu controller): a fresh clone of HEAD, its `make test` as is, with a busy loop pinned to each core (hogs),
# with one core's worth of CPU for the two (quota: cfs_quota_us 100000 of a 100000 period), and with two busy loops
# the scheduler places (loops: nothing pinned); then 30 AdamW steps of the BERT demo's phase 2 under each, twice,
# whose median step says how much slower each emulated machine is.
# Nothing else may run meanwhile. Usage: benchmarks/suite_slowdown.sh TAG  (results: runs/suite_slowdown/TAG/)
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd); TAG=$1; OUT=$ROOT/runs/suite_slowdown/$TAG; D=/tmp/suite_slowdown_$TAG
CG=/sys/fs/cgroup/cpu/suite_slowdown
mkdir -p "$OUT" "$CG" && rm -rf "$D" && git clone -q "$ROOT" "$D" && cd "$D" || exit 1
git log --oneline -1 > "$OUT/summary.txt"
make venv > "$OUT/venv.log" 2>&1
export TORCH_EXTENSIONS_DIR=$D/.venv/torch_extensions
hogs() { taskset -c 0 yes > /dev/null & h0=$!; taskset -c 1 yes > /dev/null & h1=$!; }
loops() { yes > /dev/null & h0=$!; yes > /dev/null & h1=$!; }
unhogs() { kill "$h0" "$h1"; wait "$h0" "$h1" 2>/dev/null; }
suite() {  # $1: the mode
  local start=$(date +%s)
  PYTEST_ADDOPTS="--durations=0" timeout 2700 make test > "$OUT/make_test_$1.log" 2>&1
  echo "$1 make test rc=$? wall=$(( $(date +%s) - start ))s $(grep -E 'passed|failed' "$OUT/make_test_$1.log" | tail -1)" >> "$OUT/summary.txt"
  sleep 3; echo "  left: shm $(ls /dev/shm | wc -l); $(pgrep -af python | cut -c1-150)" >> "$OUT/summary.txt"
}
demo() {  # $1: the mode, $2: the repeat
  local phase1; phase1=$("$ROOT/.venv/bin/python" "$ROOT/examples/bert/phase1.py" 2>/dev/null | tail -1)
  rm -rf "/tmp/suite_slowdown_demo_$1_$2"
  timeout 900 .venv/bin/deepspeed --num_gpus 2 examples/bert/pretrain.py --deepspeed_config configs/bert_cpu_phase2_base.json \
    --init-checkpoint "$phase1" --output-dir "/tmp/suite_slowdown_demo_$1_$2" --cache-dir "$ROOT/runs/bert-cache" \
    --max-steps 30 > "$OUT/demo_$1_$2.log" 2>&1
  echo "demo $1 $2 rc=$? $(python3 -c "
import csv, statistics
rows = list(csv.DictReader(open('/tmp/suite_slowdown_demo_$1_$2/bert_cpu_phase2_base/metrics.csv')))
s = [float(r['seconds']) for r in rows]; d = [b - a for a, b in zip(s, s[1:])][5:]
print(f'steps {len(rows)}, median step {statistics.median(d):.3f} s (after 6)')")" >> "$OUT/summary.txt"
}
suite none
hogs; suite hogs; unhogs
echo 100000 > "$CG/cpu.cfs_quota_us"
( echo $BASHPID > "$CG/cgroup.procs"; suite quota )
loops; suite loops; unhogs
for r in 1 2; do
  demo none $r
  hogs; demo hogs $r; unhogs
  ( echo $BASHPID > "$CG/cgroup.procs"; demo quota $r )
  loops; demo loops $r; unhogs
done
