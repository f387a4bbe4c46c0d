"""GFLOP/s of the default model's linear layers on this CPU, three ways: ATen's F.linear, oneDNN on the
dense weight, oneDNN on its packed (reordered) weight (layers.PACKERS["onednn"]), and MKL's packed GEMM on
Intel; at 1, 64 and 2,048 rows (a single decode, a 64-sequence decode step, a prefill step), beside a
4096^3 matmul (the machine's practical peak).

    .venv/bin/python benchmarks/cpu_gemm_shapes.py [--threads 2] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.model import layers

# (in_features, out_features) of SmolLM2-135M: fused qkv, o, fused gate_up, down, the tied LM head
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def median_s(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)
    peak = 2 * 4096 ** 3 / median_s(lambda: a @ b, 3) / 1e9
    print(f"matmul 4096^3: {peak:.1f} GFLOP/s")
    ways = {"aten": lambda x, w, packed: F.linear(x, w),
            "onednn": lambda x, w, packed: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")}
    packers = ["onednn"] + (["mkl"] if layers._intel_cpu() else [])
    rows = []
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k)
        packed = {p_: layers.PACKERS[p_][0](w) for p_ in packers}
        for m in (1, 64, 2048):
            if name == "lm_head" and m > 64:
                continue   # logits are computed for each sequence's last token only
            x = torch.randn(m, k)
            row = {"shape": name, "rows": m}
            for way, fn in ways.items():
                row[way] = round(2 * m * k * n / median_s(lambda: fn(x, w, None), args.repeats) / 1e9, 1)
            for p_ in packers:
                run = layers.PACKERS[p_][1]
                row[f"{p_}_packed"] = round(
                    2 * m * k * n / median_s(lambda: run(x, packed[p_], w, None), args.repeats) / 1e9, 1)
            rows.append(row)
            print("  ".join(f"{key} {value}" for key, value in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "matmul_4096_gflops": round(peak, 1), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
