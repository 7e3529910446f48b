#!/usr/bin/env bash
# Benchmark of issue 18, on a machine with an NVIDIA GPU and PyTorch (the lent H100's image has
# both): GPT-2 124M (random init, seq-len 1024) training steps, autotp `run --device cuda`
# against PyTorch eager and torch.compile on the same GPU in the same run, same batch, data
# windows and optimizer (AdamW), in f32 with TF32 off, or in bf16 (PRECISION=bf16: autotp's
# --precision bf16 against torch.autocast to bfloat16, f32 masters on both sides). Prints each
# side's median step time (the first WARMUP steps excluded), tokens/s, the last loss, and the
# ratios against torch.compile.
#
#   benches/gpu_step.sh [AUTOTP_BINARY]   (default target/release/autotp, built if missing)
#   env: PYTHON (python3), STEPS (30), WARMUP (5), MICRO_BATCH (8), SEQ_LEN (1024), PRECISION (f32),
#        AUTOTP_FLAGS (extra flags of autotp compile, e.g. "--attention fused"), RUN_FLAGS (extra
#        flags of autotp run, e.g. "--cuda-graph"), TORCH (1; 0 reuses PyTorch's last runs in
#        this precision where there are some)
#
# The plan is compiled there from an export made there (the 124M export is too large to carry).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/autotp}
PY=${PYTHON:-python3}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-5}
MICRO_BATCH=${MICRO_BATCH:-8}
SEQ_LEN=${SEQ_LEN:-1024}
PRECISION=${PRECISION:-f32}
AUTOTP_FLAGS=${AUTOTP_FLAGS:-}
RUN_FLAGS=${RUN_FLAGS:-}
TORCH=${TORCH:-1}
WORK=${AUTOTP_BENCH_DIR:-/tmp/autotp-gpu-bench}
TOKENS=tests/fixtures/train/tokens.bin
mkdir -p "$WORK"
[ -x "$BIN" ] || cargo build --release -q
# cuBLAS from pip's nvidia-cublas where no toolkit provides it.
CUBLAS=$("$PY" -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH=${CUBLAS:+$CUBLAS:}${LD_LIBRARY_PATH:-}

[ -f "$WORK/gpt2-124m.onnx" ] || HF_HUB_OFFLINE=1 "$PY" benches/train_models.py export gpt2-124m "$WORK/gpt2-124m.onnx"
"$BIN" compile "$WORK/gpt2-124m.onnx" --seq-len "$SEQ_LEN" --micro-batch "$MICRO_BATCH" \
  --lr 2e-3 --betas 0.9,0.95 --eps 1e-8 --weight-decay 0.01 --precision "$PRECISION" $AUTOTP_FLAGS \
  -o "$WORK/gpt2-124m-$PRECISION.atp" > /dev/null
"$BIN" run "$WORK/gpt2-124m-$PRECISION.atp" --device cuda --data "$TOKENS" --steps "$STEPS" --log-every "$STEPS" \
  --metrics-out "$WORK/autotp.jsonl" $RUN_FLAGS > /dev/null
for mode in eager compile; do
  [ "$TORCH" = 1 ] || [ ! -f "$WORK/torch-$mode-$PRECISION.jsonl" ] || continue
  HF_HUB_OFFLINE=1 "$PY" benches/train_models.py pytorch gpt2-124m "$TOKENS" "$STEPS" "$MICRO_BATCH" \
    "$SEQ_LEN" "$(nproc)" "$WORK/torch-$mode-$PRECISION.jsonl" "$mode" cuda "$PRECISION" 2> /dev/null
done

"$PY" - "$WORK" "$WARMUP" "$MICRO_BATCH" "$SEQ_LEN" "$PRECISION" "$AUTOTP_FLAGS" <<'PY'
import json, statistics, subprocess, sys
work, warmup, g, s, precision, flags = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5], sys.argv[6]
def times(path):
    steps = [json.loads(line) for line in open(path)]
    return statistics.median(r["step_seconds"] for r in steps[warmup:]), steps[-1]["loss"]
rows = {name: times(f"{work}/{file}.jsonl") for name, file in
        (("autotp", "autotp"), ("torch eager", f"torch-eager-{precision}"), ("torch.compile", f"torch-compile-{precision}"))}
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
print(f"GPT-2 124M, {'f32 (TF32 off)' if precision == 'f32' else precision}, micro-batch {g} x seq-len {s}, {gpu}"
      + (f", autotp {flags}" if flags else ""))
print(f"{'':14} {'median ms':>10} {'tokens/s':>10} {'last loss':>10} {'/ compile':>10}")
for name, (t, loss) in rows.items():
    print(f"{name:14} {t * 1e3:10.2f} {g * s / t:10.0f} {loss:10.4f} {t / rows['torch.compile'][0]:10.2f}")
PY
