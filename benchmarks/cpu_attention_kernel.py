"""The CPU decode attention kernel alone, beside the memory floor: one decode step's attention for all
layers of the default model's shape (30 layers, 9 query / 3 KV heads of 64), scattered blocks.

    .venv/bin/python benchmarks/cpu_attention_kernel.py [--batch 64] [--context 276] [--out F.json]

Prints, for 1 thread and for every allowed core: the kernel, plain torch (the per-sequence gather + SDPA
the engine falls back to), one pass summing the whole KV cache (the bytes every kernel must read at
least once: the floor), and the kernel "hot": every sequence reading the first one's blocks, which stay
in the CPU's cache (its arithmetic alone, without the wait for memory).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from pdserve.model import cpu_kernels
from pdserve.model.attention import _prefill_attention
from pdserve.worker.cpu_memory import advise_huge_pages

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=276)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                   help="back the cache with 2 MiB pages where the kernel allows it, as the engine does")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the engine's block_size)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the kernel does not build here (see the warning above)")
    n, length, BLOCK = args.batch, args.context, args.block_size
    per_seq = -(-length // BLOCK)
    gen = torch.Generator().manual_seed(0)
    kv = torch.empty(n * per_seq + 1, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM)
    huge = advise_huge_pages(kv) if args.huge_pages else False   # as the engine's cache (worker/kv_cache.py)
    kv.normal_(generator=gen)
    tables = (torch.randperm(n * per_seq, generator=gen) + 1).to(torch.int32).view(n, per_seq)
    lens = torch.full((n,), length, dtype=torch.int32)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5

    def kernel():
        for layer in range(LAYERS):
            assert cpu_kernels.decode_attention(q, kv[:, layer], tables, lens, scale, out)

    hot_tables = tables[:1].expand(n, -1).contiguous()

    def kernel_hot():
        for layer in range(LAYERS):
            assert cpu_kernels.decode_attention(q, kv[:, layer], hot_tables, lens, scale, out)

    def plain_torch():
        for layer in range(LAYERS):
            kv_layer = kv[:, layer]
            for i in range(n):
                out[i:i + 1] = _prefill_attention(q[i:i + 1], kv_layer, tables[i], length, BLOCK, scale)

    kv_bytes = n * length * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    rows = []
    for threads in sorted({1, len(os.sched_getaffinity(0))}):
        torch.set_num_threads(threads)
        row = {"threads": threads, "kernel_ms": timed(kernel, args.repeats),
               "kernel_hot_ms": timed(kernel_hot, args.repeats),
               "torch_ms": timed(plain_torch, args.repeats),
               "sum_whole_cache_ms": timed(lambda: kv.sum(), args.repeats)}
        row["kernel_gb_per_s"] = round(kv_bytes / row["kernel_ms"] / 1e6, 1)
        rows.append(row)
        print(f"{threads} thread(s): kernel {row['kernel_ms']} ms ({row['kernel_gb_per_s']} GB/s of KV), plain torch "
              f"{row['torch_ms']} ms, one sum over the whole cache {row['sum_whole_cache_ms']} ms, kernel hot "
              f"{row['kernel_hot_ms']} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"batch": n, "context": length, "block_size": BLOCK, "huge_pages": huge,
                       "kv_bytes_read": kv_bytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
