#!/usr/bin/env python3
"""Exports a random-init GPT-2 124M (the default GPT2Config) for training, like the fixtures
(opset 17, training mode, no constant folding, dynamic batch/sequence), to the path given."""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers

# The fixtures script holds the export recipe (wrapper module, flags, exporter patches).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
import make_fixtures  # noqa: E402
import torch  # noqa: E402

cfg = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
cfg._attn_implementation = "eager"
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(cfg).train()
ids = torch.randint(0, cfg.vocab_size, (1, 64))
make_fixtures.export(make_fixtures.Logits(model), (ids,), ["input_ids"], ["logits"], sys.argv[1])
print(f"{sum(p.numel() for p in model.parameters())} parameters", file=sys.stderr)
