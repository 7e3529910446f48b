#!/usr/bin/env bash
# Benchmark: every matmul shape of the issue-15 models' training steps, as the step calls it,
# autotp's GEMM (benches/matmul_shapes.rs) against torch.matmul (benches/matmul_shapes.py) on
# the same shapes, transposes and threads, in the same run. Prints GFLOP/s per shape and, per
# model, the time of all of one step's matmuls and the speed ratio (above 1: autotp faster).
#
#   benches/matmul_shapes.sh [PYTHON]   PYTHON: a venv python with torch and transformers
#                                       (default /tmp/fxvenv/bin/python; see tests/fixtures)
#   env: THREADS (nproc), MODELS (all, as in train_models.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-/tmp/fxvenv/bin/python}
THREADS=${THREADS:-$(nproc)}
MODELS=${MODELS:-"gpt2-tiny:8:32 llama-tiny:8:32 gpt2-wide:8:32 gpt2-512:8:128 llama-512:8:128"}
WORK=${AUTOTP_BENCH_DIR:-/tmp/autotp-bench}
mkdir -p "$WORK"
cargo build --release -q
plans=()
for spec in $MODELS; do
  IFS=: read -r name g s <<< "$spec"
  [ -f "$WORK/$name.onnx" ] || HF_HUB_OFFLINE=1 "$PY" benches/train_models.py export "$name" "$WORK/$name.onnx" 2> /dev/null
  target/release/autotp compile "$WORK/$name.onnx" --seq-len "$s" --micro-batch "$g" -o "$WORK/$name.atp" > /dev/null
  plans+=("$name" "$WORK/$name.atp")
done
RAYON_NUM_THREADS=$THREADS cargo bench -q --bench matmul_shapes -- "${plans[@]}" > "$WORK/matmul_shapes.jsonl"
OMP_NUM_THREADS=$THREADS "$PY" benches/matmul_shapes.py "$WORK/matmul_shapes.jsonl" "$THREADS"
