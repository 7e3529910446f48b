#!/usr/bin/env python3
"""Sweeps Hugging Face causal LMs through autotp: builds each architecture tiny and random
(no network: models come from configs), exports it for training as a user would (legacy
exporter, training mode, no constant folding, dynamic batch and sequence axes) at several
opsets, lists the ONNX ops each export uses, compares autotp's logits with PyTorch's, compiles
a one-rank training plan and trains it 5 AdamW steps against PyTorch's curve of the same
model (the training contract: 1e-5 at step 1, 1e-3 at every step; the export's float buffers
named in its metadata, `autotp.buffers`, so that autotp does not train what PyTorch does
not), and compiles a `--tp 2` plan and checks it with `autotp verify`. An export whose curve
leaves PyTorch's is checked again in f64 throughout (the model built, exported and trained by
PyTorch within make_fixtures.float64_throughout), where rounding cannot move a curve: within
1e-9 at every step, the two compute the same model, and f32's rounding moved the f32 curves.
Prints a markdown table (the README's list of what was checked) and the ops that autotp does
not import. `--catalogue` takes every model type of transformers' causal-LM mapping (multimodal
families by their text model); its rows are also appended to
/tmp/autotp-sweep/results-<exporter>.jsonl, and model types already there are skipped, so a
long sweep resumes where it stopped (`--table` prints the table of that file, `--readme` the
README's table of both exporters' files).

    python3 -m venv /tmp/fxvenv
    /tmp/fxvenv/bin/pip install torch==2.15.0 transformers==5.23.0 onnx==1.23.2 onnxscript numpy
    cargo build --release
    HF_HUB_OFFLINE=1 /tmp/fxvenv/bin/python scripts/sweep_hf_exports.py [--opsets 14,17,20] [MODEL_TYPE...]
    HF_HUB_OFFLINE=1 /tmp/fxvenv/bin/python scripts/sweep_hf_exports.py --dynamo --opsets 18,23
    HF_HUB_OFFLINE=1 /tmp/fxvenv/bin/python scripts/sweep_hf_exports.py --catalogue --opsets 17

Exports go to /tmp/autotp-sweep/<model_type>/{opset,dynamo}/ (reused when present), each with
its input_ids.npy and PyTorch's logits.npy, and a second input (input_ids2.npy, logits2.npy)
that routes a mixture of experts differently, so an export that baked the routing in differs.
`AUTOTP=path` runs another autotp binary than target/release/autotp (a copy, so that a long
sweep survives rebuilding).
"""
import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import onnx
import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures"))
# The fixtures' training contract, and the export helper's wrapper, experts and export.
from make_fixtures import contract_curve, float64_throughout  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from export_hf import Logits, buffers_of, traceable  # noqa: E402
from export_hf import export as export_for_training  # noqa: E402
AUTOTP = os.environ.get("AUTOTP", os.path.join(ROOT, "target", "release", "autotp"))
OUT = "/tmp/autotp-sweep"
VOCAB = 1000

# Every architecture gets these (each config maps the names it knows); the extras fix what a
# family needs to be tiny or to export.
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, use_cache=False, tie_word_embeddings=False,
    head_dim=16,
)
UNSET = object()
GEMMA3N = dict(num_kv_shared_layers=0, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
               intermediate_size=[128, 128], laurel_rank=8, altup_num_inputs=2, activation_sparsity_pattern=[0.0, 0.0])
