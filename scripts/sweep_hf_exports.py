#!/usr/bin/env python3
"""Sweeps Hugging Face causal LMs through autotp: builds each architecture tiny and random
(no network: models come from configs), exports it for training as a user would (legacy
exporter, training mode, no constant folding, dynamic batch and sequence axes) at several
opsets, lists the ONNX ops each export uses, compares autotp's logits with PyTorch's, compiles
a one-rank training plan, and compiles a `--tp 2` plan and checks it with `autotp verify`.
Prints a markdown table (the README's list of what was checked) and the ops that autotp does
not import.

    python3 -m venv /tmp/fxvenv
    /tmp/fxvenv/bin/pip install torch==2.15.0 transformers==5.23.0 onnx==1.23.2 onnxscript numpy
    cargo build --release
    HF_HUB_OFFLINE=1 /tmp/fxvenv/bin/python scripts/sweep_hf_exports.py [--opsets 14,17,20] [MODEL_TYPE...]
    HF_HUB_OFFLINE=1 /tmp/fxvenv/bin/python scripts/sweep_hf_exports.py --dynamo --opsets 18,23

Exports go to /tmp/autotp-sweep/<model_type>/{opset,dynamo}/ (reused when present), each with
its input_ids.npy and PyTorch's logits.npy.
"""
import argparse
import collections
import os
import re
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import onnx
import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures"))
# The fixtures' Logits wrapper, and their workaround for the legacy exporter on transformers 5.
from make_fixtures import Logits  # noqa: E402
AUTOTP = os.path.join(ROOT, "target", "release", "autotp")
OUT = "/tmp/autotp-sweep"
VOCAB = 1000

# Every architecture gets these (each config maps the names it knows); the extras fix what a
# family needs to be tiny or to export.
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, use_cache=False, tie_word_embeddings=False,
    head_dim=16,
)
ARCHITECTURES = {
    "gpt2": dict(n_positions=128, n_inner=128),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=8),
    "gpt_neox": dict(rotary_pct=0.25),
    "gptj": dict(rotary_dim=16, n_positions=128),
    "codegen": dict(rotary_dim=16, n_positions=128, n_ctx=128),
    "llama": {},
    "mistral": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0),
    "qwen2": {},
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "phi": dict(partial_rotary_factor=0.5),
    "phi3": dict(pad_token_id=0),
    "gemma": {},
    "gemma2": dict(sliding_window=8),
    "stablelm": dict(partial_rotary_factor=0.25),
    "starcoder2": dict(sliding_window=None),
    "olmo": {},
    "olmo2": {},
    "cohere": {},
    "granite": {},
    "nemotron": dict(partial_rotary_factor=0.5),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
    "bloom": {},
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "gpt_bigcode": dict(multi_query=True, n_positions=128),
    "xglm": dict(d_model=64, ffn_dim=128, num_layers=2),
    "biogpt": {},
    "persimmon": {},
    "mpt": dict(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=128),
    "apertus": {},
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),
    "deepseek_v3": dict(head_dim=8, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                        n_group=2, topk_group=1, first_k_dense_replace=1),
}


def tiny_model(model_type):
    kwargs = {**SMALL, **ARCHITECTURES[model_type]}
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    except AttributeError:  # a config whose head_dim is derived (Falcon)
        del kwargs["head_dim"]
        cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    for k in [k for k in vars(cfg) if "dropout" in k or k.endswith("pdrop") or k == "layerdrop"]:
        if isinstance(getattr(cfg, k), float):
            setattr(cfg, k, 0.0)
    cfg._attn_implementation = "eager"
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3"):
        cfg._experts_implementation = "batched_mm"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def export(model, path, opset, dynamo):
    """Exports `model` (the legacy exporter in training mode, or torch.export's) and saves
    PyTorch's logits for input_ids beside it."""
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        logits = Logits(model)(ids)
    directory = os.path.dirname(path)
    np.save(os.path.join(directory, "input_ids.npy"), ids.numpy())
    np.save(os.path.join(directory, "logits.npy"), logits.numpy())
    if dynamo:
        dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
        # Without the ONNX optimizer: it merges initializers of equal value (every freshly
        # initialised bias into one), which ties parameters PyTorch trains apart.
        torch.onnx.export(Logits(model), (ids,), path, input_names=["input_ids"], output_names=["logits"],
                          dynamic_shapes={"input_ids": dims}, opset_version=opset, dynamo=True,
                          external_data=False, optimize=False)
        return
    torch.onnx.export(Logits(model), (ids,), path, input_names=["input_ids"], output_names=["logits"],
                      dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}},
                      opset_version=opset, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False)


