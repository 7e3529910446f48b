#!/usr/bin/env bash
# Pipeline bubble on a model of equal layers (tests/fixtures/uniform: 8 x layer_norm(h + gelu(linear(h)))):
# each stage's measured idle time (the step's time less the time it ran its program but for
# waiting on the stage beside it) as a share of the step. "bubble" is the busiest stage's idle
# share (every other stage waits for it; their idle beyond it is imbalance: the LM head makes the
# last stage a little slower), measured against the plan for the stages' own costs and against
# the textbook (P-1)/(M+P-1) (diff is against it); "all stages" is the mean over stages. For
# 1F1B and GPipe, each with the backward sending its input's gradient when the whole backward is
# done (whole: the textbook schedules, which the formula describes) and before the weights'
# gradients (split: the default, whose bubble is shorter than the formula's).
#
#     benches/pipeline_bubble.sh [STEPS]
#
# Each rank gets cores/ranks kernel threads, pinned to its own cores (--bind-cores), so P stages
# need P cores to run side by side; the machine's core count caps P. The measured idle share is
# the median over steps. Prints one row per configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
cores=$(nproc)
cargo build --release -q
out=target/bench-pipeline
mkdir -p "$out"
python3 - "$out/tokens.bin" <<'PY'
import random, struct, sys
random.seed(0)
n = 1 << 20
open(sys.argv[1], "wb").write(struct.pack("<%dH" % n, *[random.randrange(16) for _ in range(n)]))
PY
printf "%-4s %-4s %-8s %-9s %11s %8s %14s %14s %8s %10s\n" P M schedule backward "all stages" bubble "bubble plan" "(P-1)/(M+P-1)" diff "ms/step"
for stages in 2 4; do
    if [ "$stages" -gt "$cores" ]; then
        echo "(pp $stages skipped: $cores cores)"
        continue
    fi
    for variant in "1f1b whole" "1f1b split" "gpipe whole" "gpipe split"; do
        read -r schedule backward <<< "$variant"
        for m in 4 8 16; do
            target/release/autotp compile tests/fixtures/uniform/model.onnx --seq-len 64 --micro-batch 16 \
                --grad-accum "$m" --pp "$stages" --schedule "$schedule" --pp-backward "$backward" \
                -o "$out/plan.atp" > /dev/null
            log=$(target/release/autotp run "$out/plan.atp" --data "$out/tokens.bin" \
                --steps "$steps" --log-every 1000000 --bind-cores 2>&1 > /dev/null)
            all=$(echo "$log" | awk '$1 == "all" { sub("%", "", $2); print $2 }')
            bubble=$(echo "$log" | awk '$1 == "bubble" { sub("%", "", $4); print $4 }')
            plan=$(echo "$log" | awk '$1 == "bubble" { sub("%", "", $5); print $5 }')
            formula=$(echo "$log" | awk '$1 == "bubble" { sub("%", "", $6); print $6 }')
            ms=$(echo "$log" | sed -n 's/.* s: \([0-9.]*\) ms per step.*/\1/p')
            printf "%-4s %-4s %-8s %-9s %10s%% %7s%% %13s%% %13s%% %+8.1f %10s\n" "$stages" "$m" "$schedule" "$backward" \
                "$all" "$bubble" "$plan" "$formula" "$(echo "$bubble - $formula" | bc -l)" "$ms"
        done
    done
done
