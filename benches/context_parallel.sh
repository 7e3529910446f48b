#!/usr/bin/env bash
# Context parallelism's load balance (Megatron's 2 x cp chunks, rank r holding chunks r and
# 2cp-1-r) against contiguous blocks (--cp-contiguous), with the keys and values all-gathered or
# passed around a ring (--cp-comm-type p2p), on the Llama fixture with sequences long
# enough that causal attention makes most of a step: 2 sequences of SEQ tokens a step (micro-batch
# 1, --grad-accum 2), one rank (cp 1) beside them. Each rank gets cores/ranks kernel threads
# pinned to its own cores (--bind-cores), so cp 2 needs 2 cores to run its ranks side by side
# (with fewer, the ranks take turns and the balance shows less). A run's figure is its median
# step after 2 warm-up steps; every configuration runs once per round, round-robin, so a slow
# spell of the machine falls on all of them. The summary's query-key pairs per rank show the
# work each layout gives its ranks, and the activation peak what a rank holds.
#
#     benches/context_parallel.sh [SEQ] [STEPS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seq_len=${1:-2048}
steps=${2:-12}
rounds=${3:-2}
cargo build --release -q
autotp=target/release/autotp
out=target/bench-context-parallel
mkdir -p "$out"
model=tests/fixtures/llama/model.onnx
configs=("1" "2" "2 --cp-contiguous" "2 --cp-comm-type p2p" "2 --cp-comm-type p2p --cp-contiguous")
for config in "${configs[@]}"; do
    name=$(echo "cp $config" | tr -d ' -')
    # shellcheck disable=SC2086
    "$autotp" compile "$model" --seq-len "$seq_len" --micro-batch 1 --grad-accum 2 --cp $config \
        -o "$out/$name.atp" > "$out/$name.summary" 2>&1
done
median() {
    python3 - "$1" <<'PY'
import json, sys
s = sorted(json.loads(l)["step_seconds"] for l in open(sys.argv[1]))[2:]
print(f"{s[len(s) // 2] * 1e3:.1f}")
PY
}
declare -A times
for round in $(seq "$rounds"); do
    for config in "${configs[@]}"; do
        name=$(echo "cp $config" | tr -d ' -')
        "$autotp" run "$out/$name.atp" --data tests/fixtures/train/tokens.bin --steps "$steps" --bind-cores \
            --metrics-out "$out/$name.jsonl" > /dev/null 2>&1
        times[$name]="${times[$name]:-}$(median "$out/$name.jsonl") "
    done
done
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
echo "Llama fixture, 2 x $seq_len tokens a step, $(nproc) cores ($cpu), $rounds rounds, ms per step (median of $steps steps):"
echo
echo "| layout | ms per step, by round | causal query-key pairs per rank (per sequence and head) | activation peak per rank |"
echo "|---|---|---|---|"
for config in "${configs[@]}"; do
    name=$(echo "cp $config" | tr -d ' -')
    pairs=$(grep -o 'pairs per rank per sequence and head: .*' "$out/$name.summary" | sed 's/.*head: //' || true)
    peak=$(grep -o 'activations peak (with gradients) *[0-9,]*' "$out/$name.summary" | head -1 | sed 's/.* //' || true)
    echo "| cp $config | ${times[$name]}| ${pairs:-all of them} | ${peak:-?} |"
done
