#!/usr/bin/env bash
# Pipeline bubble on a model of equal layers (tests/fixtures/uniform: 8 x layer_norm(h + gelu(linear(h)))):
# each stage's measured idle time (the step's time less the time it ran its program but for
# waiting on the stage beside it) as a share of the step. "bubble" is the busiest stage's idle
# share (every other stage waits for it; their idle beyond it is imbalance: the LM head makes the
# last stage a little slower), measured against the plan for the stages' own costs and against
# the textbook (P-1)/(V*M+P-1) (diff is against it); "all stages" is the mean over stages. For
# 1F1B and GPipe, each with the backward sending its input's gradient when the whole backward is
# done (whole: the default, the textbook schedules the formula describes) and before the weights'
# gradients (split, whose bubble is shorter than the formula's); Megatron's interleaved 1F1B
# with V = 2 model chunks per stage (--virtual-stages 2), whose formula is (P-1)/(2M+P-1); and
# zero-bubble ZB-H1 (its bubble (P-1)(F+B-W), below the formula's for 1F1B).
#
#     benches/pipeline_bubble.sh [STEPS] [ROUNDS]
#
# Each rank gets cores/ranks kernel threads, pinned to its own cores (--bind-cores), so P stages
# need P cores to run side by side. Where the machine has fewer cores than stages, the stages
# are timed by the cpu clock (`run --clock cpu`: each stage by its own thread's CPU time, a
# message arriving when its sender's clock said it was sent), which gives the idle shares of
# stages with a core each; P=2 runs 1F1B whole under both clocks to compare them. Every
# cpu-clock run is confined to one core (taskset): its stages then take turns rather than run two
# at a time in whatever pairs the scheduler makes, slowing each other through the shared cache
# and memory in patterns set by the scheduler, not by the pipeline's schedule (on 2 cores,
# P=4 M=4's per-stage idle shares wandered over 39.6-47.8% between runs; on one, 41.0-44.3%,
# the plan saying 42.2-43.9%). A run's measured idle share is the median over its steps. Every
# configuration runs once per round, round-robin, so a slow spell of the machine falls on all of
# them; the table gives the median over rounds and the range of the bubble's.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
rounds=${2:-3}
cores=$(nproc)
one_core=$(python3 -c 'import os; print(min(os.sched_getaffinity(0)))')
cargo build --release -q
out=target/bench-pipeline
mkdir -p "$out"
python3 - "$out/tokens.bin" <<'PY'
import random, struct, sys
random.seed(0)
n = 1 << 20
open(sys.argv[1], "wb").write(struct.pack("<%dH" % n, *[random.randrange(16) for _ in range(n)]))
PY
configs=()
for stages in 2 4; do
    clock=wall
    if [ "$stages" -gt "$cores" ]; then
        clock=cpu
    fi
    for variant in "1f1b whole 1" "1f1b split 1" "gpipe whole 1" "gpipe split 1" "1f1b whole 2" "zb-h1 split 1"; do
        for m in 4 8 16; do
            configs+=("$stages $m $variant $clock")
            if [ "$clock" = wall ] && [ "$variant" = "1f1b whole 1" ] && [ "$stages" -le 2 ]; then
                configs+=("$stages $m $variant cpu")
            fi
        done
    done
done
results="$out/results.txt"
: > "$results"
for round in $(seq "$rounds"); do
    for config in "${configs[@]}"; do
        read -r stages m schedule backward virtual clock <<< "$config"
        plan="$out/pp$stages-v$virtual-m$m-$schedule-$backward.atp"
        if [ "$round" = 1 ]; then
            target/release/autotp compile tests/fixtures/uniform/model.onnx --seq-len 64 --micro-batch 16 \
                --grad-accum "$m" --pp "$stages" --virtual-stages "$virtual" --schedule "$schedule" --pp-backward "$backward" \
                -o "$plan" > /dev/null
        fi
        confine=()
        if [ "$clock" = cpu ]; then
            confine=(taskset -c "$one_core")
        fi
        log=$("${confine[@]}" target/release/autotp run "$plan" --data "$out/tokens.bin" \
            --steps "$steps" --log-every 1000000 --bind-cores --clock "$clock" 2>&1 > /dev/null)
        all=$(echo "$log" | awk '$1 == "all" { sub("%", "", $2); print $2 }')
        bubble=$(echo "$log" | awk '$1 == "bubble" { sub("%", "", $4); sub("%", "", $5); sub("%", "", $6); print $4, $5, $6 }')
        ms=$(echo "$log" | sed -n 's/.* s: \([0-9.]*\) ms per step.*/\1/p')
        echo "$config $all $bubble $ms" >> "$results"
    done
    echo "(round $round of $rounds done)" >&2
done
python3 - "$results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    p, m, schedule, backward, v, clock, all_, bubble, plan, formula, ms = line.split()
    rows.setdefault((p, m, schedule, backward, v, clock), []).append(
        (float(all_), float(bubble), float(plan), float(formula), float(ms)))
print(f"{'P':<3} {'M':<3} {'schedule':<8} {'backward':<8} {'V':<2} {'clock':<5} {'all stages':>10} {'bubble':>7} "
      f"{'bubble range':>13} {'bubble plan':>11} {'(P-1)/(VM+P-1)':>14} {'diff':>6} {'ms/step':>8}")
for (p, m, schedule, backward, v, clock), runs in rows.items():
    median = lambda i: statistics.median(r[i] for r in runs)
    low, high = min(r[1] for r in runs), max(r[1] for r in runs)
    print(f"{p:<3} {m:<3} {schedule:<8} {backward:<8} {v:<2} {clock:<5} {median(0):>9.1f}% {median(1):>6.1f}% "
          f"{f'{low:.1f}..{high:.1f}%':>13} {median(2):>10.1f}% {median(3):>13.1f}% {median(1) - median(3):>+6.1f} "
          f"{median(4):>8.1f}")
print("(ms/step is wall time; under the cpu clock the stages share one core)")
PY
