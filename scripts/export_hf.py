#!/usr/bin/env python3
"""Exports a Hugging Face causal LM from a local directory to ONNX for training with autotp.

    python3 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch transformers onnx onnxscript numpy
    /tmp/hfvenv/bin/python scripts/export_hf.py MODEL_DIR --out DIR [--seq-len S] [--dtype f32]

MODEL_DIR is what `save_pretrained` writes (config.json, the weights, the tokenizer's files).
The export is the one autotp's sweep of the Hugging Face catalogue checks
(scripts/sweep_hf_exports.py): the model in training mode with the eager attention, its
mixture of experts (if any) traced without baking the routing in (the batched-experts
implementation, or a dense forward where the experts take none), dropout set to 0 (autotp
trains without dropout; it says so), batch and sequence dynamic, and, where the legacy
exporter (opset 17, no constant folding) fails, torch.export's (opset 18, without the ONNX
optimizer, which would merge initializers of equal value: parameters PyTorch trains apart).
Weights past protobuf's 2 GiB go to one external-data file beside the model.

What autotp needs and ONNX drops is recorded in the model's `metadata_props`:
  autotp.buffers          the float buffers (PyTorch does not train them)
  autotp.padding_idx      each embedding's padding row (`nn.Embedding(padding_idx=...)`)
  autotp.hf_class         the Hugging Face class (`LlamaForCausalLM`)
  autotp.hf_parameters    JSON: each initializer's name to the model's own parameter names
                          (the wrapper's `m.` prefix removed; a tied weight lists every name,
                          first the one `save_pretrained` keeps)

The export's logits are checked against PyTorch's on two inputs with `autotp infer` (the
binary at --autotp, else target/release/autotp), or onnx's reference evaluator without one;
a difference past 1e-4 (relative to the largest logit) is an error.

DIR gets model.onnx (and model.onnx.data when external), MODEL_DIR's config.json and
tokenizer.json (the fast tokenizer's file, copied or written from the tokenizer MODEL_DIR holds).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import onnx
import torch
import transformers
import transformers.masking_utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# transformers 5 with the legacy exporter fails on aten::diff in packed-sequence detection.
transformers.masking_utils.find_packed_sequence_indices = lambda position_ids: None

PROTOBUF_LIMIT = 2 << 30
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class Logits(torch.nn.Module):
    """The model as the export sees it: token ids in, logits out (its parameters under `m.`)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids=input_ids).logits


def longcat_dense_experts(self, hidden_states, top_k_index, top_k_weights):
    """LongCat-Flash's experts without their loop over the experts a batch hits (which a trace
    bakes in, with `nonzero` and a branch per expert): every routed expert runs on every token,
    weighted by the routing (zero off the token's top k), and the zero-computation experts pass
    the token through."""
    routed = self.num_routed_experts
    weights = (torch.nn.functional.one_hot(top_k_index, self.total_experts) * top_k_weights[..., None]).sum(1)
    gate, up = torch.einsum("th,eoh->teo", hidden_states, self.gate_up_proj[:routed]).chunk(2, dim=-1)
    out = torch.einsum("tei,ehi->teh", self.act_fn(gate) * up, self.down_proj)
    return (weights[:, :routed, None] * out).sum(1) + weights[:, routed:].sum(1, keepdim=True) * hidden_states


def dbrx_dense_experts(self, hidden_states, top_k_index, top_k_weights):
    """DBRX's experts without their loop over the experts hit, as LongCat-Flash's."""
    batch = hidden_states.shape[0]
    x = hidden_states.reshape(-1, self.hidden_size)
    weights = (torch.nn.functional.one_hot(top_k_index, self.num_experts) * top_k_weights[..., None]).sum(1)
    w1, v1, w2 = (p.view(self.num_experts, self.ffn_hidden_size, self.hidden_size)
                  for p in (self.mlp.w1, self.mlp.v1, self.mlp.w2))
    gate = self.mlp.activation_fn(torch.einsum("th,efh->tef", x, w1))
    out = torch.einsum("tef,efh->teh", gate * torch.einsum("th,efh->tef", x, v1), w2)
    return (weights[..., None] * out).sum(1).view(batch, -1, self.hidden_size)


def jetmoe_unsorted_routing(self, hidden_states):
    """JetMoE's router without its sort of the tokens by expert (and the list of tokens per
    expert that a trace bakes in): each of a token's top k slots stays in place, and where the
    experts read the list they read each slot's expert instead (`jetmoe_dense_experts`)."""
    logits = self.layer(hidden_states).float()
    top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
    top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
    slots = torch.arange(top_k_indices.numel(), device=hidden_states.device)
    return slots, slots.div(self.top_k, rounding_mode="trunc"), top_k_gates.flatten(), top_k_indices.flatten(), logits


