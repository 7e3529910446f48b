#!/usr/bin/env bash
# Runs every fuzz target of fuzz/ (cargo fuzz, libFuzzer) for SECONDS each, in turn, and
# prints a table of the executions and coverage each reached.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]      (default 60 seconds, every target)
#
# Each target starts from its committed corpus (fuzz/corpus/TARGET) and seeds from the
# repository (the ONNX conformance models, the golden IR files, fixtures), and grows its own
# corpus in fuzz/work/TARGET (ignored by git). An input that crashes a target is written to
# fuzz/artifacts/TARGET/; add it to fuzz/regressions/TARGET/ once fixed, and `cargo test`
# runs it from then on (tests/fuzz_regressions.rs). A target with a dictionary
# (fuzz/TARGET.dict: onnx_model's op types and attribute names) is given it.
#
# Limits: an input may not make autotp hold more than 512 MiB at once (-malloc_limit_mb: a
# size read from a header is checked against the file before it is allocated) nor run longer
# than 10 s. Needs the nightly toolchain and cargo-fuzz (installed here when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(onnx_model onnx_graph ir_text plan_file safetensors checkpoint_manifest deepspeed_config token_file megatron_index)
fi
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz
rustup toolchain list | grep -q nightly || rustup toolchain install nightly --profile minimal

seed() {
  local target="$1" work="fuzz/work/$1"
  mkdir -p "$work"
  case "$target" in
    onnx_model)
      for model in tests/conformance/cases/*/model.onnx; do
        cp -n "$model" "$work/$(basename "$(dirname "$model")").onnx"
      done ;;
    ir_text) cp -n tests/golden/*.ir "$work/" ;;
    token_file) head -c 4096 tests/fixtures/train/tokens.bin > "$work/tokens-head.bin" ;;
  esac
}

(cd fuzz && cargo +nightly fuzz build -s none -O -a)
mkdir -p fuzz/work
printf '%-22s %12s %10s %10s %8s\n' target executions "exec/s" coverage crashes > fuzz/work.summary
status=0
for target in "${targets[@]}"; do
  seed "$target"
  mkdir -p "fuzz/corpus/$target" "fuzz/artifacts/$target"
  log="fuzz/work/$target.log"
  set +e
  dict=()
  [ -f "fuzz/$target.dict" ] && dict=(-dict="$target.dict")
  (cd fuzz && cargo +nightly fuzz run -s none -O -a "$target" "work/$target" "corpus/$target" -- \
    -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10 -max_len=65536 \
    -artifact_prefix="artifacts/$target/" -print_final_stats=1 "${dict[@]}") > "$log" 2>&1
  rc=$?
  set -e
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | awk '{print $2}' | tail -1 || true)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | awk '{print $2}' || true)
  crashes=$(find "fuzz/artifacts/$target" -type f | wc -l)
  rate=$(( ${runs:-0} / seconds ))
  printf '%-22s %12s %10s %10s %8s\n' "$target" "${runs:-?}" "$rate" "${cov:-?}" "$crashes" | tee -a fuzz/work.summary
  if [ "$rc" -ne 0 ] || [ "$crashes" -ne 0 ]; then
    echo "$target: libFuzzer exited $rc; see $log" >&2
    status=1
  fi
done
echo
cat fuzz/work.summary
exit $status
