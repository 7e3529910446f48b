#!/usr/bin/env bash
# Mixture-of-experts layouts of the Mixtral fixture (global batch 8 x 32 tokens), the experts'
# products batched (--no-moe-grouped-gemm: a gathered matrix per pair) and as grouped GEMMs (the
# default): per layout the activations' peak per rank the compile summary prints
# and the step time (median of each run's steps after the first 5). The two alternate within
# each round (batched, grouped, then grouped, batched in the next), so drift on a shared
# machine moves both; the table gives each side's median over rounds and grouped/batched's.
#
# With COMPARE=capacity the two sides are dropless (the default) and an expert capacity
# (--moe-expert-capacity-factor CAPACITY, 1 by default), both with grouped GEMMs.
#
#     benches/experts.sh [BINARY]     (default target/release/autotp)
#     env: ROUNDS (3), STEPS (40), LAYOUTS (a ;-separated list of "micro-batch flags..."),
#          COMPARE (grouped or capacity), CAPACITY (1)
set -euo pipefail
cd "$(dirname "$0")/.."
BINARY=${1:-target/release/autotp}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-40}
LAYOUTS=${LAYOUTS:-"8; 4 --dp 2; 4 --dp 2 --ep 2; 2 --dp 4 --ep 4; 2 --dp 4 --ep 2; 2 --dp 4 --ep 2 --zero 3"}
out=target/bench-experts
mkdir -p "$out"
tokens=tests/fixtures/train/tokens.bin
model=tests/fixtures/mixtral/model.onnx
case "${COMPARE:-grouped}" in
    grouped) sides=(batched grouped) ;;
    capacity) sides=(dropless capacity) ;;
    *) echo "COMPARE is grouped or capacity" >&2; exit 2 ;;
esac
side_flags() {
    case "$1" in
        batched) echo --no-moe-grouped-gemm ;;
        capacity) echo --moe-expert-capacity-factor "${CAPACITY:-1}" ;;
    esac
}

IFS=';' read -r -a layouts <<< "$LAYOUTS"
for i in "${!layouts[@]}"; do
    set -- ${layouts[$i]}
    mb=$1; shift
    for side in "${sides[@]}"; do
        "$BINARY" compile "$model" --seq-len 32 --micro-batch "$mb" "$@" $(side_flags "$side") \
            -o "$out/$i.$side.atp" > "$out/$i.$side.summary"
    done
done
for round in $(seq "$ROUNDS"); do
    order=("${sides[@]}")
    if [ $((round % 2)) -eq 0 ]; then order=("${sides[1]}" "${sides[0]}"); fi
    for i in "${!layouts[@]}"; do
        for side in "${order[@]}"; do
            "$BINARY" run "$out/$i.$side.atp" --data "$tokens" --steps "$STEPS" \
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
print("| layout | " + " | ".join(f"{s}: activations peak | {s}: ms per step" for s in sides)
      + f" | {sides[1]}/{sides[0]} step (range) |")
print("|---" * (2 + 2 * len(sides)) + "|")
for i, layout in enumerate(layouts):
    mb, *flags = layout.split()
    cells = [f"micro-batch {mb} {' '.join(flags)}".strip()]
    for s in sides:
        cells += [f"{peak(i, s):,} B", f"{statistics.median(step(i, s, r) for r in range(1, rounds + 1)):.1f}"]
    ratios = [step(i, sides[1], r) / step(i, sides[0], r) for r in range(1, rounds + 1)]
    cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    print("| " + " | ".join(cells) + " |")
EOF
