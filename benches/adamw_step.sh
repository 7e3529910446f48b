#!/usr/bin/env bash
# Benchmark: the CPU optimizer step of --offload-optimizer cpu (autotp's multi-tensor AdamW,
# benches/adamw_step.rs) against torch.optim.AdamW(fused=True) on CPU (benches/adamw_step.py),
# f32, on the same threads, in the same run. Both are bound by memory bandwidth (28 bytes per
# parameter), and this machine's varies from minute to minute, so the two sides alternate,
# size by size, for ROUNDS rounds, and the table compares each round's pair: the median of
# the ratios, their range and how many rounds autotp won.
#
#   benches/adamw_step.sh [PYTHON]   PYTHON: a venv python with torch (default /tmp/fxvenv/bin/python)
#   env: THREADS (nproc), SIZES ("16:1048576 64:1048576": tensors:elements), ROUNDS (9)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-/tmp/fxvenv/bin/python}
THREADS=${THREADS:-$(nproc)}
SIZES=${SIZES:-"16:1048576 64:1048576"}
ROUNDS=${ROUNDS:-9}
WORK=${AUTOTP_BENCH_DIR:-/tmp/autotp-bench}
mkdir -p "$WORK"
RESULTS="$WORK/adamw_step.jsonl"
cargo build --release -q --benches
: > "$RESULTS"
for round in $(seq "$ROUNDS"); do
  for size in $SIZES; do
    IFS=: read -r tensors elements <<< "$size"
    RAYON_NUM_THREADS=$THREADS cargo bench -q --bench adamw_step -- "$tensors" "$elements" >> "$RESULTS"
    OMP_NUM_THREADS=$THREADS "$PY" benches/adamw_step.py time "$tensors" "$elements" "$THREADS" >> "$RESULTS"
  done
  echo "round $round of $ROUNDS" >&2
done
"$PY" benches/adamw_step.py table "$RESULTS"
