#!/usr/bin/env bash
# Pipeline bubble on a model of equal layers (tests/fixtures/uniform: 8 x layer_norm(h + gelu(linear(h)))):
# each stage's measured idle time (the step's time less the time it ran its program but for
# waiting on the stage beside it) as a share of the step, averaged over stages, against the
# schedule's (P-1)/(M+P-1) ("equal stages", diff is against it), and against the schedule with
# the stages' own costs ("these stages": the LM head makes the last stage a little slower,
# and each backward sends its input's gradient before it makes the weights' gradients, which
# shortens the bubble below the formula's), for 1F1B and GPipe.
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
printf "%-4s %-4s %-8s %10s %14s %14s %10s %12s\n" P M schedule measured "these stages" "equal stages" diff "ms/step"
for stages in 2 4; do
    if [ "$stages" -gt "$cores" ]; then
        echo "(pp $stages skipped: $cores cores)"
        continue
    fi
    for schedule in 1f1b gpipe; do
        for m in 4 8 16; do
            target/release/autotp compile tests/fixtures/uniform/model.onnx --seq-len 64 --micro-batch 16 \
                --grad-accum "$m" --pp "$stages" --schedule "$schedule" -o "$out/plan.atp" > /dev/null
            log=$(target/release/autotp run "$out/plan.atp" --data "$out/tokens.bin" \
                --steps "$steps" --log-every 1000000 --bind-cores 2>&1 > /dev/null)
            measured=$(echo "$log" | awk '$1 == "all" { sub("%", "", $2); print $2 }')
            these=$(echo "$log" | awk '$1 == "all" { sub("%", "", $3); print $3 }')
            planned=$(echo "$log" | awk '$1 == "all" { sub("%", "", $4); print $4 }')
            ms=$(echo "$log" | sed -n 's/.* s: \([0-9.]*\) ms per step.*/\1/p')
            printf "%-4s %-4s %-8s %9s%% %13s%% %13s%% %+9.1f %12s\n" "$stages" "$m" "$schedule" "$measured" "$these" "$planned" \
                "$(echo "$measured - $planned" | bc -l)" "$ms"
        done
    done
done
