"""The PyTorch side of benches/adamw_step.sh: torch.optim.AdamW's step (fused=True, and the
foreach implementation for reference) over the same f32 tensors as benches/adamw_step.rs, on
the same threads; then the table of both against autotp's JSON line.

    python benches/adamw_step.py AUTOTP_JSONL THREADS
"""
import json
import sys
import time

import torch


def step_seconds(tensors, elements, threads, **kind):
    torch.set_num_threads(threads)
    params = [torch.nn.Parameter(torch.full((elements,), 0.5)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full((elements,), 1e-2)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kind)
    opt.step()
    times = []
    for _ in range(21):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def main():
    ours = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    threads = int(sys.argv[2])
    print(f"AdamW step, f32, {threads} threads, median of 21 (torch {torch.__version__})")
    print(f"{'parameters':>12} {'autotp ms':>10} {'fused ms':>10} {'foreach ms':>11} {'fused/autotp':>13}")
    for row in ours:
        n = row["tensors"] * row["elements"]
        fused = step_seconds(row["tensors"], row["elements"], threads, fused=True)
        foreach = step_seconds(row["tensors"], row["elements"], threads, foreach=True)
        print(f"{n:>12,} {row['seconds'] * 1e3:>10.2f} {fused * 1e3:>10.2f} {foreach * 1e3:>11.2f} "
              f"{fused / row['seconds']:>13.2f}")


if __name__ == "__main__":
    main()
