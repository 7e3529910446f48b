#!/usr/bin/env bash
# Benchmark: the CPU optimizer step of --offload-optimizer cpu (autotp's multi-tensor AdamW,
# benches/adamw_step.rs) against torch.optim.AdamW(fused=True) on CPU (benches/adamw_step.py),
# f32, on the same threads, in the same run. Prints milliseconds per step and the ratio (above 1:
# autotp faster).
#
#   benches/adamw_step.sh [PYTHON]   PYTHON: a venv python with torch (default /tmp/fxvenv/bin/python)
#   env: THREADS (nproc), SIZES ("16:1048576 64:1048576": tensors:elements), ROUNDS (3: both
#   sides again, alternating, since this machine's memory bandwidth varies from minute to minute)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-/tmp/fxvenv/bin/python}
THREADS=${THREADS:-$(nproc)}
SIZES=${SIZES:-"16:1048576 64:1048576"}
ROUNDS=${ROUNDS:-3}
WORK=${AUTOTP_BENCH_DIR:-/tmp/autotp-bench}
mkdir -p "$WORK"
cargo build --release -q --benches
for round in $(seq "$ROUNDS"); do
  : > "$WORK/adamw_step.jsonl"
  for size in $SIZES; do
    IFS=: read -r tensors elements <<< "$size"
    RAYON_NUM_THREADS=$THREADS cargo bench -q --bench adamw_step -- "$tensors" "$elements" >> "$WORK/adamw_step.jsonl"
  done
  echo "round $round"
  OMP_NUM_THREADS=$THREADS "$PY" benches/adamw_step.py "$WORK/adamw_step.jsonl" "$THREADS"
done