BLT_LOCAL = dict(vocab_size=VOCAB, hidden_size=64, hidden_size_global=128, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
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
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "mamba2": dict(num_heads=8, head_dim=16, expand=2, n_groups=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "plbart": dict(d_model=64, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                   decoder_ffn_dim=128, encoder_layers=2, decoder_layers=2),
    "reformer": dict(axial_pos_embds_dim=[32, 32], axial_pos_shape=[8, 16]),
    # Its default init_std of 1.0 makes a random model's logits ~30 and its f32 gradients as far
    # as 1e-4 from f64 in PyTorch itself, past what `verify` allows a layout (1e-5).
    "cpmant": dict(init_std=0.02),
    "dots3_note": dict(num_key_value_heads=4, vision_config=dict(adapter_out_dim=64),
                       audio_config=dict(adapter_out_dim=64)),
    "dots3_note_text": dict(num_key_value_heads=4),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    # The catalogue's models that did not build tiny with the shared sizes alone: each with what
    # its config needs (UNSET: the config's own value, where setting one is refused).
    "xlnet": dict(max_position_embeddings=UNSET, d_head=16, d_inner=128),
    "prophetnet": dict(num_hidden_layers=UNSET, num_encoder_layers=2, num_decoder_layers=2, encoder_ffn_dim=128,
                       decoder_ffn_dim=128, num_encoder_attention_heads=4, num_decoder_attention_heads=4),
    "zamba": dict(num_hidden_layers=3),  # two Mamba layers, then the shared attention
    "zamba2": dict(layers_block_type=["mamba", "hybrid"]),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=1, topk_group=1),
    "gemma3n_text": GEMMA3N,
    "gemma3n": GEMMA3N,
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "musicgen": dict(num_codebooks=1, ffn_dim=128),  # one codebook: [batch, sequence] ids
    "musicgen_melody": dict(num_codebooks=1, ffn_dim=128),
    "dbrx": dict(d_model=64, attn_config=dict(kv_n_heads=2, clip_qkv=8.0),
                 ffn_config=dict(hidden_size=64, ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)),
    # Byte-level: a local encoder and decoder around a global transformer over patches, each
    # config its own, and hash embeddings of byte n-grams (500002 rows by default).
    "blt": dict(encoder_hash_byte_group_vocab=VOCAB, max_position_embeddings=128,
                encoder_config=BLT_LOCAL, decoder_config=BLT_LOCAL, patcher_config=BLT_LOCAL,
                global_config=dict(BLT_LOCAL, hidden_size=128)),
    "whisper": dict(d_model=64, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                    decoder_ffn_dim=128, encoder_layers=2, decoder_layers=2),
}
# The other latent-attention families take DeepSeek-V3's small latent sizes.
for _latent in ("deepseek_v2", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "longcat_flash", "youtu", "axk1", "axk2",
                "minicpm3"):
    ARCHITECTURES[_latent] = dict(ARCHITECTURES["deepseek_v3"])


# Mixture-of-experts configs name their sizes in several ways; each name present is set small.
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_topk=2,
           moe_intermediate_size=32, shared_expert_intermediate_size=64, expert_intermediate_size=32)
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")


def fix_config(cfg):
    """What transformers' own code needs and its config lacks: DBRX's attention reads a
    `rope_theta` that its attention config no longer carries."""
    if cfg.model_type == "dbrx":
        object.__setattr__(cfg.attn_config, "rope_theta", cfg.rope_parameters["rope_theta"])


def text_config(cfg):
    """A multimodal family's text config (its `text_config`; MusicGen's `decoder`), else `cfg`."""
    if cfg.model_type in ("musicgen", "musicgen_melody"):
        return cfg.decoder
    return getattr(cfg, "text_config", None) or cfg


def tiny_model(model_type):
    """The architecture built tiny and random. A multimodal family (a config with a
    `text_config`) is built as its text model: its own model type when the causal-LM mapping
    lists that, else the text config's model class."""
    kwargs = {k: v for k, v in {**SMALL, **ARCHITECTURES.get(model_type, {})}.items() if v is not UNSET}
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    except AttributeError:  # a config whose head_dim is derived (Falcon)
        del kwargs["head_dim"]
        cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    cfg = text_config(cfg)
    if cfg.model_type != model_type:
        cfg = transformers.AutoConfig.for_model(cfg.model_type, **kwargs)
    moe = model_type in MOE_TYPES or any(hasattr(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"))
    if moe and model_type not in ARCHITECTURES:
        for key, value in MOE.items():
            if isinstance(getattr(cfg, key, None), int):
                setattr(cfg, key, value)
    layers = cfg.num_hidden_layers if isinstance(getattr(cfg, "num_hidden_layers", None), int) else None
    kinds = getattr(cfg, "layer_types", None)
    if layers and isinstance(kinds, list) and kinds and len(kinds) != layers:
        distinct = list(dict.fromkeys(kinds))  # keep one layer of each kind
        cfg.layer_types = [distinct[i % len(distinct)] for i in range(max(layers, len(distinct)))]
        cfg.num_hidden_layers = len(cfg.layer_types)
    for k in [k for k in vars(cfg) if "dropout" in k or k.endswith("pdrop") or k == "layerdrop"]:
        if isinstance(getattr(cfg, k), float):
            setattr(cfg, k, 0.0)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids of the real vocabulary
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(cfg, key, 0)
        elif isinstance(value, list):
            setattr(cfg, key, [v if v < VOCAB else 0 for v in value])
    if hasattr(cfg, "is_decoder"):  # encoder families' causal heads (BERT's, RoBERTa's) want it
        cfg.is_decoder = True
    fix_config(cfg)
    cfg._attn_implementation = "eager"
    if moe:
        cfg._experts_implementation = "batched_mm"
    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    except ValueError:  # a text config the auto class does not map: the family's causal LM class
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        torch.manual_seed(0)
        model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])._from_config(cfg)
    return traceable(model)


