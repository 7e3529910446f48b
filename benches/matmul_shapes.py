"""Benchmark, PyTorch's side: the matmul shapes benches/matmul_shapes.rs printed (one JSON line
each, with autotp's median seconds), timed with torch.matmul on the same shapes, transposes
(strided views, as the step reads them) and threads; prints the table.

    python benches/matmul_shapes.py SHAPES.jsonl THREADS
"""
import json
import statistics
import sys
import time

import torch

REPEATS = 21


def torch_seconds(s):
    lhs_rows, lhs_cols = (s["k"], s["m"]) if s["transpose_lhs"] else (s["m"], s["k"])
    rhs_rows, rhs_cols = (s["n"], s["k"]) if s["transpose_rhs"] else (s["k"], s["n"])
    lhs = torch.rand(*s["lhs_batch"], lhs_rows, lhs_cols) - 0.5
    rhs = torch.rand(*s["rhs_batch"], rhs_rows, rhs_cols) - 0.5
    lhs = lhs.mT if s["transpose_lhs"] else lhs
    rhs = rhs.mT if s["transpose_rhs"] else rhs
    out = torch.empty(*s["batch"], s["m"], s["n"])
    torch.matmul(lhs, rhs, out=out)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        torch.matmul(lhs, rhs, out=out)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    path, threads = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(threads)
    shapes = [json.loads(line) for line in open(path) if line.startswith("{")]
    print(f"{threads} threads; GFLOP/s of one call (median of {REPEATS}); 'calls' per training step")
    print(f"{'model':<11} {'batch':>10} {'m':>5} {'k':>5} {'n':>5} {'T':>2} {'calls':>5} "
          f"{'autotp':>8} {'pytorch':>8} {'ratio':>6}")
    totals = {}
    for s in shapes:
        t = torch_seconds(s)
        flops = 2 * s["m"] * s["k"] * s["n"]
        for b in s["batch"]:
            flops *= b
        flags = ("t" if s["transpose_lhs"] else "n") + ("t" if s["transpose_rhs"] else "n")
        batch = "x".join(map(str, s["batch"])) or "-"
        print(f"{s['model']:<11} {batch:>10} {s['m']:>5} {s['k']:>5} {s['n']:>5} {flags:>2} {s['count']:>5} "
              f"{flops / s['seconds'] / 1e9:8.1f} {flops / t / 1e9:8.1f} {t / s['seconds']:6.2f}")
        a, p, f = totals.get(s["model"], (0.0, 0.0, 0))
        totals[s["model"]] = (a + s["count"] * s["seconds"], p + s["count"] * t, f + s["count"] * flops)
    print()
    print(f"{'model':<11} {'ms autotp':>10} {'ms pytorch':>11} {'GFLOP/s a/p':>14} {'speed a/p':>10}")
    for model, (a, p, f) in totals.items():
        print(f"{model:<11} {a * 1e3:10.2f} {p * 1e3:11.2f} {f / a / 1e9:6.1f}/{f / p / 1e9:<7.1f} {p / a:10.2f}")


main()
