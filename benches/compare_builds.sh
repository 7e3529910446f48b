#!/usr/bin/env bash
# Benchmark: two builds of autotp against each other, for a refactoring that must not slow
# anything: training step time on benches/train_models.sh's five models, and `autotp compile`
# of GPT-2 124M (shapes-only, then with its weights written to a plan). The builds alternate
# within each round (OLD, NEW, then NEW, OLD in the next), so drift on this shared machine
# moves both; the table gives each side's median over rounds and the NEW/OLD ratio's median and
# range. Prints the CPU it ran on.
#
#   benches/compare_builds.sh OLD_BINARY NEW_BINARY [PYTHON]
#       PYTHON: a venv python with torch and transformers, to export the models once
#       (default /tmp/fxvenv/bin/python; see the README's fixtures section)
#   env: ROUNDS (4), STEPS (20), WARMUP (5), THREADS (nproc), MODELS (all five)
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=$1 NEW=$2 PY=${3:-/tmp/fxvenv/bin/python}
ROUNDS=${ROUNDS:-4}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-5}
THREADS=${THREADS:-$(nproc)}
MODELS=${MODELS:-"gpt2-tiny:8:32 llama-tiny:8:32 gpt2-wide:8:32 gpt2-512:8:128 llama-512:8:128"}
WORK=${AUTOTP_BENCH_DIR:-/tmp/autotp-bench}
TOKENS=tests/fixtures/train/tokens.bin
mkdir -p "$WORK"
for spec in $MODELS; do
  name=${spec%%:*}
  [ -f "$WORK/$name.onnx" ] || HF_HUB_OFFLINE=1 "$PY" benches/train_models.py export "$name" "$WORK/$name.onnx" 2> /dev/null
done
[ -f "$WORK/gpt2-124m.onnx" ] || "$PY" benches/export_gpt2_124m.py "$WORK/gpt2-124m.onnx" 2> /dev/null

train() { # side binary name g s round
  RAYON_NUM_THREADS=$THREADS "$2" train "$WORK/$3.onnx" --seq-len "$5" --micro-batch "$4" --lr 2e-3 \
    --betas 0.9,0.95 --eps 1e-8 --weight-decay 0.01 --data "$TOKENS" --steps "$STEPS" --log-every "$STEPS" \
    --metrics-out "$WORK/$3.$1.$6.jsonl" -o /dev/null > /dev/null 2>&1
}
compile() { # side binary round
  local start end
  start=$(date +%s.%N)
  "$2" compile "$WORK/gpt2-124m.onnx" --seq-len 1024 --micro-batch 8 --report "$WORK/report.$1.json" > /dev/null
  end=$(date +%s.%N)
  echo "$end - $start" | bc > "$WORK/compile-report.$1.$3.txt"
  start=$(date +%s.%N)
  "$2" compile "$WORK/gpt2-124m.onnx" --seq-len 1024 --micro-batch 8 -o "$WORK/gpt2-124m.$1.atp" > /dev/null
  end=$(date +%s.%N)
  echo "$end - $start" | bc > "$WORK/compile-plan.$1.$3.txt"
}
for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    bin=$OLD; [ "$side" = new ] && bin=$NEW
    compile "$side" "$bin" "$round"
    for spec in $MODELS; do
      IFS=: read -r name g s <<< "$spec"
      train "$side" "$bin" "$name" "$g" "$s" "$round"
    done
  done
done
cmp -s "$WORK/gpt2-124m.old.atp" "$WORK/gpt2-124m.new.atp" && same=yes || same=no

"$PY" - "$WORK" "$ROUNDS" "$WARMUP" "$THREADS" "$MODELS" "$same" <<'PY'
import json, statistics, sys
work, rounds, warmup, threads, models, same = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5].split(), sys.argv[6]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
flags = next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "")
isa = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "SSE"
def step(path):
    steps = [json.loads(line) for line in open(path)]
    return statistics.median(r["step_seconds"] for r in steps[warmup:]), steps[-1]["loss"]
def row(what, old, new, unit=1e3, fmt="{:10.2f}"):
    ratios = [n / o for o, n in zip(old, new)]
    print(f"{what:<26} {fmt.format(statistics.median(old) * unit)} {fmt.format(statistics.median(new) * unit)} "
          f"{statistics.median(ratios):6.3f} {min(ratios):6.3f}-{max(ratios):<6.3f}")
print(f"{cpu} ({isa}), {threads} threads, {rounds} rounds alternating old/new")
print(f"{'':<26} {'old':>10} {'new':>10} {'new/old':>6} {'range':>13}")
for kind, label in [("report", "compile 124M shapes (s)"), ("plan", "compile 124M -o (s)")]:
    old = [float(open(f"{work}/compile-{kind}.old.{r}.txt").read()) for r in range(1, rounds + 1)]
    new = [float(open(f"{work}/compile-{kind}.new.{r}.txt").read()) for r in range(1, rounds + 1)]
    row(label, old, new, unit=1)
for spec in models:
    name, g, s = spec.split(":")
    old = [step(f"{work}/{name}.old.{r}.jsonl") for r in range(1, rounds + 1)]
    new = [step(f"{work}/{name}.new.{r}.jsonl") for r in range(1, rounds + 1)]
    assert old[-1][1] == new[-1][1], f"{name}: the builds' losses differ: {old[-1][1]} {new[-1][1]}"
    row(f"{name} {g}x{s} step (ms)", [o[0] for o in old], [n[0] for n in new])
print(f"GPT-2 124M plans byte-identical: {same}; every model's last loss equal on both builds")
PY