def export(model, path, opset, dynamo):
    """Exports `model` as scripts/export_hf.py does (the legacy exporter in training mode, or
    torch.export's) and saves PyTorch's logits for input_ids beside it."""
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 16))
    directory = os.path.dirname(path)
    for suffix, input_ids in (("", ids), ("2", torch.randint(0, VOCAB, (2, 16)))):
        with torch.no_grad():
            logits = Logits(model)(input_ids)
        np.save(os.path.join(directory, f"input_ids{suffix}.npy"), input_ids.numpy())
        np.save(os.path.join(directory, f"logits{suffix}.npy"), logits.float().numpy())
    export_for_training(model, path, "dynamo" if dynamo else "legacy", opset, ids)


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
    def limit_memory():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))
    try:
        run = subprocess.run([AUTOTP, *args], capture_output=True, text=True, timeout=600, preexec_fn=limit_memory)
    except subprocess.TimeoutExpired:
        return "autotp took over 600 s"
    if run.returncode == 0:
        return None
    lines = [l for l in (run.stderr + run.stdout).splitlines() if l.startswith("error") or "differs" in l]
    return (lines[0] if lines else (run.stderr or run.stdout).strip().splitlines()[-1]).removeprefix("error: ")[:160]


def logits_check(path):
    """autotp's logits for the saved inputs against PyTorch's: the largest difference over the
    largest logit, of both inputs."""
    directory = os.path.dirname(path)
    worst = 0.0
    for suffix in ("", "2"):
        ids = os.path.join(directory, f"input_ids{suffix}.npy")
        if not os.path.exists(ids):
            continue
        out = os.path.join(directory, f"autotp{suffix}")
        error = autotp("infer", path, "--input", f"input_ids={ids}", "--output-dir", out)
        if error and not error.startswith("unsupported op"):
            return f"{error}; {reference_runs(path, np.load(ids))}"
        if error:
            return error
        got, want = np.load(os.path.join(out, "logits.npy")), np.load(os.path.join(directory, f"logits{suffix}.npy"))
        relative = float(np.abs(got - want).max() / np.abs(want).max())
        if relative > 1e-4:
            return f"DIFFERS ({relative:.1e}); {reference_verdict(path, np.load(ids), got, want)}"
        worst = max(worst, relative)
    return f"ok ({worst:.1e})"


def reference_runs(path, ids):
    """Whether onnx's reference evaluator runs an export that autotp refuses."""
    from onnx.reference import ReferenceEvaluator
    try:
        ReferenceEvaluator(onnx.load(path)).run(None, {"input_ids": ids})
    except Exception as e:  # noqa: BLE001 - reported
        return f"onnx's reference evaluator fails too ({type(e).__name__}: {' '.join(str(e).split())[:80]})"
    return "onnx's reference evaluator runs it"


def reference_verdict(path, ids, got, want, tolerance=1e-4):
    """Whose logits are wrong where autotp's differ from PyTorch's: onnx's reference evaluator
    runs the export too (and agrees with autotp within `tolerance`)."""
    from onnx.reference import ReferenceEvaluator
    try:
        reference = ReferenceEvaluator(onnx.load(path)).run(None, {"input_ids": ids})[0]
    except Exception as e:  # noqa: BLE001 - reported
        return f"onnx's reference evaluator fails too ({type(e).__name__})"
    scale = np.abs(want).max()
    to_autotp, to_torch = np.abs(reference - got).max() / scale, np.abs(reference - want).max() / scale
    if to_autotp <= tolerance:
        return f"onnx's reference evaluator agrees with autotp ({to_autotp:.1e}): the export is wrong"
    return f"onnx's reference evaluator differs from autotp ({to_autotp:.1e}) and PyTorch ({to_torch:.1e})"


