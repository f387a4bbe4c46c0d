"""Decode attention over contexts of unequal lengths: does a step last as long as its longest sequence?

    PYTHONPATH=$PWD python3 benchmarks/gpu_decode_mixed.py --out-dir $OUT [--time-limit 200]

The decode kernel runs (sequence, KV head, split) programs with a split count fixed per batch size
(model/triton_attention.py decode_num_splits: about two waves over the SMs), so when the contexts of a
batch differ, the programs of the longest sequences finish last. The planner's step profile measured
only batches whose sequences all had the same length (docs/planner.md, "Why TPOT was low"). Here, per
batch size, three context mixes of the same total: all equal (the mean), uniform over [lo, hi] (the
prefill-heavy workload's prompts: 5,120 +- 60 %), and half lo / half hi; each at the chosen split count
and at 2x, 4x, 8x it. Llama-3.1-8B attention shape, bf16, blocks of 16 scattered at random; each time is a
CUDA graph of one call per distinct layer cache (the KV is not in L2 when the next layer reads it), per
layer. Writes gpu-decode-mixed-<date>.json.
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from gpu_attention_sweep import BLOCK, DIM, HEADS, KV_HEADS, make_cache
from gpu_bench import HBM_BYTES_PER_S, graph_median, machine, print_rows, today, write_json


def mixes(batch: int, lo: int, hi: int, rng: random.Random) -> dict[str, list[int]]:
    uniform = [rng.randint(lo, hi) for _ in range(batch)]
    mean = sum(uniform) // batch
    half = [lo] * (batch // 2) + [hi] * (batch - batch // 2)
    return {"equal": [mean] * batch, "uniform": uniform, "bimodal": half,
            "equal-bimodal-mean": [sum(half) // batch] * batch}


def setup(contexts: list[int]):
    from pdserve.model.attention import AttentionMetadata
    batch = len(contexts)
    per_seq = [-(-c // BLOCK) for c in contexts]
    width = max(per_seq)
    kv_layer_bytes = sum(contexts) * 2 * KV_HEADS * DIM * 2
    layers = max(1, min(16, -(-400_000_000 // kv_layer_bytes)))
    num_blocks = sum(per_seq) + 1
    perm = (torch.randperm(num_blocks - 1) + 1).to(torch.int32)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[start:start + n]
        start += n
    cache = make_cache("NHD", num_blocks, layers)
    md = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(contexts, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(), slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        query_lens_cpu=[1] * batch, seq_lens_cpu=list(contexts), block_size=BLOCK)
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    return q, cache, md, layers, kv_layer_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--batches", default="4,8,16,24,32,48,64,96,128")
    parser.add_argument("--lo", type=int, default=2048)
    parser.add_argument("--hi", type=int, default=8192)
    parser.add_argument("--split-factors", default="1,2,4,8", help="multiples of the chosen split count")
    parser.add_argument("--time-limit", type=float, default=200.0)
    args = parser.parse_args()
    from pdserve.model import triton_attention as ta
    deadline = time.time() + args.time_limit
    rng = random.Random(0)
    rows = []
    try:
        for batch in map(int, args.batches.split(",")):
            for name, contexts in mixes(batch, args.lo, args.hi, rng).items():
                q, cache, md, layers, kv_bytes = setup(contexts)
                chosen = ta.decode_num_splits(batch, KV_HEADS, ta.num_sms(q.device))
                for factor in map(int, args.split_factors.split(",")):
                    splits = chosen * factor
                    if splits > ta.MAX_SPLITS or time.time() > deadline:
                        continue

                    def run():
                        for layer in range(layers):
                            ta.paged_attention_triton(q, cache[:, layer], md.query_start_loc, md.seq_lens,
                                                      md.block_tables, BLOCK, DIM ** -0.5, 1, splits)
                    t = graph_median(run, 20) / layers
                    rows.append({"batch": batch, "mix": name, "sum_context": sum(contexts),
                                 "max_context": max(contexts), "splits": splits, "chosen": factor == 1,
                                 "us_per_layer": t * 1e6, "kv_tbps": kv_bytes / t / 1e12,
                                 "hbm_bound_us": kv_bytes / HBM_BYTES_PER_S * 1e6})
                    print(rows[-1], flush=True)
                del cache
                torch.cuda.empty_cache()
            if time.time() > deadline:
                print("time limit reached", flush=True)
                break
    finally:
        print_rows("decode attention per layer, mixed contexts", rows)
        write_json(args.out_dir, f"gpu-decode-mixed-{today()}.json",
                   {"date": today(), "machine": machine(), "lo": args.lo, "hi": args.hi, "rows": rows})


if __name__ == "__main__":
    main()