def jetmoe_dense_experts(self, inputs, slot_experts):
    """JetMoE's experts (of its MoE and of its attention experts) on every slot, each slot's
    output taken from its own expert (`slot_experts`, from `jetmoe_unsorted_routing`)."""
    selected = torch.nn.functional.one_hot(slot_experts, self.num_experts).to(inputs.dtype)
    return torch.einsum("te,teo->to", selected, torch.einsum("ti,eoi->teo", inputs, self.weight))


# Experts modules that take no `_experts_implementation`, by class name: a forward that traces
# without baking the routing in (equal to the loop it replaces; PyTorch's side computes it too).
DENSE_EXPERTS = {"LongcatFlashExperts": longcat_dense_experts, "DbrxExperts": dbrx_dense_experts,
                 "JetMoeTopKGating": jetmoe_unsorted_routing, "JetMoeParallelExperts": jetmoe_dense_experts}


def traceable(model):
    """`model` in training mode, its experts (if any) traced without baking the routing in:
    the batched-experts implementation, or a dense forward (DENSE_EXPERTS)."""
    try:
        model.set_experts_implementation("batched_mm")
    except (AttributeError, ValueError):  # no experts, or experts that take no implementation
        pass
    for module in model.modules():
        dense = DENSE_EXPERTS.get(type(module).__name__)
        if dense:
            module.forward = dense.__get__(module)
    model.train()
    return model


def without_dropout(config):
    """Sets every dropout probability of `config` (and its sub-configs) to 0; the names set."""
    names = []
    for key, value in list(vars(config).items()):
        if ("dropout" in key or key.endswith("pdrop") or key == "layerdrop") and isinstance(value, float) and value:
            setattr(config, key, 0.0)
            names.append(key)
        elif isinstance(value, transformers.PreTrainedConfig):
            names += [f"{key}.{name}" for name in without_dropout(value)]
    return names


def export(model, path, exporter, opset, example, external=False):
    """Exports `Logits(model)` to `path` for training: the legacy exporter in training mode
    without constant folding, or torch.export's without the ONNX optimizer; batch and sequence
    dynamic."""
    wrapped = Logits(model)
    if exporter == "dynamo":
        dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
        torch.onnx.export(wrapped, (example,), path, input_names=["input_ids"], output_names=["logits"],
                          dynamic_shapes={"input_ids": dims}, opset_version=opset, dynamo=True,
                          external_data=external, optimize=False)
        return
    torch.onnx.export(wrapped, (example,), path, input_names=["input_ids"], output_names=["logits"],
                      dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}},
                      opset_version=opset, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False)


