#!/usr/bin/env bash
# The README's main job: tokenize the King James Version's Genesis to Ruth into a Megatron
# dataset, train the small GPT on it on two CPU ranks (dp 2) with validation on 5% of the
# chapters, then print what it writes after a prompt. Expects `cargo build --release`.
set -euo pipefail
cd "$(dirname "$0")/../.."
autotp=target/release/autotp
example=examples/kjv
rm -rf target/kjv-ckpt
set -x
$autotp data prepare $example/chapters.jsonl --tokenizer $example/tokenizer.json -o target/kjv
$autotp train $example/model.onnx --seq-len 128 --micro-batch 8 --dp 2 \
    --lr 3e-3 --lr-schedule cosine --warmup-steps 20 --min-lr 3e-4 --weight-decay 0.1 --grad-clip 1.0 \
    --data target/kjv --split 95,5,0 --steps 300 --log-every 25 --eval-every 50 --eval-iters 4 \
    --tensorboard target/kjv-tensorboard --save target/kjv-ckpt
$autotp generate $example/model.onnx --checkpoint target/kjv-ckpt --tokenizer $example/tokenizer.json \
    --prompt "And God said" --max-new-tokens 40 --temperature 0.8 --top-k 40 --seed 1
