#!/usr/bin/env python3
"""A real small LLM's shape, trained by autotp on several layouts against PyTorch.

The model is SmolLM2-135M's architecture: Llama with 30 layers, hidden 576, 9 attention heads
over 3 key/value heads, an MLP of 1536, a vocabulary of 49152 and tied embeddings (134.5M
parameters). It is built from its config with random weights: this machine reaches PyPI and
crates.io but not the Hugging Face hub, and no package there ships the pretrained weights.

The data is real text in the model's real vocabulary size: the Python standard library's
sources, split into words and punctuation, each of the 49151 most frequent given an id in order
of frequency and every other one id 0, written as u16 tokens.

PyTorch trains the model under the training contract (tests/fixtures/make_training_fixtures.py:
windows of S+1 tokens with stride S, step s taking windows (s*G + j) mod W, mean cross-entropy,
torch.optim.AdamW with lr 2e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.01) at sequence 512.
The model is exported for training as a user would (the fixtures' legacy export), and for each
layout `autotp compile` is timed and `autotp run` trains the plan on the same tokens. The
script prints a markdown table (the README's) of each layout's compile time, step time, peak
memory and its loss curve's relative difference from PyTorch's, and exits non-zero when a
layout leaves the contract (1e-5 at step 1, 1e-3 at every step).

    HF_HUB_OFFLINE=1 /tmp/fxvenv/bin/python scripts/real_size_check.py [--steps 10] [--layers 30]

Files go to /tmp/autotp-real-size/ (the export and PyTorch's curve are reused when present).
`AUTOTP=path` runs another binary than target/release/autotp.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import sysconfig
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures"))
from make_fixtures import Logits, contract_curve, export, seeded_model  # noqa: E402

AUTOTP = os.environ.get("AUTOTP", os.path.join(ROOT, "target", "release", "autotp"))
OUT = "/tmp/autotp-real-size"
SEQ = 512
GLOBAL_BATCH = 4
TOKENS = 2_000_000

# (key, name, autotp flags); every layout trains GLOBAL_BATCH sequences a step.
LAYOUTS = [
    ("one", "one rank", ["--micro-batch", "4"]),
    ("tp3", "tp 3", ["--micro-batch", "4", "--tp", "3"]),
    ("dp2z3", "dp 2, ZeRO 3", ["--micro-batch", "2", "--dp", "2", "--zero", "3"]),
    ("pp2", "pp 2", ["--micro-batch", "1", "--grad-accum", "4", "--pp", "2"]),
]


def smollm2_config(layers):
    """SmolLM2-135M's config (HuggingFaceTB/SmolLM2-135M, config.json), `layers` deep."""
    return transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_act="silu",
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )


def real_text_tokens(vocab, count):
    """`count` u16 ids of the standard library's sources, words ranked by frequency."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(stdlib) for f in fs if f.endswith(".py"))
    words = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            words.extend(re.findall(r"\w+|[^\w\s]", f.read()))
        if len(words) >= count:
            break
    words = words[:count]
    ranked = [w for w, _ in sorted(collections.Counter(words).items(), key=lambda kv: (-kv[1], kv[0]))]
    ids = {w: i + 1 for i, w in enumerate(ranked[: vocab - 1])}
    return np.array([ids.get(w, 0) for w in words], dtype=np.uint16)


def pytorch_curve(model, tokens, steps):
    """The contract's AdamW steps of `model` over `tokens`: the loss and seconds per step."""
    seconds, start = [], [time.perf_counter()]

    def on_step(step, loss):
        seconds.append(time.perf_counter() - start[0])
        start[0] = time.perf_counter()
        print(f"  pytorch step {step + 1}: loss {loss:.6f} ({seconds[-1]:.1f} s)", flush=True)
    losses = contract_curve(model, tokens, GLOBAL_BATCH, SEQ, steps, on_step)
    return losses, seconds


