#!/usr/bin/env bash
# Benchmark: importing a GPT-2-124M-sized ONNX export (about 500 MB of weights).
# Prints wall time and peak resident memory of `autotp import` (weights memory-mapped) beside a
# baseline measured in the same run: Python's `onnx.load` of the same file (which copies).
#
#   benches/import_gpt2_124m.sh [PYTHON]     PYTHON: a venv python with torch, transformers, onnx
#                                             (default /tmp/fxvenv/bin/python; see README)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-/tmp/fxvenv/bin/python}
WORK=${AUTOTP_BENCH_DIR:-/tmp/autotp-bench}
MODEL=$WORK/gpt2-124m.onnx
RUNS=${RUNS:-3}
mkdir -p "$WORK"
if [ ! -f "$MODEL" ]; then
  echo "exporting $MODEL ..." >&2
  "$PY" benches/export_gpt2_124m.py "$MODEL"
fi
cargo build --release -q
BIN=target/release/autotp

measure() { # prints "seconds peak_kib" of the command
  /usr/bin/time -f "%e %M" -o "$WORK/time.txt" "$@" > /dev/null 2> "$WORK/stderr.txt" || { cat "$WORK/stderr.txt" >&2; exit 1; }
  cat "$WORK/time.txt"
}

size_mb=$(( $(stat -c %s "$MODEL") / 1048576 ))
printf "model: %s (%d MiB)\n\n" "$MODEL" "$size_mb"
printf "%-34s %4s %10s %14s\n" "what" "run" "seconds" "peak RSS MiB"
declare -a at_s at_m py_s py_m
for i in $(seq 1 "$RUNS"); do
  read -r s m < <(measure "$BIN" import "$MODEL" --batch 1 --seq-len 1024 -o "$WORK/out.ir")
  printf "%-34s %4d %10.2f %14.1f\n" "autotp import (mmap, fold, verify)" "$i" "$s" "$(echo "$m/1024" | bc -l)"
  at_s+=("$s"); at_m+=("$m")
  read -r s m < <(measure "$PY" -c "import onnx, sys; onnx.load(sys.argv[1])" "$MODEL")
  printf "%-34s %4d %10.2f %14.1f\n" "python onnx.load (baseline)" "$i" "$s" "$(echo "$m/1024" | bc -l)"
  py_s+=("$s"); py_m+=("$m")
done
best() { printf "%s\n" "$@" | sort -g | head -1; }
bs=$(best "${at_s[@]}"); bm=$(best "${at_m[@]}"); ps=$(best "${py_s[@]}"); pm=$(best "${py_m[@]}")
echo
printf "best of %d: autotp %.2f s, %.1f MiB peak; onnx.load %.2f s, %.1f MiB peak\n" "$RUNS" "$bs" "$(echo "$bm/1024" | bc -l)" "$ps" "$(echo "$pm/1024" | bc -l)"
printf "ratios autotp / onnx.load: time %.2f, peak memory %.2f; autotp peak / model size %.2f\n" \
  "$(echo "$bs/$ps" | bc -l)" "$(echo "$bm/$pm" | bc -l)" "$(echo "$bm/1024/$size_mb" | bc -l)"
