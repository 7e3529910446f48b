#!/usr/bin/env bash
# Benchmark: autotp's bf16 matmul (benches/matmul_bf16.rs: AVX512-BF16 where the CPU has it)
# against PyTorch's bf16 torch.matmul (benches/matmul_bf16.py) on GPT-2 small's shapes and the
# fixtures' (`small`), same threads, same run. Prints ms per call and the ratio (above 1: autotp
# faster).
#
#   benches/matmul_bf16.sh [PYTHON]   PYTHON: a venv python with torch (default /tmp/fxvenv/bin/python)
#   env: THREADS (nproc), ROUNDS (2: both sides again, alternating)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-/tmp/fxvenv/bin/python}
THREADS=${THREADS:-$(nproc)}
ROUNDS=${ROUNDS:-2}
WORK=${AUTOTP_BENCH_DIR:-/tmp/autotp-bench}
mkdir -p "$WORK"
cargo build --release -q --benches
for round in $(seq "$ROUNDS"); do
  echo "round $round"
  for set in large small; do
    arg=$([ "$set" = small ] && echo small || true)
    RAYON_NUM_THREADS=$THREADS cargo bench -q --bench matmul_bf16 -- json $arg > "$WORK/matmul_bf16.jsonl"
    OMP_NUM_THREADS=$THREADS "$PY" benches/matmul_bf16.py "$WORK/matmul_bf16.jsonl" "$THREADS"
  done
done
