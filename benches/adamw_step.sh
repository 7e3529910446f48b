#!/usr/bin/env bash
# Benchmark: the CPU optimizer step of --offload-optimizer cpu (autotp's multi-tensor AdamW,
# benches/adamw_step.rs) against torch.optim.AdamW(fused=True) on CPU (benches/adamw_step.py),
# f32, on the same threads, in the same run. Both are bound by memory bandwidth (28 bytes per
# parameter), and this machine's varies from minute to minute, so the two sides alternate,
# layout by layout, for ROUNDS rounds, and the table compares each round's pair: the median of
# the ratios, their range and how many rounds autotp won.
#
#   benches/adamw_step.sh [PYTHON]   PYTHON: a venv python with torch (default /tmp/fxvenv/bin/python)
#   env: THREADS (nproc), LAYOUTS (all of those below, by name), ROUNDS (9)
#
# Layouts: 16x1M and 64x1M, equal tensors of 2^20 elements; gpt2-512, the 52 parameters of the
# d=512 GPT-2 of benches/train_models.py (16.9M); 2000x512, many small tensors (a step's
# per-tensor cost).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-/tmp/fxvenv/bin/python}
THREADS=${THREADS:-$(nproc)}
LAYOUTS=${LAYOUTS:-"16x1M gpt2-512 64x1M 2000x512"}
ROUNDS=${ROUNDS:-9}
WORK=${AUTOTP_BENCH_DIR:-/tmp/autotp-bench}
mkdir -p "$WORK"
RESULTS="$WORK/adamw_step.jsonl"

repeat() { local out=$2; for _ in $(seq "$1"); do out="$out,$2"; done; echo "${out#*,}"; }
gpt2_512() {
  local layer="512,512,786432,1536,262144,512,512,512,1048576,2048,1048576,512"
  echo "4194304,131072,$layer,$layer,$layer,$layer,512,512"
}
sizes_of() {
  case $1 in
    16x1M) repeat 16 1048576 ;;
    64x1M) repeat 64 1048576 ;;
    gpt2-512) gpt2_512 ;;
    2000x512) repeat 2000 512 ;;
    *) echo "unknown layout $1" >&2; exit 2 ;;
  esac
}

cargo build --release -q --benches
: > "$RESULTS"
for round in $(seq "$ROUNDS"); do
  for layout in $LAYOUTS; do
    sizes=$(sizes_of "$layout")
    RAYON_NUM_THREADS=$THREADS cargo bench -q --bench adamw_step -- "sizes=$sizes" \
      | sed "s/^{/{\"layout\": \"$layout\", /" >> "$RESULTS"
    OMP_NUM_THREADS=$THREADS "$PY" benches/adamw_step.py time "$layout" "$sizes" "$THREADS" >> "$RESULTS"
  done
  echo "round $round of $ROUNDS" >&2
done
"$PY" benches/adamw_step.py table "$RESULTS"
