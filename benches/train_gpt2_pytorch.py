#!/usr/bin/env python3
"""The PyTorch CPU eager side of benches/train_gpt2.sh: trains the tiny GPT-2 fixture model
(tests/fixtures/make_fixtures.py's config) with the training contract (windows of S+1 with
stride S, next-token labels, mean cross-entropy, AdamW) and writes one JSON line per step with
its wall time (forward, backward, optimizer step).

    python benches/train_gpt2_pytorch.py TOKENS.bin STEPS MICRO_BATCH SEQ_LEN THREADS OUT.jsonl
"""
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
import make_fixtures  # noqa: E402


def main():
    tokens_path, steps, g, s, threads, out = sys.argv[1:7]
    steps, g, s, threads = int(steps), int(g), int(s), int(threads)
    torch.set_num_threads(threads)
    tokens = np.fromfile(tokens_path, dtype="<u2")
    windows = (len(tokens) - 1) // s
    cls, cfg = make_fixtures.configs()["gpt2"]
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    with open(out, "w") as f:
        for step in range(steps):
            idx = [(step * g + j) % windows for j in range(g)]
            batch = np.stack([tokens[w * s: w * s + s + 1] for w in idx]).astype(np.int64)
            ids, labels = torch.from_numpy(batch[:, :s]), torch.from_numpy(batch[:, 1:])
            start = time.perf_counter()
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            seconds = time.perf_counter() - start
            f.write(json.dumps({"step": step + 1, "loss": loss.item(), "step_seconds": seconds}) + "\n")


if __name__ == "__main__":
    main()
