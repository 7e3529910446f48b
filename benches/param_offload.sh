#!/usr/bin/env bash
# Parameter offload (--offload-param, DeepSpeed's offload_param) under ZeRO-3 at dp 2, gathering
# one shard at a time (--prefetch-bucket-size 1): the shards in the arena, in host memory (cpu),
# and in files (nvme, every shard: --max-in-cpu 0) with B shards in memory at most
# (--buffer-count B). For each: the compiled arena per rank, the parameter bytes a rank holds in
# memory (arena and host pool; for nvme, the most shards the schedule has in memory at once),
# the bytes a step reads and writes in the file, and the step time (median over rounds; every
# configuration runs once per round, in turn, so a slow spell of the machine falls on all).
#
#     benches/param_offload.sh [STEPS] [ROUNDS] [FILES_DIR]
#
# FILES_DIR holds the parameter files (default target/bench-param-offload/files; on tmpfs the
# I/O goes through the page cache).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-40}
rounds=${2:-3}
out=target/bench-param-offload
files=${3:-$out/files}
mkdir -p "$out" "$files"
cargo build --release -q
autotp=target/release/autotp
tokens=tests/fixtures/train/tokens.bin
zero3=(--seq-len 32 --micro-batch 4 --dp 2 --zero 3 --prefetch-bucket-size 1)
modes=("arena" "cpu" "nvme 2" "nvme 8")
for model in gpt2 llama; do
    for mode in "${modes[@]}"; do
        set -- $mode
        case $1 in
            arena) flags=() ;;
            cpu) flags=(--offload-param cpu) ;;
            nvme) flags=(--offload-param nvme --nvme-path "$files" --max-in-cpu 0 --buffer-count "$2") ;;
        esac
        $autotp compile "tests/fixtures/$model/model.onnx" "${zero3[@]}" "${flags[@]}" \
            -o "$out/$model-${mode// /-}.atp" > "$out/$model-${mode// /-}.summary"
    done
done
: > "$out/times.txt"
for round in $(seq "$rounds"); do
    for model in gpt2 llama; do
        for mode in "${modes[@]}"; do
            name="$model-${mode// /-}"
            $autotp run "$out/$name.atp" --data "$tokens" --steps "$steps" --metrics-out "$out/$name.jsonl" \
                2> "$out/$name.run" > /dev/null
            ms=$(grep -o 'in [0-9.]* s: [0-9.]* ms per step' "$out/$name.run" | awk '{print $4}')
            echo "$name $ms" >> "$out/times.txt"
        done
    done
done
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
filesystem=$(df -T "$files" | awk 'NR == 2 {print $2}')
echo "CPU: $cpu, $(nproc) threads; $steps steps, $rounds rounds; files in $files ($filesystem)"
echo
echo "| model | parameters | arena per rank | parameter bytes in memory | file read/written per step | ms/step (median) |"
echo "|---|---|---|---|---|---|"
for model in gpt2 llama; do
    for mode in "${modes[@]}"; do
        name="$model-${mode// /-}"
        summary="$out/$name.summary"
        row() { grep -m1 "^  $1 " "$summary" | awk '{print $(NF-1)}' | tr -d , ; }
        arena=$(row "total arena")
        in_arena=$(row "parameters")
        in_host=$(grep -m1 "^  parameters offloaded (host pool) " "$summary" | awk '{print $(NF-1)}' | tr -d , || true)
        in_memory=$((in_arena + ${in_host:-0}))
        moved="-"
        if [ "${mode%% *}" = nvme ]; then
            line=$(grep -m1 "parameters on NVMe, rank 0" "$out/$name.run")
            peak=$(echo "$line" | sed -E 's/.*\(([0-9,]+) bytes\);.*/\1/' | tr -d ,)
            in_memory=$((in_arena + peak))
            moved=$(echo "$line" | sed -E 's/.*the steps read ([0-9,]+) and wrote ([0-9,]+) bytes per step.*\((.*)\)$/\1 \/ \2 (\3)/')
        fi
        ms=$(grep "^$name " "$out/times.txt" | awk '{print $2}' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
        printf '| %s | %s | %s | %s | %s | %s |\n' "$model" "$mode" "$arena" "$in_memory" "$moved" "$ms"
    done
done
