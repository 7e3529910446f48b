#!/usr/bin/env bash
# Benchmark: training steps of the tiny GPT-2 fixture, autotp (release build) against PyTorch CPU
# eager in the same run, same threads, same batch, same data windows and optimizer (AdamW).
# Prints each side's median and mean step time (steps after the first WARMUP excluded), tokens/s
# and the ratio autotp / PyTorch.
#
#   benches/train_gpt2.sh [PYTHON]   PYTHON: a venv python with torch and transformers
#                                    (default /tmp/fxvenv/bin/python; see tests/fixtures/README)
#   env: STEPS (default 60), WARMUP (5), MICRO_BATCH (8), SEQ_LEN (32), THREADS (nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-/tmp/fxvenv/bin/python}
STEPS=${STEPS:-60}
WARMUP=${WARMUP:-5}
MICRO_BATCH=${MICRO_BATCH:-8}
SEQ_LEN=${SEQ_LEN:-32}
THREADS=${THREADS:-$(nproc)}
WORK=${AUTOTP_BENCH_DIR:-/tmp/autotp-bench}
TOKENS=tests/fixtures/train/tokens.bin
mkdir -p "$WORK"
cargo build --release -q

RAYON_NUM_THREADS=$THREADS target/release/autotp train tests/fixtures/gpt2/model.onnx \
  --seq-len "$SEQ_LEN" --micro-batch "$MICRO_BATCH" --lr 2e-3 --betas 0.9,0.95 --eps 1e-8 --weight-decay 0.01 \
  --data "$TOKENS" --steps "$STEPS" --log-every "$STEPS" --metrics-out "$WORK/autotp.jsonl" > /dev/null 2>&1
OMP_NUM_THREADS=$THREADS HF_HUB_OFFLINE=1 "$PY" benches/train_models.py pytorch gpt2-tiny "$TOKENS" "$STEPS" \
  "$MICRO_BATCH" "$SEQ_LEN" "$THREADS" "$WORK/pytorch.jsonl" 2> /dev/null

"$PY" - "$WORK/autotp.jsonl" "$WORK/pytorch.jsonl" "$WARMUP" "$MICRO_BATCH" "$SEQ_LEN" "$THREADS" <<'PY'
import json, statistics, sys
autotp, pytorch, warmup, g, s, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
def times(path):
    steps = [json.loads(line) for line in open(path)]
    return [r["step_seconds"] for r in steps[warmup:]], steps[-1]["loss"]
rows = {name: times(path) for name, path in (("autotp", autotp), ("pytorch eager", pytorch))}
print(f"tiny GPT-2, micro-batch {g} x seq-len {s}, {threads} threads, {len(rows['autotp'][0])} timed steps")
print(f"{'':14} {'median ms':>10} {'mean ms':>10} {'tokens/s':>10} {'last loss':>10}")
for name, (t, loss) in rows.items():
    med = statistics.median(t)
    print(f"{name:14} {med * 1e3:10.2f} {statistics.mean(t) * 1e3:10.2f} {g * s / med:10.0f} {loss:10.4f}")
ratio = statistics.median(rows["autotp"][0]) / statistics.median(rows["pytorch eager"][0])
print(f"step time ratio autotp / pytorch (median): {ratio:.2f}")
PY
