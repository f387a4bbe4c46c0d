"""One layer's prefill attention on CPU, the default model's heads (9 query, 3 KV, head size 64): the C
kernel (model/csrc/cpu_prefill_attention.c) against itself with every task transposing its own key tiles
(pdserve_prefill_shared_keys_max_bytes = 0) and against the plain-torch path it replaced (index_select
gathers + SDPA), calls alternated, one prompt of each length, no cached prefix.

    .venv/bin/python benchmarks/cpu_prefill_attention.py [--lengths 64,256,1024,2048] [--out F.json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

from pdserve.model import cpu_kernels
from pdserve.model.attention import AttentionMetadata, paged_attention, paged_attention_reference


_KNOB = []


def own_tiles(call):
    """call() with every task transposing its own key tiles (the kernel before it shared them per head)."""
    if not _KNOB:
        _KNOB.append(ctypes.c_int64.in_dll(cpu_kernels._library(), "pdserve_prefill_shared_keys_max_bytes"))
    knob = _KNOB[0]
    saved, knob.value = knob.value, 0
    try:
        return call()
    finally:
        knob.value = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="64,256,1024,2048")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        blocks = -(-length // block_size)
        kv = torch.randn(blocks, 2, block_size, kv_heads, dim)
        table = torch.randperm(blocks).to(torch.int32)[None]
        q = torch.randn(length, (heads + 2 * kv_heads) * dim)[:, :heads * dim].view(length, heads, dim)
        md = AttentionMetadata(torch.tensor([0, length], dtype=torch.int32), torch.tensor([length], dtype=torch.int32),
                               table, torch.zeros(length, dtype=torch.long), [length], [length], block_size)
        ways = {"kernel": lambda: paged_attention(q, kv, md, dim ** -0.5),
                "kernel_task_transposes": lambda: own_tiles(lambda: paged_attention(q, kv, md, dim ** -0.5)),
                "torch": lambda: paged_attention_reference(q, kv, md, dim ** -0.5)}
        times = {name: [] for name in ways}
        for r in range(args.repeats + 2):
            for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                start = time.perf_counter()
                ways[name]()
                if r >= 2:
                    times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        flop = 4 * heads * dim * length * (length + 1) / 2   # QK^T and PV over the causal half
        row = {"length": length, "kernel_ms": round(ms["kernel"], 3),
               "kernel_task_transposes_ms": round(ms["kernel_task_transposes"], 3), "torch_ms": round(ms["torch"], 3),
               "speedup": round(ms["torch"] / ms["kernel"], 2), "kernel_gflops": round(flop / ms["kernel"] / 1e6, 1)}
        rows.append(row)
        print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