def parameter_names(model, initializers):
    """Each initializer that is one of the model's parameters, to every name the model gives
    that tensor (a tied weight has several: the one `save_pretrained` keeps first), without the
    wrapper's `m.` prefix."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})  # the names tied to another's
    by_tensor = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(p.data_ptr(), []).append(name)
    names = {}
    for name, p in model.named_parameters():
        if f"m.{name}" in initializers:
            names[f"m.{name}"] = sorted(by_tensor[p.data_ptr()], key=lambda n: (n in tied, n))
    return names


def padding_rows(model):
    """`autotp.padding_idx`'s entries: each embedding table's padding row, by initializer name."""
    entries = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            entries.append(f"m.{name}.weight={module.padding_idx}")
    return ",".join(entries)


def buffers_of(model, initializers):
    """The initializers (by name) that are the model's float buffers, which PyTorch does not
    train, by their ONNX names (the `Logits` wrapper's `m.` prefix)."""
    return sorted(f"m.{name}" for name, b in model.named_buffers()
                  if b.is_floating_point() and b.dim() > 0 and f"m.{name}" in initializers)


def record_metadata(path, model):
    """Writes what autotp needs and ONNX drops into the export's `metadata_props`."""
    exported = onnx.load(path, load_external_data=False)
    initializers = {t.name for t in exported.graph.initializer}
    entries = {
        "autotp.buffers": ",".join(buffers_of(model, initializers)),
        "autotp.padding_idx": padding_rows(model),
        "autotp.hf_class": type(model).__name__,
        "autotp.hf_parameters": json.dumps(parameter_names(model, initializers), sort_keys=True),
    }
    for key, value in entries.items():
        if value:
            entry = exported.metadata_props.add()
            entry.key, entry.value = key, value
    onnx.save(exported, path)


def autotp_logits(path, ids, binary):
    """The export's logits for `ids`: `autotp infer`, or onnx's reference evaluator."""
    if binary is None:
        from onnx.reference import ReferenceEvaluator
        return ReferenceEvaluator(path).run(None, {"input_ids": ids})[0]
    with tempfile.TemporaryDirectory() as scratch:
        np.save(os.path.join(scratch, "input_ids.npy"), ids)
        done = subprocess.run([binary, "infer", path, "--input", f"input_ids={scratch}/input_ids.npy",
                               "--output-dir", scratch], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"autotp infer {path}: {done.stderr.strip()}")
        return np.load(os.path.join(scratch, "logits.npy"))


def check_logits(path, model, inputs, binary):
    """The largest difference of the export's logits from PyTorch's over both inputs, relative
    to the largest logit."""
    worst = 0.0
    for ids in inputs:
        with torch.no_grad():
            want = Logits(model)(torch.from_numpy(ids)).float().numpy()
        got = autotp_logits(path, ids, binary)
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    return worst


def write_tokenizer(model_dir, out):
    """DIR/tokenizer.json: MODEL_DIR's, or the one its fast tokenizer writes; False without one."""
    source = os.path.join(model_dir, "tokenizer.json")
    if os.path.exists(source):
        shutil.copy(source, os.path.join(out, "tokenizer.json"))
        return True
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return False
    if not tokenizer.is_fast:
        return False
    tokenizer.backend_tokenizer.save(os.path.join(out, "tokenizer.json"))
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="a Hugging Face model directory (what save_pretrained writes)")
    parser.add_argument("--out", required=True, help="directory for model.onnx, config.json, tokenizer.json")
    parser.add_argument("--seq-len", type=int, default=16, help="sequence length of the traced example")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32", help="the weights' dtype in the export")
    parser.add_argument("--exporter", choices=["auto", "legacy", "dynamo"], default="auto",
                        help="auto: the legacy exporter, else torch.export where it fails or differs")
    parser.add_argument("--autotp", help="the autotp binary that checks the logits [default: target/release/autotp]")
    args = parser.parse_args()

    binary = args.autotp or os.path.join(ROOT, "target", "release", "autotp")
    if not os.path.exists(binary):
        print(f"no autotp binary at {binary}: onnx's reference evaluator checks the logits", file=sys.stderr)
        binary = None
    config = transformers.AutoConfig.from_pretrained(args.model_dir)
    config.use_cache = False
    dropped = without_dropout(config)
    if dropped:
        print(f"dropout set to 0 (autotp trains without dropout): {', '.join(dropped)}", file=sys.stderr)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_dir, config=config, dtype=DTYPES[args.dtype], attn_implementation="eager")
    model = traceable(model)
    vocab = model.get_input_embeddings().num_embeddings
    generator = np.random.default_rng(0)
    inputs = [generator.integers(0, vocab, (2, args.seq_len), dtype=np.int64) for _ in range(2)]
    external = sum(p.numel() * p.element_size() for p in model.parameters()) > PROTOBUF_LIMIT

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "model.onnx")
    attempts = [("legacy", 17), ("dynamo", 18)] if args.exporter == "auto" else \
        [(args.exporter, 17 if args.exporter == "legacy" else 18)]
    failures = []
    for exporter, opset in attempts:
        try:
            export(model, path, exporter, opset, torch.from_numpy(inputs[0]), external)
            record_metadata(path, model)
            relative = check_logits(path, model, inputs, binary)
        except Exception as e:  # noqa: BLE001 - an exporter's failure is reported, the next one tried
            while e.__cause__ is not None:  # torch.export's errors wrap the one that says why
                e = e.__cause__
            failures.append(f"{exporter} exporter: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            continue
        if relative > 1e-4:
            failures.append(f"{exporter} exporter: its logits differ from PyTorch's by {relative:.1e} (relative)")
            continue
        shutil.copy(os.path.join(args.model_dir, "config.json"), os.path.join(args.out, "config.json"))
        tokenizer = write_tokenizer(args.model_dir, args.out)
        print(f"{path}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{exporter} exporter (opset {opset}), logits within {relative:.1e} of PyTorch on two inputs")
        if not tokenizer:
            print(f"no fast tokenizer in {args.model_dir}: no tokenizer.json written", file=sys.stderr)
        return
    for failure in failures:
        print(failure, file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
    main()