REPLICATED = "verify ok, its unsplittable blocks replicated: "


def training_checks(path):
    """Compiles a one-rank plan and a `--tp 2` plan; the latter checked by `autotp verify`
    against the one-device program over two steps. A `--tp 2` refused for a block it cannot
    split is compiled again with `--tp-replicate-unsplittable` and verified: REPLICATED, then
    the refusal."""
    plan = path.replace(".onnx", "-tp2.atp")
    common = ["--seq-len", "16", "--micro-batch", "2"]
    tokens = os.path.join(ROOT, "tests/fixtures/train/tokens.bin")
    one = autotp("compile", path, *common, "-o", "/dev/null") or "ok"
    tp = autotp("compile", path, *common, "--tp", "2", "-o", plan)
    if tp is None:
        tp = autotp("verify", plan, "--data", tokens, "--steps", "2") or "verify ok"
    elif "cannot split the blocks" in tp:
        refusal = tp.split("; --tp-replicate-unsplittable")[0]
        replicated = autotp("compile", path, *common, "--tp", "2", "--tp-replicate-unsplittable", "-o", plan)
        if replicated is None:
            replicated = autotp("verify", plan, "--data", tokens, "--steps", "2")
        tp = f"{refusal}; replicating its blocks: {replicated}" if replicated else REPLICATED + refusal
    return one, tp


def catalogue():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_apart(work, report, memory_gib=12, seconds=900):
    """Runs `work(stage)` in a child process under a memory limit and a time limit (a config
    that is not tiny must not take the sweep down): None, or why it failed. `work` sets
    `stage[0]` to name the step it is in."""
    pid = os.fork()
    if pid == 0:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (memory_gib << 30, memory_gib << 30))
        stage = ["build"]
        try:
            work(stage)
            os._exit(0)
        except BaseException as e:  # noqa: BLE001 - the table reports any failure
            while e.__cause__ is not None:  # torch.export's errors wrap the one that says why
                e = e.__cause__
            with open(report, "w") as f:
                f.write(f"{stage[0]} failed: {type(e).__name__}: {' '.join(str(e).split())[:140]}")
            os._exit(1)
    for _ in range(seconds):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return f"build or export took over {seconds} s"
    if status == 0:
        return None
    if os.path.exists(report):
        failure = open(report).read()
        os.remove(report)
        return failure
    return f"build or export died (status {status}; over {memory_gib} GiB of memory?)"


def build_and_export_apart(model_type, path, opset, dynamo):
    """Builds the tiny model and exports it, apart: None, or why it failed."""
    def work(stage):
        model = tiny_model(model_type)
        stage[0] = "export"
        export(model, path, opset, dynamo)
    return run_apart(work, path + ".failure")


# The training check: the fixtures' contract (tests/fixtures/make_fixtures.contract_curve) at
# the sweep's size.
CURVE_STEPS, CURVE_G, CURVE_S = 5, 2, 16
TOKENS = os.path.join(ROOT, "tests/fixtures/train/tokens.bin")


def pytorch_curve(model):
    """The losses of CURVE_STEPS AdamW steps of `model` under the training contract."""
    return contract_curve(model, np.fromfile(TOKENS, dtype=np.uint16), CURVE_G, CURVE_S, CURVE_STEPS)


def name_buffers(exported, model, path):
    """Saves `exported` (the export of `model`) to `path` with its float buffers named in its
    metadata (`autotp.buffers`), so that autotp does not train what PyTorch does not."""
    entry = exported.metadata_props.add()
    initializers = {t.name for t in exported.graph.initializer}
    entry.key, entry.value = "autotp.buffers", ",".join(buffers_of(model, initializers))
    onnx.save(exported, path)


