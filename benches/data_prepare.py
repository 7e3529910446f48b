#!/usr/bin/env python3
"""Benchmark: `autotp data prepare` against the `tokenizers` Python package's batch encoding of
the same documents, same threads, both writing the tokens as uint16 (Megatron's layout for
autotp; a numpy .bin for Python, whose index is left out in its favour).

The corpus is Python's standard library sources as JSON lines (a document per file, about
130 MB); the tokenizer a byte-level BPE of 32,000 ids (GPT-2's design) trained on it by the
`tokenizers` package, both written to $WORK. Rounds alternate the two sides; the table gives
each side's median seconds and throughput, and the ratio's median and range over rounds.

    cargo build --release
    /tmp/fxvenv/bin/python benches/data_prepare.py [--rounds 3] [--threads N]
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.environ.get("AUTOTP_BENCH_DIR", "/tmp/autotp-bench/data")
PYTHON_SIDE = r"""
import json, sys, time, numpy as np, tokenizers
corpus, tokenizer, out = sys.argv[1:4]
tok = tokenizers.Tokenizer.from_file(tokenizer)
eod = tok.token_to_id("<|endoftext|>")
start = time.perf_counter()
with open(out, "wb") as f:
    batch = []
    def flush():
        for e in tok.encode_batch(batch):
            np.asarray(e.ids + [eod], dtype=np.uint16).tofile(f)
        batch.clear()
    for line in open(corpus):
        batch.append(json.loads(line)["text"])
        if len(batch) == 1024:
            flush()
    flush()
print(time.perf_counter() - start)
"""


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def prepare_inputs():
    """The corpus (JSON lines of the standard library's sources) and a BPE tokenizer on it."""
    import tokenizers
    os.makedirs(WORK, exist_ok=True)
    corpus, tokenizer = os.path.join(WORK, "stdlib.jsonl"), os.path.join(WORK, "tokenizer.json")
    if not os.path.exists(corpus):
        stdlib = sysconfig.get_paths()["stdlib"]
        with open(corpus, "w") as f:
            for directory, _, files in sorted(os.walk(stdlib)):
                for name in sorted(files):
                    if name.endswith(".py"):
                        try:
                            text = open(os.path.join(directory, name), encoding="utf-8").read()
                        except (UnicodeDecodeError, OSError):
                            continue
                        f.write(json.dumps({"text": text}) + "\n")
    if not os.path.exists(tokenizer):
        bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
        bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                                                 initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
        texts = (json.loads(line)["text"] for line in open(corpus))
        bpe.train_from_iterator(texts, trainer)
        bpe.save(tokenizer)
    return corpus, tokenizer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    corpus, tokenizer = prepare_inputs()
    autotp = os.path.join(ROOT, "target", "release", "autotp")
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="true")
    times = {"autotp": [], "python": []}
    tokens = 0
    for _ in range(args.rounds):
        start = time.perf_counter()
        subprocess.run([autotp, "data", "prepare", corpus, "--tokenizer", tokenizer, "-o", os.path.join(WORK, "autotp"),
                        "--eod", "<|endoftext|>", "--workers", str(args.threads)], check=True, capture_output=True)
        times["autotp"].append(time.perf_counter() - start)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", PYTHON_SIDE, corpus, tokenizer, os.path.join(WORK, "python.bin")],
                       check=True, capture_output=True, env=env)
        times["python"].append(time.perf_counter() - start)
        tokens = os.path.getsize(os.path.join(WORK, "python.bin")) // 2
    with open(os.path.join(WORK, "autotp.bin"), "rb") as a, open(os.path.join(WORK, "python.bin"), "rb") as p:
        same = a.read() == p.read()
    megabytes = os.path.getsize(corpus) / 1e6
    ratios = [a / p for a, p in zip(times["autotp"], times["python"])]
    print(f"CPU: {cpu_model()}, {args.threads} threads; corpus {megabytes:.1f} MB, {tokens:,} tokens; "
          f"the two .bin files {'equal' if same else 'DIFFER'}")
    print("| side | median s (process, incl. start) | MB/s | tokens/s |")
    print("|---|---|---|---|")
    for side, label in (("autotp", "autotp data prepare"), ("python", "tokenizers (Python) encode_batch")):
        median = statistics.median(times[side])
        print(f"| {label} | {median:.2f} | {megabytes / median:.1f} | {tokens / median:,.0f} |")
    print(f"autotp / Python time: median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}, "
          f"{args.rounds} alternating rounds)")


if __name__ == "__main__":
    main()
