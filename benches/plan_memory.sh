#!/usr/bin/env bash
# `autotp plan`'s per-device peak memory against the compiler's exact plan: the planner lays out
# MODEL (benches/train_models.py's gpt2-512 by default; llama-512 has 4 key-value heads) on
# DEVICES CPU ranks (global batch 16 x 128 tokens), then every layout it finds feasible (or, with
# PP set, those of that many stages) is compiled with the flags it prints, `--report` only (no
# weights are read, nothing runs). The table gives the predicted and compiled peak and their
# ratio; the last lines the ratios' range for one-stage and pipelined layouts.
#
#   benches/plan_memory.sh [PYTHON]   PYTHON: a venv python with torch and transformers, to export
#                                     the model once (default /tmp/fxvenv/bin/python)
#   env: MODEL (gpt2-512), DEVICES (8), PP (all), AUTOTP (a binary to use instead of building)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-/tmp/fxvenv/bin/python}
MODEL=${MODEL:-gpt2-512}
DEVICES=${DEVICES:-8}
WORK=${AUTOTP_BENCH_DIR:-/tmp/autotp-bench}
mkdir -p "$WORK"
AUTOTP=${AUTOTP:-}
[ -n "$AUTOTP" ] || { cargo build --release -q; AUTOTP=target/release/autotp; }

[ -f "$WORK/$MODEL.onnx" ] || HF_HUB_OFFLINE=1 "$PY" benches/train_models.py export "$MODEL" "$WORK/$MODEL.onnx" 2> /dev/null
"$AUTOTP" plan "$WORK/$MODEL.onnx" --devices "$DEVICES" --memory-per-device 64GiB --device cpu \
  --seq-len 128 --global-batch 16 --micro-batches 1,2,4 --recompute none,full --top 1 \
  --json "$WORK/plan-memory.json" > /dev/null
python3 - "$AUTOTP" "$WORK" "${PP:-}" <<'EOF'
import json, subprocess, sys
autotp, work, pp_wanted = sys.argv[1:4]
plan = json.load(open(f"{work}/plan-memory.json"))
rows = []
for c in plan["layouts"]:
    l = c["layout"]
    if not c["compile_args"] or (pp_wanted and l["pp"] != int(pp_wanted)):
        continue
    args = [a for a in c["compile_args"] if a not in ("-o", "plan.atp")]
    subprocess.run([autotp, "compile", *args, "--report", f"{work}/plan-memory.report.json"],
                   check=True, stdout=subprocess.DEVNULL)
    report = json.load(open(f"{work}/plan-memory.report.json"))
    compiled = max(r["peak_bytes"] for r in report["ranks"])
    name = f"tp{l['tp']} pp{l['pp']} dp{l['dp']} z{l['zero']} mb{l['micro_batch']} acc{l['grad_accum']} {l['recompute']}"
    rows.append((name, l["pp"], l["zero"] == 3 and l["grad_accum"] > 1, c["prediction"]["memory"]["peak"] / 2**20,
                 compiled / 2**20))
print(f"{'layout':<40} {'predicted MiB':>14} {'compiled MiB':>13} {'ratio':>6}")
for name, _, _, p, m in rows:
    print(f"{name:<40} {p:>14.1f} {m:>13.1f} {p / m:>6.2f}")
# ZeRO 3 with accumulation apart (the planner's weakest case until the compiler scattered each
# micro-batch's gradients and gathered one copy of a parameter at a time).
groups = (("pp 1", lambda pp, z3acc: pp == 1 and not z3acc), ("pp > 1", lambda pp, z3acc: pp > 1 and not z3acc),
          ("ZeRO 3 accumulating", lambda pp, z3acc: z3acc))
for label, keep in groups:
    ratios = sorted(p / m for _, pp, z3acc, p, m in rows if keep(pp, z3acc))
    if ratios:
        within = sum(abs(r - 1) <= 0.1 for r in ratios) / len(ratios)
        print(f"{label}: predicted / compiled peak {ratios[0]:.2f} .. {ratios[-1]:.2f}, median "
              f"{ratios[len(ratios) // 2]:.2f}, {within:.0%} within 10% ({len(ratios)} layouts)")
EOF
