#!/usr/bin/env bash
# Benchmark: training step time of autotp (release build, generated kernels) against PyTorch CPU
# eager in the same run, on the five models of issue 15 (benches/train_models.py builds them;
# the exports go to $WORK, not the repository), same threads, batch, data windows and AdamW.
# Two mixtures of experts are there to name in MODELS: mixtral-tiny (the fixture) and
# mixtral-256 (PyTorch's side runs Hugging Face's grouped-GEMM experts).
# Each round runs every model on both sides in turn; the table gives each side's median step
# time over rounds (each run's median after WARMUP steps) and the ratio's median and range, so a
# noisy moment on this shared machine moves one round, not the result.
#
#   benches/train_models.sh [PYTHON]   PYTHON: a venv python with torch and transformers
#                                      (default /tmp/fxvenv/bin/python; see tests/fixtures)
#   env: ROUNDS (3), STEPS (20), WARMUP (5), THREADS (nproc), MODELS (all), KERNELS (generated),
#        MODE (eager, or compile: PyTorch's side under torch.compile; give it WARMUP=8),
#        AUTOTP_FLAGS (extra flags of autotp train, e.g. "--attention fused")
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-/tmp/fxvenv/bin/python}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-5}
THREADS=${THREADS:-$(nproc)}
KERNELS=${KERNELS:-generated}
MODE=${MODE:-eager}
AUTOTP_FLAGS=${AUTOTP_FLAGS:-}
MODELS=${MODELS:-"gpt2-tiny:8:32 llama-tiny:8:32 gpt2-wide:8:32 gpt2-512:8:128 llama-512:8:128"}
WORK=${AUTOTP_BENCH_DIR:-/tmp/autotp-bench}
TOKENS=tests/fixtures/train/tokens.bin
mkdir -p "$WORK"
cargo build --release -q

for spec in $MODELS; do
  name=${spec%%:*}
  [ -f "$WORK/$name.onnx" ] || HF_HUB_OFFLINE=1 "$PY" benches/train_models.py export "$name" "$WORK/$name.onnx" 2> /dev/null
done
for round in $(seq 1 "$ROUNDS"); do
  for spec in $MODELS; do
    IFS=: read -r name g s <<< "$spec"
    RAYON_NUM_THREADS=$THREADS target/release/autotp train "$WORK/$name.onnx" --kernels "$KERNELS" $AUTOTP_FLAGS \
      --seq-len "$s" --micro-batch "$g" --lr 2e-3 --betas 0.9,0.95 --eps 1e-8 --weight-decay 0.01 \
      --data "$TOKENS" --steps "$STEPS" --log-every "$STEPS" --metrics-out "$WORK/$name.autotp.$round.jsonl" \
      -o /dev/null > /dev/null 2>&1
    OMP_NUM_THREADS=$THREADS HF_HUB_OFFLINE=1 "$PY" benches/train_models.py pytorch "$name" "$TOKENS" "$STEPS" \
      "$g" "$s" "$THREADS" "$WORK/$name.pytorch.$round.jsonl" "$MODE" 2> /dev/null
  done
done

"$PY" - "$WORK" "$ROUNDS" "$WARMUP" "$THREADS" "$MODELS" "$MODE" <<'PY'
import json, statistics, sys
work, rounds, warmup, threads, models = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5].split()
def run(path):
    steps = [json.loads(line) for line in open(path)]
    return statistics.median(r["step_seconds"] for r in steps[warmup:]), steps[-1]["loss"]
print(f"{threads} threads, {rounds} rounds, PyTorch {sys.argv[6]}; ms per step: median over rounds of each run's median")
print(f"{'model':<12} {'batch':>7} {'autotp ms':>10} {'pytorch ms':>11} {'ratio':>6} {'range':>12} {'loss a/p':>16}")
for spec in models:
    name, g, s = spec.split(":")
    a = [run(f"{work}/{name}.autotp.{r}.jsonl") for r in range(1, rounds + 1)]
    p = [run(f"{work}/{name}.pytorch.{r}.jsonl") for r in range(1, rounds + 1)]
    ratios = [x[0] / y[0] for x, y in zip(a, p)]
    print(f"{name:<12} {g + 'x' + s:>7} {statistics.median(x[0] for x in a) * 1e3:10.2f} "
          f"{statistics.median(y[0] for y in p) * 1e3:11.2f} {statistics.median(ratios):6.2f} "
          f"{min(ratios):5.2f}-{max(ratios):<5.2f} {a[-1][1]:7.4f}/{p[-1][1]:<7.4f}")
PY