def prepare(layers, steps):
    """The export, the token file and PyTorch's curve under OUT (reused when present)."""
    os.makedirs(OUT, exist_ok=True)
    model_path = os.path.join(OUT, f"smollm2-{layers}l.onnx")
    tokens_path = os.path.join(OUT, "tokens.bin")
    curve_path = os.path.join(OUT, f"pytorch-{layers}l-{steps}.json")
    cfg = smollm2_config(layers)
    if not os.path.exists(tokens_path):
        real_text_tokens(cfg.vocab_size, TOKENS).tofile(tokens_path)
    tokens = np.fromfile(tokens_path, dtype=np.uint16)
    if not os.path.exists(model_path):
        model = seeded_model(transformers.LlamaForCausalLM, cfg)
        params = sum(p.numel() for p in model.parameters())
        print(f"exporting {params / 1e6:.1f}M parameters to {model_path}", flush=True)
        start = time.perf_counter()
        export(Logits(model), (torch.zeros(1, 16, dtype=torch.int64),), ["input_ids"], ["logits"], model_path)
        print(f"  exported in {time.perf_counter() - start:.0f} s", flush=True)
    if not os.path.exists(curve_path):
        torch.set_num_threads(os.cpu_count())
        model = seeded_model(transformers.LlamaForCausalLM, cfg)
        losses, seconds = pytorch_curve(model, tokens, steps)
        with open(curve_path, "w") as f:
            json.dump({"losses": losses, "step_seconds": seconds}, f)
    with open(curve_path) as f:
        return model_path, tokens_path, json.load(f)


def timed(cmd):
    """Runs `cmd` under /usr/bin/time: its output, wall seconds and peak resident bytes."""
    start = time.perf_counter()
    out = subprocess.run(["/usr/bin/time", "-f", "peak_kib %M", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - start
    peak = re.findall(r"peak_kib (\d+)", out.stderr)
    return out, wall, int(peak[-1]) * 1024 if peak else 0


def run_layout(tag, name, flags, model_path, tokens_path, steps, want):
    """Compiles and trains one layout; its table row and whether it keeps the contract."""
    plan = os.path.join(OUT, f"{tag}.atp")
    metrics = os.path.join(OUT, f"{tag}.jsonl")
    optimizer = ["--lr", "2e-3", "--betas", "0.9,0.95", "--eps", "1e-8", "--weight-decay", "0.01"]
    compiled, compile_s, _ = timed([AUTOTP, "compile", model_path, "--seq-len", str(SEQ), *flags, *optimizer, "-o", plan])
    if compiled.returncode != 0:
        return f"| {name} | compile failed: {compiled.stderr.strip().splitlines()[-1]} | | | | |", False
    ran, _, peak = timed([AUTOTP, "run", plan, "--data", tokens_path, "--steps", str(steps), "--metrics-out", metrics])
    if ran.returncode != 0:
        return f"| {name} | {compile_s:.1f} s | run failed: {ran.stderr.strip().splitlines()[-1]} | | | |", False
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    got = [r["loss"] for r in rows]
    relative = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    worst = max(relative)
    step_s = np.median([r["step_seconds"] for r in rows[1:]] or [rows[0]["step_seconds"]])
    ok = len(got) == len(want) and relative[0] <= 1e-5 and worst <= 1e-3
    print(f"{name}: {' '.join(f'{g:.5f}' for g in got)}", flush=True)
    row = (f"| {name} | {compile_s:.1f} s | {step_s:.1f} s | {peak / 2**30:.1f} GiB | "
           f"{relative[0]:.1e} | {worst:.1e} |")
    return row, ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--layouts", default=",".join(k for k, _, _ in LAYOUTS),
                        help="comma-separated layouts of: " + ", ".join(f"{k} ({n})" for k, n, _ in LAYOUTS))
    args = parser.parse_args()
    chosen = [layout for layout in LAYOUTS if layout[0] in args.layouts.split(",")]
    model_path, tokens_path, reference = prepare(args.layers, args.steps)
    want = reference["losses"]
    print(f"pytorch: {' '.join(f'{w:.5f}' for w in want)}", flush=True)
    rows, all_ok = [], True
    for tag, name, flags in chosen:
        row, ok = run_layout(tag, name, flags, model_path, tokens_path, args.steps, want)
        rows.append(row)
        all_ok &= ok
    print()
    print(f"PyTorch eager: {np.median(reference['step_seconds'][1:]):.1f} s a step; "
          f"loss {want[0]:.4f} -> {want[-1]:.4f} over {args.steps} steps")
    print()
    print("| layout | compile | step | peak memory | step 1 vs PyTorch | worst step |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
