"""The PyTorch side of benches/adamw_step.sh: torch.optim.AdamW(fused=True)'s step over the
same f32 tensors as benches/adamw_step.rs, on the same threads; and the table of both sides
over the script's alternating rounds.

    python benches/adamw_step.py time LAYOUT SIZES THREADS  # one JSON line, as the Rust side's
    python benches/adamw_step.py table RESULTS_JSONL        # the table of every round's lines

SIZES: each parameter's elements, comma-separated; LAYOUT: its name in the table.
"""
import json
import statistics
import sys
import time

REPEATS = 21
# Bytes an AdamW step moves per f32 parameter: parameter, gradient and two moments read;
# parameter and moments written.
BYTES_PER_PARAMETER = 28


def step_seconds(sizes, threads):
    import torch

    torch.set_num_threads(threads)
    params = [torch.nn.Parameter(torch.full((n,), 0.5)) for n in sizes]
    for p in params:
        p.grad = torch.full((p.numel(),), 1e-2)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    opt.step()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times), torch.__version__


def time_step(layout, sizes, threads):
    seconds, version = step_seconds(sizes, threads)
    print(json.dumps({"layout": layout, "impl": "torch", "version": version, "tensors": len(sizes),
                      "parameters": sum(sizes), "threads": threads, "seconds": seconds}))


def table(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    cases = list(dict.fromkeys((r["layout"], r["threads"]) for r in rows))
    version = next((r["version"] for r in rows if r["impl"] == "torch"), "?")
    print(f"AdamW step, f32, torch {version} fused=True, median of {REPEATS} steps per round; "
          "ratio = torch / autotp of the same round (above 1: autotp faster)")
    print(f"{'layout':>10} {'parameters':>12} {'tensors':>7} {'threads':>7} {'rounds':>6} {'autotp ms':>10} "
          f"{'torch ms':>9} {'autotp GB/s':>11} {'torch GB/s':>10} {'ratio median':>12} {'ratio range':>12} "
          f"{'autotp faster':>13}")
    for layout, threads in cases:
        here = [r for r in rows if (r["layout"], r["threads"]) == (layout, threads)]
        # Each round wrote one line of each side: pair them in the order they were written.
        ours = [r["seconds"] for r in here if r["impl"] == "autotp"]
        theirs = [r["seconds"] for r in here if r["impl"] == "torch"]
        ratios = [t / a for a, t in zip(ours, theirs)]
        if not ratios:
            continue
        n, tensors = here[0]["parameters"], here[0]["tensors"]
        a, t = statistics.median(ours), statistics.median(theirs)
        print(f"{layout:>10} {n:>12,} {tensors:>7} {threads:>7} {len(ratios):>6} {a * 1e3:>10.2f} {t * 1e3:>9.2f} "
              f"{n * BYTES_PER_PARAMETER / a / 1e9:>11.1f} {n * BYTES_PER_PARAMETER / t / 1e9:>10.1f} "
              f"{statistics.median(ratios):>12.2f} {f'{min(ratios):.2f}-{max(ratios):.2f}':>12} "
              f"{f'{sum(r > 1 for r in ratios)} of {len(ratios)}':>13}")


def main():
    match sys.argv[1:]:
        case ["time", layout, sizes, threads]:
            time_step(layout, [int(n) for n in sizes.split(",")], int(threads))
        case ["table", path]:
            table(path)
        case _:
            sys.exit(__doc__)


if __name__ == "__main__":
    main()