def annotate_apart(model_type, path):
    """Apart, as the export: names the export's buffers in its metadata (`autotp.buffers`, so
    that autotp does not train them either) and writes PyTorch's curve beside the model
    type's exports (curve.json), each unless already done. None, or why it failed."""
    curve = os.path.join(OUT, model_type, "curve.json")
    exported = onnx.load(path, load_external_data=False)
    annotated = any(p.key == "autotp.buffers" for p in exported.metadata_props)
    if annotated and os.path.exists(curve):
        return None

    def work(stage):
        model = tiny_model(model_type)
        if not annotated:
            name_buffers(exported, model, path)
        if not os.path.exists(curve):
            stage[0] = "PyTorch's training"
            with open(curve, "w") as f:
                json.dump(pytorch_curve(model), f)
    return run_apart(work, path + ".failure")


def autotp_curve(path, want):
    """autotp's CURVE_STEPS-step curve of the export against `want` (PyTorch's): the relative
    difference per step, or autotp's error (a string)."""
    metrics = path.replace(".onnx", "-metrics.jsonl")
    error = autotp("train", path, "--seq-len", str(CURVE_S), "--micro-batch", str(CURVE_G), "--steps",
                   str(CURVE_STEPS), "--data", TOKENS, "--lr", "2e-3", "--betas", "0.9,0.95", "--eps", "1e-8",
                   "--weight-decay", "0.01", "--metrics-out", metrics)
    if error:
        return error
    with open(metrics) as f:
        got = [json.loads(line)["loss"] for line in f]
    if len(got) != len(want):
        return f"{len(got)} steps of {len(want)}"
    return [abs(g - w) / abs(w) for g, w in zip(got, want)]


def curve_check(path):
    """autotp's curve of the export against PyTorch's: "ok (...)" within the training contract
    (1e-5 at step 1, 1e-3 at every step); else, when the same model in f64 throughout trains
    within F64_TOLERANCE of PyTorch's f64 curve, "ok in f64 (...)" and how far the f32 curves
    are; else how far it is, or autotp's error."""
    model_type = os.path.basename(os.path.dirname(os.path.dirname(path)))
    failure = annotate_apart(model_type, path)
    if failure:
        return failure
    with open(os.path.join(OUT, model_type, "curve.json")) as f:
        relative = autotp_curve(path, json.load(f))
    if isinstance(relative, str):
        return relative
    worst = max(relative)
    if relative[0] <= 1e-5 and worst <= 1e-3:
        return f"ok ({worst:.1e})"
    step = relative.index(worst) + 1
    f32 = f"step 1 {relative[0]:.1e}, step {step} {worst:.1e} relative"
    in_f64 = f64_check(model_type, path)
    if isinstance(in_f64, float):
        return f"ok in f64 ({in_f64:.1e}); in f32 {f32}"
    return f"trains unlike PyTorch: {f32}; in f64: {in_f64}"


# The f64 check's bars: f64's rounding (about 1e-16) leaves one model's logits and curves
# this close (a curve amplifies a difference over its steps).
F64_LOGITS_TOLERANCE, F64_TOLERANCE = 1e-12, 1e-9


