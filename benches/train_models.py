#!/usr/bin/env python3
"""The models of benches/train_models.sh and their PyTorch CPU eager side.

    python benches/train_models.py export NAME OUT.onnx
        exports model NAME (random init, seed 0) for training, as make_fixtures.py does
    python benches/train_models.py pytorch NAME TOKENS.bin STEPS MICRO_BATCH SEQ_LEN THREADS OUT.jsonl [MODE] [DEVICE] [PRECISION]
        trains it with the training contract (windows of S+1 with stride S, next-token labels,
        mean cross-entropy, AdamW lr 2e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.01) and
        writes one JSON line per step with its wall time (forward, backward, optimizer step);
        MODE eager (default) or compile (torch.compile of the model), DEVICE cpu (default) or
        cuda (TF32 off, the step timed to a device synchronisation), PRECISION f32 (default) or
        bf16 (torch.autocast to bfloat16 around the forward and the loss: f32 parameters and
        optimizer, as autotp's --precision bf16 keeps f32 masters)
"""
import json
import os
import sys
import time

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
import make_fixtures  # noqa: E402


def models():
    """Name -> (class, config): the five models of issue 15's table, the Mixtral fixture and a
    wider Mixtral (8 experts, top-2), exported with Hugging Face's batched experts (the one that
    traces; see make_fixtures.py)."""
    gpt2 = transformers.GPT2Config
    llama = transformers.LlamaConfig
    quiet = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return {
        "gpt2-tiny": make_fixtures.configs()["gpt2"],
        "llama-tiny": (transformers.LlamaForCausalLM, llama(
            vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
            tie_word_embeddings=False, use_cache=False)),
        "gpt2-wide": (transformers.GPT2LMHeadModel, gpt2(
            vocab_size=1000, n_embd=192, n_layer=3, n_head=6, n_positions=256, **quiet)),
        "gpt2-512": (transformers.GPT2LMHeadModel, gpt2(
            vocab_size=8192, n_embd=512, n_layer=4, n_head=8, n_positions=256, **quiet)),
        "llama-512": (transformers.LlamaForCausalLM, llama(
            vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
            tie_word_embeddings=False, use_cache=False)),
        "gpt2-124m": (transformers.GPT2LMHeadModel, gpt2(**quiet)),
        "mixtral-tiny": make_fixtures.family_configs()["mixtral"],
        "mixtral-256": (transformers.MixtralForCausalLM, mixtral_256()),
    }


def mixtral_256():
    cfg = transformers.MixtralConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
        tie_word_embeddings=False, router_jitter_noise=0.0, use_cache=False)
    cfg._experts_implementation = "batched_mm"
    return cfg


# PyTorch's side of a mixture runs Hugging Face's grouped-GEMM experts (torch._grouped_mm), its
# fastest on the CPU: the batched form the export traces gathers a matrix per pair (25 times
# slower on mixtral-256).
PYTORCH_EXPERTS = "grouped_mm"


def model(name, experts=None):
    cls, cfg = models()[name]
    # Only a mixture's config names an experts implementation (the batched one, for the export).
    if experts is not None and getattr(cfg, "_experts_implementation", None) is not None:
        cfg._experts_implementation = experts
    return make_fixtures.seeded_model(cls, cfg)


def export(name, out):
    m = model(name)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    make_fixtures.export(make_fixtures.Logits(m), (ids,), ["input_ids"], ["logits"], out)


def pytorch(name, tokens_path, steps, g, s, threads, out, mode="eager", device="cpu", precision="f32"):
    steps, g, s, threads = int(steps), int(g), int(s), int(threads)
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tokens = np.fromfile(tokens_path, dtype="<u2")
    windows = (len(tokens) - 1) // s
    m = model(name, experts=PYTORCH_EXPERTS).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    forward = torch.compile(m) if mode == "compile" else m
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with open(out, "w") as f:
        for step in range(steps):
            idx = [(step * g + j) % windows for j in range(g)]
            batch = np.stack([tokens[w * s: w * s + s + 1] for w in idx]).astype(np.int64)
            ids, labels = torch.from_numpy(batch[:, :s]).to(device), torch.from_numpy(batch[:, 1:]).to(device)
            sync()
            start = time.perf_counter()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits = forward(input_ids=ids).logits
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sync()
            seconds = time.perf_counter() - start
            f.write(json.dumps({"step": step + 1, "loss": loss.item(), "step_seconds": seconds}) + "\n")


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    {"export": export, "pytorch": pytorch}[command](*args)
