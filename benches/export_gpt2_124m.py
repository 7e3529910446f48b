#!/usr/bin/env python3
"""Exports a random-init GPT-2 124M (the default GPT2Config) for training, like the fixtures
(opset 17, training mode, no constant folding, dynamic batch/sequence), to the path given."""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
import transformers
import transformers.masking_utils

transformers.masking_utils.find_packed_sequence_indices = lambda position_ids: None


class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids=input_ids).logits


cfg = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
cfg._attn_implementation = "eager"
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(cfg).train()
ids = torch.randint(0, cfg.vocab_size, (1, 64))
torch.onnx.export(Logits(model), (ids,), sys.argv[1], input_names=["input_ids"], output_names=["logits"],
                  dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}},
                  opset_version=17, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                  do_constant_folding=False)
print(f"{sum(p.numel() for p in model.parameters())} parameters", file=sys.stderr)
