#!/usr/bin/env bash
# Compiles every fixture model under a set of layouts with two autotp binaries and compares the
# plan files byte for byte: a refactoring of the compiler must leave every plan as it was (or say
# in its commit why one differs). Prints one line per plan and exits non-zero on a difference.
#
#   scripts/compare-plans.sh OLD_BINARY NEW_BINARY [SCRATCH_DIR]
#
# With IGNORE=key,key (keys anywhere inside a stage's program, such as gpu_kernels,ptx,gpu), two
# plans that differ only there (and in the fingerprint, which covers them) count as the same, and
# the line says so; this comparison reads the files with python3.
set -euo pipefail
cd "$(dirname "$0")/.."
old=$1 new=$2 dir=${3:-target/compare-plans}
rm -rf "$dir" && mkdir -p "$dir"
layouts=(
  ""
  "--tp 2"
  "--dp 2 --zero 3"
  "--dp 2 --zero 1 --grad-accum 2"
  "--pp 2 --grad-accum 2"
  "--precision bf16"
  "--precision fp16 --dp 2 --zero 2"
  "--recompute selective"
  "--offload-optimizer cpu --dp 2 --zero 2"
  "--tp 2 --dp 2 --zero 3 --kernels builtin"
  "--recompute full --precision bf16 --grad-clip 1.0"
  "--recompute auto --memory-cap 4MiB"
  "--kernels builtin --recompute selective --optimizer sgd --momentum 0.9"
  "--pp 2 --tp 2 --grad-accum 4 --schedule gpipe --lr-schedule cosine --warmup-steps 3"
  "--precision bf16 --offload-optimizer cpu --dp 2 --zero 2 --grad-accum 2"
)
# Whether plan files $2 and $3 are equal once the program keys in $1 (comma-separated) and the
# fingerprint are dropped: the same tensors, the same plan otherwise.
same_but() {
  python3 - "$@" <<'PY'
import json, struct, sys
keys = sys.argv[1].split(",")
def read(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__")
    meta.pop("autotp.fingerprint", None)
    plan = json.loads(meta.pop("autotp.plan"))
    def drop(value):
        if isinstance(value, dict):
            return {k: drop(v) for k, v in value.items() if k not in keys}
        if isinstance(value, list):
            return [drop(v) for v in value]
        return value
    plan["plan"]["stages"] = drop(plan["plan"]["stages"])
    return header, meta, plan, data[8 + n:]
sys.exit(0 if read(sys.argv[2]) == read(sys.argv[3]) else 1)
PY
}
differ=0 same=0
for model in tests/fixtures/*/model.onnx; do
  arch=$(basename "$(dirname "$model")")
  for l in "${!layouts[@]}"; do
    layout=${layouts[$l]}
    args=(compile "$model" --seq-len 32 --micro-batch 4 --lr 2e-3 $layout)
    out_old=$("$old" "${args[@]}" -o "$dir/$arch-$l.old.atp" 2>&1) && ok_old=1 || ok_old=0
    out_new=$("$new" "${args[@]}" -o "$dir/$arch-$l.new.atp" 2>&1) && ok_new=1 || ok_new=0
    if [ $ok_old != $ok_new ]; then
      echo "DIFFER  $arch [$layout]: old exit ok=$ok_old, new ok=$ok_new"; differ=$((differ + 1)); continue
    fi
    if [ $ok_old = 0 ]; then
      if [ "$out_old" = "$out_new" ]; then echo "same    $arch [$layout]: both refuse"; same=$((same + 1))
      else echo "DIFFER  $arch [$layout]: refusals differ"; differ=$((differ + 1)); fi
      continue
    fi
    if cmp -s "$dir/$arch-$l.old.atp" "$dir/$arch-$l.new.atp"; then
      echo "same    $arch [$layout]"; same=$((same + 1))
    elif [ -n "${IGNORE:-}" ] && same_but "$IGNORE" "$dir/$arch-$l.old.atp" "$dir/$arch-$l.new.atp"; then
      echo "same    $arch [$layout] but for $IGNORE"; same=$((same + 1))
    else
      echo "DIFFER  $arch [$layout]"; differ=$((differ + 1))
    fi
  done
done
echo "$same plans the same, $differ different"
[ $differ = 0 ]