def f64_check(model_type, path):
    """The training check of the same model (the same weights) in f64 throughout
    (make_fixtures' float64_throughout: Hugging Face's f32 casts in norms, rotary tables and
    softmax become f64 too), exported as `path` was, against PyTorch's f64 curve
    (curve-f64.json beside curve.json): the worst relative difference when within
    F64_TOLERANCE at every step, else how far it is or why it did not run."""
    exporter = os.path.basename(os.path.dirname(path))
    opset = int(os.path.basename(path)[len(exporter):-len(".onnx")])
    wide = path.replace(".onnx", "-f64.onnx")
    curve = os.path.join(OUT, model_type, "curve-f64.json")

    ids_path = os.path.join(os.path.dirname(path), "input_ids.npy")
    logits = path.replace(".onnx", "-f64-logits.npy")

    def work(stage):
        ids = torch.from_numpy(np.load(ids_path))
        # The f32 row's weights (built outside: an f64 default would draw others).
        model, trained = tiny_model(model_type), tiny_model(model_type)
        with float64_throughout():
            model, trained = model.double(), trained.double()
            if not os.path.exists(wide):
                stage[0] = "f64 export"
                with torch.no_grad():
                    np.save(logits, Logits(model)(ids).numpy())
                export_for_training(model, wide, "dynamo" if exporter == "dynamo" else "legacy", opset, ids)
                name_buffers(onnx.load(wide), model, wide)
            if not os.path.exists(curve):
                stage[0] = "PyTorch's f64 training"
                with open(curve, "w") as f:
                    json.dump(pytorch_curve(trained), f)
    failure = run_apart(work, path + ".failure")
    if failure:
        return failure
    # An export that is not PyTorch's f64 model (an exporter's f32 constant) cannot settle it.
    out = path.replace(".onnx", "-f64-autotp")
    error = autotp("infer", wide, "--input", f"input_ids={ids_path}", "--output-dir", out)
    if error:
        return error
    got, want = np.load(os.path.join(out, "logits.npy")), np.load(logits)
    differs = float(np.abs(got - want).max() / np.abs(want).max())
    if differs > F64_LOGITS_TOLERANCE:
        verdict = reference_verdict(wide, np.load(ids_path), got, want, tolerance=F64_LOGITS_TOLERANCE)
        return f"the f64 export's logits differ from PyTorch's ({differs:.1e}); {verdict}"
    with open(curve) as f:
        relative = autotp_curve(wide, json.load(f))
    if isinstance(relative, str):
        return relative
    worst = max(relative)
    if worst <= F64_TOLERANCE:
        return worst
    return f"step {relative.index(worst) + 1} {worst:.1e} relative"


def sweep_one(model_type, opset, dynamo):
    """One export's row: model type, opset, op count, logits, one-rank plan, tp 2 plan (a
    failure's reason in the first column it reaches)."""
    exporter = "dynamo" if dynamo else "opset"
    path = os.path.join(OUT, model_type, exporter, f"{exporter}{opset}.onnx")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    row = dict(model_type=model_type, opset=opset, ops=[], logits="", one="", tp="")
    if not os.path.exists(path):
        failure = build_and_export_apart(model_type, path, opset, dynamo)
        if failure:
            row["logits"] = failure
            if os.path.exists(path):
                os.remove(path)
            return row
    row["ops"] = sorted(ops_of(path))
    row["logits"] = logits_check(path)
    row["one"], row["tp"] = training_checks(path)
    if row["one"] == "ok":
        row["curve"] = curve_check(path)
    return row


def print_row(row):
    ops = len(row["ops"]) or ""
    print(f"| {row['model_type']} | {row['opset']} | {ops} | {row['logits']} | {row['one']} | {row.get('curve', '')} "
          f"| {row['tp']} |")
    sys.stdout.flush()


def verdict(row):
    """One cell of the README's table: what the export did, or where and why it stopped."""
    if row is None:
        return ""
    logits, one, tp = row["logits"], row["one"], row["tp"]
    if not logits.startswith("ok"):
        return logits
    if one != "ok":
        return f"logits {logits[3:]}; one-rank plan: {one}"
    if "curve" not in row:  # a row of a sweep before the training check
        tp_result = "verify at tp 2" if tp == "verify ok" else f"tp 2: {tp}"
        return f"logits {logits[3:]}, {tp_result} (not trained against PyTorch)"
    curve = row["curve"]
    if not curve.startswith("ok"):
        return f"logits {logits[3:]}; one rank: {curve}"
    if curve.startswith("ok in f64"):
        in_f64, in_f32 = curve.removeprefix("ok in f64 (").split("); in f32 ")
        trains = (f"{CURVE_STEPS} steps within {in_f64} of PyTorch in f64 throughout (in f32, rounding moves the "
                  f"curves apart: {in_f32})")
    else:
        trains = f"{CURVE_STEPS} steps within {curve[4:-1]} of PyTorch"
    if tp.startswith(REPLICATED):
        why = tp.removeprefix(REPLICATED).removeprefix("pass 'autotp': ")
        return f"logits {logits[3:]}, {trains}, verify at tp 2 with --tp-replicate-unsplittable ({why})"
    if tp != "verify ok":
        return f"logits {logits[3:]}, {trains}; tp 2: {tp.removeprefix('pass ').removeprefix(chr(39) + 'autotp' + chr(39) + ': ')}"
    return f"passes (logits {logits[4:-1]}, {trains}, verify at tp 2)"


