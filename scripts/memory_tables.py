#!/usr/bin/env python3
"""Per-rank memory of the fixture models under issue 19's memory features, as the compile
summary plans it: f32 against bf16, each recomputation mode, each optimizer offload. Prints
Markdown tables (bytes per rank). Standard library only; builds nothing: run it after
`cargo build --release`.

    scripts/memory_tables.py [--seq-len 128] [--micro-batch 8] [--models gpt2,llama]
"""

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AUTOTP = REPO / "target" / "release" / "autotp"


def compile_summary(model: str, flags: list[str], out: Path) -> str:
    args = [str(AUTOTP), "compile", str(REPO / "tests" / "fixtures" / model / "model.onnx"), *flags, "-o", str(out)]
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)}\n{done.stderr}")
    return done.stdout


def figure(summary: str, label: str) -> int:
    """The bytes on the memory table's line that starts with `label` (bytes, then MiB)."""
    for line in summary.splitlines():
        words = line.split()
        if line.strip().startswith(label) and len(words) >= 3 and re.fullmatch(r"[\d.]+", words[-1]):
            return int(words[-2].replace(",", ""))
    return 0


def recompute_figures(summary: str) -> tuple[int, int]:
    """Extra FLOPs and the peak without recomputation, from the summary's recompute line."""
    match = re.search(r"\+([\d,]+) FLOPs; activations peak [\d,]+ \(without: ([\d,]+)", summary)
    if not match:
        return 0, 0
    return int(match.group(1).replace(",", "")), int(match.group(2).replace(",", ""))


def grouped(n: int) -> str:
    return f"{n:,}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", default="128")
    parser.add_argument("--micro-batch", default="8")
    parser.add_argument("--models", default="gpt2,llama")
    args = parser.parse_args()
    base = ["--seq-len", args.seq_len, "--micro-batch", args.micro_batch]
    with tempfile.TemporaryDirectory() as scratch:
        plan = Path(scratch) / "plan.atp"
        for model in args.models.split(","):
            print(f"\n### {model} (seq {args.seq_len}, micro-batch {args.micro_batch}, one rank)\n")
            print("| precision | parameters | gradients | optimizer state | activations peak | arena |")
            print("|---|---|---|---|---|---|")
            for precision in ["f32", "bf16", "fp16"]:
                s = compile_summary(model, base + ["--precision", precision], plan)
                cells = [figure(s, k) for k in ["parameters ", "gradients", "optimizer state ", "activations peak", "total arena"]]
                print(f"| {precision} | " + " | ".join(grouped(c) for c in cells) + " |")
            print("\n| bf16, recompute | extra FLOPs | activations peak | without | arena |")
            print("|---|---|---|---|---|")
            for mode in ["none", "elementwise", "selective", "full"]:
                s = compile_summary(model, base + ["--precision", "bf16", "--recompute", mode], plan)
                peak, arena = figure(s, "activations peak"), figure(s, "total arena")
                flops, without = recompute_figures(s) if mode != "none" else (0, peak)
                print(f"| {mode} | {grouped(flops)} | {grouped(peak)} | {grouped(without)} | {grouped(arena)} |")
            print("\n| bf16, offload optimizer | optimizer state in the arena | outside the arena | arena | host memory for it |")
            print("|---|---|---|---|---|")
            for offload in ["none", "cpu", "nvme"]:
                flags = base + ["--precision", "bf16", "--offload-optimizer", offload]
                if offload == "nvme":
                    flags += ["--nvme-path", scratch, "--sub-group-size", "30000", "--buffer-count", "2"]
                s = compile_summary(model, flags, plan)
                inside = figure(s, "optimizer state ")
                outside = figure(s, "optimizer state offloaded")
                host = outside if offload == "cpu" else 0
                match = re.search(r"([\d,]+) bytes in memory", s)
                if match:
                    host = int(match.group(1).replace(",", ""))
                print(f"| {offload} | {grouped(inside)} | {grouped(outside)} | {grouped(figure(s, 'total arena'))} | {grouped(host)} |")


if __name__ == "__main__":
    main()
