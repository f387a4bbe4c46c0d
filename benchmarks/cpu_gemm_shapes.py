"""GFLOP/s of the default model's linear layers on this CPU, every way pdserve could run them: ATen's
F.linear, oneDNN on the dense weight, oneDNN on its packed (reordered) weight (layers.PACKERS["onednn"]),
MKL's packed GEMM on Intel, and pdserve's own packed GEMM (model/csrc/cpu_linear.c) where the C kernels
build; at 1, 64 and 2,048 rows (a single decode, a 64-sequence decode step, a prefill step), beside a
4096^3 matmul (the machine's practical peak). The ways alternate call by call (the machine is shared and
noisy), and each call takes the next of several copies of the weight (about 200 MB of them per weight
format), so that at one row the weight comes from memory as in a decode step (537 MB of weights), not
from the cache (32 MiB of L3 here).

    .venv/bin/python benchmarks/cpu_gemm_shapes.py [--threads 2] [--rows 1,64,2048] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.model import cpu_kernels, layers

# (in_features, out_features) of SmolLM2-135M: fused qkv, o, fused gate_up, down, the tied LM head
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


WEIGHT_BYTES_PER_SHAPE = 200e6


def alternated_medians(fns: dict, repeats: int) -> dict:
    """Median seconds of each fn(i), the fns called in turn, the order rotated every round, two warm-up
    rounds. i counts every call, so that consecutive calls take different copies of a weight."""
    times = {name: [] for name in fns}
    names = list(fns)
    call = 0
    for r in range(repeats + 2):
        for j in range(len(names)):
            name = names[(j + r) % len(names)]
            start = time.perf_counter()
            fns[name](call)
            call += 1
            if r >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rows", default="1,64,2048", help="comma-separated batch rows (default 1,64,2048)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)
    peak = 2 * 4096 ** 3 / alternated_medians({"mm": lambda i: a @ b}, 3)["mm"] / 1e9
    print(f"matmul 4096^3: {peak:.1f} GFLOP/s")
    ways = {"aten": lambda x, w, packed: F.linear(x, w),
            "onednn": lambda x, w, packed: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")}
    packers = ["onednn"] + (["mkl"] if layers._intel_cpu() else []) + (["pdserve"] if cpu_kernels.available() else [])
    rows = []
    for name, (k, n) in SHAPES.items():
        copies = max(1, int(WEIGHT_BYTES_PER_SHAPE // (n * k * 4)))
        weights = [torch.randn(n, k) for _ in range(copies)]
        packed = {p_: [layers.PACKERS[p_][0](w) for w in weights] for p_ in packers}
        for m in row_counts:
            if name == "lm_head" and m > 64:
                continue   # logits are computed for each sequence's last token only
            x = torch.randn(m, k)
            fns = {way: (lambda i, fn=fn: fn(x, weights[i % copies], None)) for way, fn in ways.items()}
            for p_ in packers:
                run = layers.PACKERS[p_][1]
                fns[f"{p_}_packed"] = lambda i, run=run, p_=p_: run(x, packed[p_][i % copies], weights[i % copies], None)
            row = {"shape": name, "rows": m, "weight_copies": copies}
            for way, seconds in alternated_medians(fns, args.repeats).items():
                row[way] = round(2 * m * k * n / seconds / 1e9, 1)
            rows.append(row)
            print("  ".join(f"{key} {value}" for key, value in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "matmul_4096_gflops": round(peak, 1), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