OUTCOMES = ("pass", "pass, their curves checked in f64 (f32's rounding moves them past the contract)",
            "pass at tp 2 replicating the blocks it cannot split", "refuse tp 2", "train unlike PyTorch",
            "need what autotp lacks", "fail in the exporters", "do not build tiny")


def outcome(row):
    """Where one export got to, by the order of OUTCOMES (the first is the furthest)."""
    if row is None:
        return len(OUTCOMES)
    logits, one, tp = row["logits"], row["one"], row["tp"]
    if logits.startswith("ok") and one == "ok":
        curve = row.get("curve", "ok")
        if not curve.startswith("ok"):
            return OUTCOMES.index("train unlike PyTorch")
        if tp.startswith(REPLICATED):
            return OUTCOMES.index("pass at tp 2 replicating the blocks it cannot split")
        if tp != "verify ok":
            return OUTCOMES.index("refuse tp 2")
        return 1 if curve.startswith("ok in f64") else 0
    if "unsupported op" in logits or "must be a constant" in logits:
        return OUTCOMES.index("need what autotp lacks")
    if "build failed" in logits or "took over" in logits or "died" in logits:
        return OUTCOMES.index("do not build tiny")
    return OUTCOMES.index("fail in the exporters")


def readme_table():
    """The README's table: every model type with its legacy export's result and torch.export's,
    then how many model types got how far with either."""
    def load(exporter):
        path = os.path.join(OUT, f"results-{exporter}.jsonl")
        rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        return {r["model_type"]: r for r in rows}
    legacy, dynamo = load("opset"), load("dynamo")
    print("| model type | legacy exporter (opset 17) | torch.export (opset 18) |")
    print("|---|---|---|")
    best = collections.Counter()
    for model_type in catalogue():
        print(f"| {model_type} | {verdict(legacy.get(model_type))} | {verdict(dynamo.get(model_type))} |")
        best[min(outcome(legacy.get(model_type)), outcome(dynamo.get(model_type)))] += 1
    print()
    print(", ".join(f"{best[i]} {name}" for i, name in enumerate(OUTCOMES)) + f" (of {len(catalogue())})")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--opsets", default="14,17,20")
    parser.add_argument("--dynamo", action="store_true", help="torch.export's exporter (opsets 18 and up)")
    parser.add_argument("--catalogue", action="store_true", help="every causal LM of transformers, resumable")
    parser.add_argument("--table", action="store_true", help="print the catalogue's table so far")
    parser.add_argument("--readme", action="store_true", help="print the README's table of both exporters")
    parser.add_argument("types", nargs="*")
    args = parser.parse_args()
    if args.readme:
        readme_table()
        return
    opsets = [int(o) for o in args.opsets.split(",")]
    exporter = "dynamo" if args.dynamo else "opset"
    results = os.path.join(OUT, f"results-{exporter}.jsonl")
    done = []
    if (args.catalogue or args.table) and os.path.exists(results):
        done = [json.loads(line) for line in open(results)]
    types = args.types or (catalogue() if args.catalogue or args.table else list(ARCHITECTURES))
    supported = set(re.findall(r'"([A-Za-z]+)"', open(os.path.join(ROOT, "frontend/src/onnx/ops/mod.rs")).read()))
    used = collections.defaultdict(set)
    title = "torch.export (dynamo)" if args.dynamo else "legacy exporter"
    print(f"| model type | opset ({title}) | ops | logits vs PyTorch | one-rank plan | {CURVE_STEPS} steps vs PyTorch "
          "| `--tp 2` plan |")
    print("|---|---|---|---|---|---|---|")
    for model_type in types:
        for opset in opsets:
            previous = [r for r in done if r["model_type"] == model_type and r["opset"] == opset]
            if previous or args.table:
                row = previous[-1] if previous else None
            else:
                row = sweep_one(model_type, opset, args.dynamo)
                if args.catalogue:
                    with open(results, "a") as f:
                        f.write(json.dumps(row) + "\n")
            if row:
                for op in row["ops"]:
                    used[op].add(model_type)
                print_row(row)
    print()
    print("ops used:", ", ".join(sorted(used)))
    missing = sorted(op for op in used if op not in supported)
    print("not imported:", ", ".join(f"{op} ({', '.join(sorted(used[op]))})" for op in missing) or "none")


if __name__ == "__main__":
    main()
