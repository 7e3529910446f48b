"""The PyTorch side of benches/adamw_step.sh: torch.optim.AdamW(fused=True)'s step over the
same f32 tensors as benches/adamw_step.rs, on the same threads; and the table of both sides
over the script's alternating rounds.

    python benches/adamw_step.py time TENSORS ELEMENTS THREADS   # one JSON line, as the Rust side's
    python benches/adamw_step.py table RESULTS_JSONL             # the table of every round's lines
"""
import json
import statistics
import sys
import time

REPEATS = 21
# Bytes an AdamW step moves per f32 parameter: parameter, gradient and two moments read;
# parameter and moments written.
BYTES_PER_PARAMETER = 28


def step_seconds(tensors, elements, threads):
    import torch

    torch.set_num_threads(threads)
    params = [torch.nn.Parameter(torch.full((elements,), 0.5)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full((elements,), 1e-2)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    opt.step()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times), torch.__version__


def time_step(tensors, elements, threads):
    seconds, version = step_seconds(tensors, elements, threads)
    print(json.dumps({"impl": "torch", "version": version, "tensors": tensors, "elements": elements,
                      "threads": threads, "seconds": seconds}))


def table(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    # Each round holds one line of each side per size: pair them in the order they were written.
    sizes = sorted({(r["tensors"] * r["elements"], r["threads"]) for r in rows})
    version = next((r["version"] for r in rows if r["impl"] == "torch"), "?")
    print(f"AdamW step, f32, torch {version} fused=True, median of {REPEATS} steps per round; "
          "ratio = torch / autotp of the same round (above 1: autotp faster)")
    print(f"{'parameters':>12} {'threads':>7} {'rounds':>6} {'autotp ms':>10} {'torch ms':>9} "
          f"{'autotp GB/s':>11} {'torch GB/s':>10} {'ratio median':>12} {'ratio range':>12} {'autotp faster':>13}")
    for n, threads in sizes:
        ours = [r["seconds"] for r in rows if r["impl"] == "autotp" and (r["tensors"] * r["elements"], r["threads"]) == (n, threads)]
        theirs = [r["seconds"] for r in rows if r["impl"] == "torch" and (r["tensors"] * r["elements"], r["threads"]) == (n, threads)]
        ratios = [t / a for a, t in zip(ours, theirs)]
        if not ratios:
            continue
        a, t = statistics.median(ours), statistics.median(theirs)
        print(f"{n:>12,} {threads:>7} {len(ratios):>6} {a * 1e3:>10.2f} {t * 1e3:>9.2f} "
              f"{n * BYTES_PER_PARAMETER / a / 1e9:>11.1f} {n * BYTES_PER_PARAMETER / t / 1e9:>10.1f} "
              f"{statistics.median(ratios):>12.2f} {f'{min(ratios):.2f}-{max(ratios):.2f}':>12} "
              f"{f'{sum(r > 1 for r in ratios)} of {len(ratios)}':>13}")


def main():
    match sys.argv[1:]:
        case ["time", tensors, elements, threads]:
            time_step(int(tensors), int(elements), int(threads))
        case ["table", path]:
            table(path)
        case _:
            sys.exit(__doc__)


if __name__ == "__main__":
    main()
