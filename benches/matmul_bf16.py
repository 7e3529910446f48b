"""The PyTorch side of benches/matmul_bf16.sh: torch.matmul on bf16 tensors of the shapes (and
transposes) benches/matmul_bf16.rs timed, on the same threads, median of 11 after a warm-up;
then the table of both.

    python benches/matmul_bf16.py AUTOTP_JSONL THREADS
"""
import json
import sys
import time

import torch


def torch_ms(row, threads):
    torch.set_num_threads(threads)
    b, m, k, n = row["batch"], row["m"], row["k"], row["n"]
    lhs = torch.rand((b, k, m) if row["transpose_lhs"] else (b, m, k), dtype=torch.bfloat16) - 0.5
    rhs_batch = b if row["rhs_batched"] else 1
    rhs = torch.rand((rhs_batch, n, k) if row["transpose_rhs"] else (rhs_batch, k, n), dtype=torch.bfloat16) - 0.5
    a = lhs.transpose(1, 2) if row["transpose_lhs"] else lhs
    w = rhs.transpose(1, 2) if row["transpose_rhs"] else rhs
    torch.matmul(a, w)
    times = []
    for _ in range(11):
        start = time.perf_counter()
        torch.matmul(a, w)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3


def main():
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    threads = int(sys.argv[2])
    print(f"bf16 matmul, {threads} threads, median of 11 (torch {torch.__version__}; autotp native bf16: "
          f"{rows[0]['native'] if rows else '?'})")
    print("| product | batch x m x k x n | autotp bf16 ms | torch bf16 ms | torch / autotp |")
    print("|---|---|---|---|---|")
    for row in rows:
        ours = row["native_ms"]
        theirs = torch_ms(row, threads)
        shape = f"{row['batch']} x {row['m']} x {row['k']} x {row['n']}"
        print(f"| {row['name']} | {shape} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f} |")


if __name__ == "__main__":
    main()
