#!/usr/bin/env bash
# Mixture-of-experts layouts of the Mixtral fixture (global batch 8 x 32 tokens), one build or
# two builds side by side: per layout the activations' peak per rank the compile summary
# prints and the step time (median of each run's steps after the first 5). With two builds
# they alternate within each round (OLD, NEW, then NEW, OLD in the next), so drift on a shared
# machine moves both; the table gives each side's median over rounds and NEW/OLD's median.
#
#     benches/experts.sh NEW_BINARY [OLD_BINARY]
#     env: ROUNDS (3), STEPS (40), LAYOUTS (a ;-separated list of "micro-batch flags...")
set -euo pipefail
cd "$(dirname "$0")/.."
NEW=$1 OLD=${2:-}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-40}
LAYOUTS=${LAYOUTS:-"8; 4 --dp 2; 4 --dp 2 --ep 2; 2 --dp 4 --ep 4; 2 --dp 4 --ep 2; 2 --dp 4 --ep 2 --zero 3"}
out=target/bench-experts
mkdir -p "$out"
tokens=tests/fixtures/train/tokens.bin
model=tests/fixtures/mixtral/model.onnx
sides=(new)
[ -n "$OLD" ] && sides=(old new)
binary() { if [ "$1" = new ]; then echo "$NEW"; else echo "$OLD"; fi; }

IFS=';' read -r -a layouts <<< "$LAYOUTS"
for i in "${!layouts[@]}"; do
    set -- ${layouts[$i]}
    mb=$1; shift
    for side in "${sides[@]}"; do
        "$(binary "$side")" compile "$model" --seq-len 32 --micro-batch "$mb" "$@" -o "$out/$i.$side.atp" \
            > "$out/$i.$side.summary"
    done
done
for round in $(seq "$ROUNDS"); do
    order=("${sides[@]}")
    if [ $((round % 2)) -eq 0 ] && [ ${#sides[@]} -eq 2 ]; then order=(new old); fi
    for i in "${!layouts[@]}"; do
        for side in "${order[@]}"; do
            "$(binary "$side")" run "$out/$i.$side.atp" --data "$tokens" --steps "$STEPS" \
                --metrics-out "$out/$i.$side.$round.jsonl" > /dev/null 2>&1
        done
    done
done
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
isa=AVX2
grep -q avx512f /proc/cpuinfo && isa=AVX-512F
grep -q avx512_bf16 /proc/cpuinfo && isa="$isa with AVX512-BF16"
echo "$cpu ($isa), $(nproc) cores; $ROUNDS rounds of $STEPS steps"
python3 - "$out" "$ROUNDS" "$LAYOUTS" "${sides[@]}" <<'EOF'
import json, re, statistics, sys
out, rounds, layouts, sides = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(";"), sys.argv[4:]
def peak(i, side):
    text = open(f"{out}/{i}.{side}.summary").read()
    return int(re.search(r"activations peak \(with gradients\)\s+([\d,]+)", text).group(1).replace(",", ""))
def step(i, side, r):
    steps = [json.loads(l) for l in open(f"{out}/{i}.{side}.{r}.jsonl") if '"step_seconds"' in l]
    return statistics.median(s["step_seconds"] for s in steps[5:]) * 1e3
head = "| layout | " + " | ".join(f"{s}: activations peak | {s}: ms per step" for s in sides)
if len(sides) == 2:
    head += " | new/old step (range) |"
print(head)
print("|---" * (1 + 2 * len(sides) + (len(sides) == 2)) + "|")
for i, layout in enumerate(layouts):
    mb, *flags = layout.split()
    cells = [f"micro-batch {mb} {' '.join(flags)}".strip()]
    for s in sides:
        cells += [f"{peak(i, s):,} B", f"{statistics.median(step(i, s, r) for r in range(1, rounds + 1)):.1f}"]
    if len(sides) == 2:
        ratios = [step(i, "new", r) / step(i, "old", r) for r in range(1, rounds + 1)]
        cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    print("| " + " | ".join(cells) + " |")
EOF