def ops_of(path):
    model = onnx.load(path, load_external_data=False)
    ops = set()
    stack = [model.graph]
    while stack:
        g = stack.pop()
        for n in g.node:
            ops.add(n.op_type)
            stack.extend(a.g for a in n.attribute if a.g.node)
    return ops


def autotp(*args):
    """Runs autotp: None when it succeeds, else its error (first line)."""
    run = subprocess.run([AUTOTP, *args], capture_output=True, text=True, timeout=600)
    if run.returncode == 0:
        return None
    lines = [l for l in (run.stderr + run.stdout).splitlines() if l.startswith("error") or "differs" in l]
    return (lines[0] if lines else (run.stderr or run.stdout).strip().splitlines()[-1]).removeprefix("error: ")[:160]


def logits_check(path):
    """autotp's logits for the saved input_ids against PyTorch's: the largest difference over
    the largest logit."""
    directory = os.path.dirname(path)
    out = os.path.join(directory, "autotp")
    error = autotp("infer", path, "--input", f"input_ids={directory}/input_ids.npy", "--output-dir", out)
    if error:
        return error
    got, want = np.load(os.path.join(out, "logits.npy")), np.load(os.path.join(directory, "logits.npy"))
    relative = float(np.abs(got - want).max() / np.abs(want).max())
    return f"{'ok' if relative <= 1e-4 else 'DIFFERS'} ({relative:.1e})"


def training_checks(path):
    """Compiles a one-rank plan and a `--tp 2` plan; the latter checked by `autotp verify`
    against the one-device program over two steps."""
    plan = path.replace(".onnx", "-tp2.atp")
    common = ["--seq-len", "16", "--micro-batch", "2"]
    one = autotp("compile", path, *common, "-o", "/dev/null") or "ok"
    tp = autotp("compile", path, *common, "--tp", "2", "-o", plan)
    if tp is None:
        tokens = os.path.join(ROOT, "tests/fixtures/train/tokens.bin")
        tp = autotp("verify", plan, "--data", tokens, "--steps", "2") or "verify ok"
    return one, tp


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--opsets", default="14,17,20")
    parser.add_argument("--dynamo", action="store_true", help="torch.export's exporter (opsets 18 and up)")
    parser.add_argument("types", nargs="*")
    args = parser.parse_args()
    opsets = [int(o) for o in args.opsets.split(",")]
    types = args.types or list(ARCHITECTURES)
    supported = set(re.findall(r'"([A-Za-z]+)"', open(os.path.join(ROOT, "frontend/src/onnx/ops/mod.rs")).read()))
    used = collections.defaultdict(set)
    exporter = "torch.export (dynamo)" if args.dynamo else "legacy exporter"
    print(f"| model type | opset ({exporter}) | ops | logits vs PyTorch | one-rank plan | `--tp 2` plan |")
    print("|---|---|---|---|---|---|")
    for model_type in types:
        for opset in opsets:
            exporter = "dynamo" if args.dynamo else "opset"
            path = os.path.join(OUT, model_type, exporter, f"{exporter}{opset}.onnx")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                if not os.path.exists(path):
                    export(tiny_model(model_type), path, opset, args.dynamo)
            except Exception as e:  # noqa: BLE001 - the table reports any failure
                print(f"| {model_type} | {opset} | | export failed: {type(e).__name__}: {str(e)[:120]} | | |")
                sys.stdout.flush()
                continue
            ops = ops_of(path)
            for op in ops:
                used[op].add(model_type)
            logits = logits_check(path)
            one, tp = training_checks(path)
            print(f"| {model_type} | {opset} | {len(ops)} | {logits} | {one} | {tp} |")
            sys.stdout.flush()
    print()
    print("ops used:", ", ".join(sorted(used)))
    missing = sorted(op for op in used if op not in supported)
    print("not imported:", ", ".join(f"{op} ({', '.join(sorted(used[op]))})" for op in missing) or "none")


if __name__ == "__main__":
    main()
