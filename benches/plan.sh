#!/usr/bin/env bash
# `autotp plan`'s ranking of layouts against their measured step times on CPU ranks, in the
# same run: the planner lays out MODEL (benches/train_models.py's gpt2-512 by default, 4 layers,
# 8 heads; llama-512 the same size with 4 key-value heads) on 4 CPU ranks (global batch 16 x 128 tokens); each of LAYOUTS (tp, pp, dp, ZeRO,
# micro-batch) is compiled with the flags the planner prints for it and trained STEPS steps.
# The table gives each layout's predicted and measured step time (median after WARMUP steps)
# and ranks, the predicted and compiled per-rank peak memory, and Spearman's rank correlation
# of the two times. The 70B and 40B plans' wall time and memory are printed too.
#
#   benches/plan.sh [PYTHON]   PYTHON: a venv python with torch and transformers, to export the
#                              model once (default /tmp/fxvenv/bin/python)
#   env: MODEL (gpt2-512), STEPS (8), WARMUP (2)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-/tmp/fxvenv/bin/python}
MODEL=${MODEL:-gpt2-512}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-2}
WORK=${AUTOTP_BENCH_DIR:-/tmp/autotp-bench}
TOKENS=tests/fixtures/train/tokens.bin
mkdir -p "$WORK"
cargo build --release -q
# tp pp dp zero micro-batch
LAYOUTS=("1 1 4 0 4" "1 1 4 3 4" "1 1 4 0 1" "2 1 2 0 4" "4 1 1 0 4" "4 1 1 0 1" "1 2 2 0 1" "1 4 1 0 1" "2 2 1 0 2")

[ -f "$WORK/$MODEL.onnx" ] || HF_HUB_OFFLINE=1 "$PY" benches/train_models.py export "$MODEL" "$WORK/$MODEL.onnx" 2> /dev/null
target/release/autotp plan "$WORK/$MODEL.onnx" --devices 4 --memory-per-device 64GiB --device cpu --seq-len 128 \
  --global-batch 16 --micro-batches 1,2,4 --recompute none --json "$WORK/plan.json" > "$WORK/plan.txt"
head -2 "$WORK/plan.txt"
for layout in "${LAYOUTS[@]}"; do
  read -r tp pp dp zero mb <<< "$layout"
  name="$MODEL-tp$tp-pp$pp-dp$dp-z$zero-mb$mb"
  # The planner's flags for this layout.
  mapfile -t flags < <(python3 - "$WORK/plan.json" "$tp" "$pp" "$dp" "$zero" "$mb" <<'EOF'
import json, sys
plan = json.load(open(sys.argv[1]))
tp, pp, dp, zero, mb = map(int, sys.argv[2:])
for c in plan["layouts"]:
    l = c["layout"]
    if (l["tp"], l["pp"], l["dp"], l["zero"], l["micro_batch"], l["recompute"]) == (tp, pp, dp, zero, mb, "none"):
        assert c["compile_args"], f"the planner refused {sys.argv[2:]}: {c['refused']}"
        print("\n".join(c["compile_args"]))
EOF
  )
  target/release/autotp compile "${flags[@]}" --lr 2e-3 --report "$WORK/plan.$name.json" -o "$WORK/plan.$name.atp" > /dev/null
  target/release/autotp run "$WORK/plan.$name.atp" --data "$TOKENS" --steps "$STEPS" --log-every "$STEPS" \
    --metrics-out "$WORK/plan.$name.jsonl" > /dev/null 2>&1
done
python3 - "$WORK" "$WARMUP" "$MODEL" "${LAYOUTS[@]}" <<'EOF'
import json, statistics, sys
work, warmup, model, layouts = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
plan = json.load(open(f"{work}/plan.json"))
rows = []
for layout in layouts:
    tp, pp, dp, zero, mb = map(int, layout.split())
    name = f"{model}-tp{tp}-pp{pp}-dp{dp}-z{zero}-mb{mb}"
    c = next(c for c in plan["layouts"] if (c["layout"]["tp"], c["layout"]["pp"], c["layout"]["dp"], c["layout"]["zero"],
             c["layout"]["micro_batch"], c["layout"]["recompute"]) == (tp, pp, dp, zero, mb, "none"))
    steps = [json.loads(l)["step_seconds"] for l in open(f"{work}/plan.{name}.jsonl")]
    report = json.load(open(f"{work}/plan.{name}.json"))
    compiled = max(r["peak_bytes"] for r in report["ranks"])
    rows.append((name, c["layout"]["grad_accum"], c["prediction"]["step_seconds"] * 1e3,
                 statistics.median(steps[warmup:]) * 1e3, c["prediction"]["memory"]["peak"] / 2**20, compiled / 2**20))

def ranks(values):
    order = sorted(range(len(values)), key=lambda i: values[i])
    r = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r

predicted, measured = ranks([r[2] for r in rows]), ranks([r[3] for r in rows])
print(f"{'layout':<31} {'acc':>4} {'predicted ms':>13} {'measured ms':>12} {'rank p':>7} {'rank m':>7} {'peak MiB p':>11} {'compiled':>9}")
for (name, acc, p, m, mp, mc), rp, rm in zip(rows, predicted, measured):
    print(f"{name:<31} {acc:>4} {p:>13.1f} {m:>12.1f} {rp:>7.1f} {rm:>7.1f} {mp:>11.1f} {mc:>9.1f}")
n = len(rows)
mp, mm = sum(predicted) / n, sum(measured) / n
cov = sum((a - mp) * (b - mm) for a, b in zip(predicted, measured))
rho = cov / (sum((a - mp) ** 2 for a in predicted) * sum((b - mm) ** 2 for b in measured)) ** 0.5
print(f"Spearman rank correlation of predicted and measured step time over {n} layouts: {rho:.2f}")
EOF
for model in "llama_70b.onnx --devices 1024 --global-batch 1024" "llama_40b.onnx --devices 64 --global-batch 256"; do
  read -r file rest <<< "$model"
  # shellcheck disable=SC2086
  /usr/bin/time -f "  wall %e s, max RSS %M KB" target/release/autotp plan "tests/fixtures/plan/$file" $rest \
    --memory-per-device 80GiB --seq-len 4096 2>&1 | sed -n '1,2p;/wall/p'
done
