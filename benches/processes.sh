#!/usr/bin/env bash
# Ranks as processes over MPI against ranks as threads of one process, in the same run:
#
# 1. `autotp bench-comm`: each collective's time and bandwidth for 4 MiB and 64 MiB buffers per
#    rank, 2 ranks, on the in-process backend (threads) and on the MPI backend (processes
#    under mpirun), the latter beside plain MPI_Allreduce on the same buffers in alternating
#    rounds (the backend's cost over raw MPI), and the overlap of an all-reduce on a
#    communication thread with matmuls.
# 2. A training step of the d=512 GPT-2 (benches/train_models.py's gpt2-512, micro-batch 4 x
#    128 tokens) under tp 2 x dp 2, ZeRO 3, as 4 processes (`run --launch 4`) and as 4 threads,
#    ROUNDS rounds alternating the two; the table gives each side's median over rounds of its
#    median step time after WARMUP steps.
#
#   benches/processes.sh [PYTHON]   PYTHON: a venv python with torch and transformers, to export
#                                   the model once (default /tmp/fxvenv/bin/python)
#   env: ROUNDS (3), STEPS (12), WARMUP (3), ITERS (30)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-/tmp/fxvenv/bin/python}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-12}
WARMUP=${WARMUP:-3}
ITERS=${ITERS:-30}
WORK=${AUTOTP_BENCH_DIR:-/tmp/autotp-bench}
TOKENS=tests/fixtures/train/tokens.bin
mkdir -p "$WORK"
cargo build --release -q
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

echo "== collectives, 2 ranks as threads"
target/release/autotp bench-comm --ranks 2 --sizes 4,64 --iters "$ITERS"
echo "== collectives, 2 ranks as processes (mpirun)"
mpirun -n 2 target/release/autotp bench-comm --sizes 4,64 --iters "$ITERS"

[ -f "$WORK/gpt2-512.onnx" ] || HF_HUB_OFFLINE=1 "$PY" benches/train_models.py export gpt2-512 "$WORK/gpt2-512.onnx" 2> /dev/null
plan=$WORK/gpt2-512-tp2-dp2-zero3.atp
target/release/autotp compile "$WORK/gpt2-512.onnx" --seq-len 128 --micro-batch 4 --lr 2e-3 --betas 0.9,0.95 \
  --eps 1e-8 --weight-decay 0.01 --tp 2 --dp 2 --zero 3 -o "$plan" > /dev/null 2>&1
for round in $(seq 1 "$ROUNDS"); do
  target/release/autotp run "$plan" --data "$TOKENS" --steps "$STEPS" --log-every "$STEPS" \
    --metrics-out "$WORK/processes.threads.$round.jsonl" > /dev/null 2>&1
  target/release/autotp run "$plan" --data "$TOKENS" --steps "$STEPS" --log-every "$STEPS" --launch 4 \
    --metrics-out "$WORK/processes.mpi.$round.jsonl" > /dev/null 2>&1
done
python3 - "$WORK" "$ROUNDS" "$WARMUP" <<'EOF'
import json, statistics, sys
work, rounds, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def run(side, r):
    rows = [json.loads(l) for l in open(f"{work}/processes.{side}.{r}.jsonl")]
    return statistics.median(x["step_seconds"] for x in rows[warmup:]) * 1e3, [x["loss"] for x in rows]
threads = [run("threads", r) for r in range(1, rounds + 1)]
mpi = [run("mpi", r) for r in range(1, rounds + 1)]
assert all(t[1] == m[1] for t, m in zip(threads, mpi)), "the losses differ between threads and processes"
t = statistics.median(x[0] for x in threads)
m = statistics.median(x[0] for x in mpi)
ratios = sorted(b[0] / a[0] for a, b in zip(threads, mpi))
print("== gpt2-512, tp 2 x dp 2, ZeRO 3, micro-batch 4 x 128: median step time (ms)")
print(f"{'4 threads':>12} {'4 processes':>12} {'processes/threads':>18} {'range':>14}")
print(f"{t:>12.1f} {m:>12.1f} {m / t:>18.2f} {ratios[0]:>6.2f}-{ratios[-1]:<6.2f}")
print("losses: identical in every round")
EOF
