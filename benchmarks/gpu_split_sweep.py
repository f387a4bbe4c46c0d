"""Split-K decode attention at small batches, across context lengths: splits x tiles.

    PYTHONPATH=$PWD python3 benchmarks/gpu_split_sweep.py --out-dir $OUT [--time-limit 240]

At batch 1-4 the decode kernel splits each sequence's keys over NUM_SPLITS programs per KV head and a
second kernel merges them. The split count is fixed per batch size (a captured graph serves any
context), so a split walks ceil(tiles / splits) tiles: one at 2,048 tokens with 16 splits of 128-token
tiles, two from 2,049 on. This sweep times every (splits, tile config) at contexts around and past
that step. Each time is a CUDA graph of 32 calls on 32 distinct layers' caches (as a decode step
reads them: the KV of one layer is not in L2 when the next reads its own), per layer. Llama-3.1-8B
attention shape, bf16, blocks of 16 scattered at random. Writes gpu-split-sweep-<date>.json.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from gpu_attention_sweep import BLOCK, DIM, KV_HEADS, setup
from gpu_bench import HBM_BYTES_PER_S, graph_median, machine, print_rows, today, write_json

LAYERS = 32
CONFIGS = [{"BLOCK_N": 128, "num_warps": 2, "num_stages": 1},
           {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
           {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
           {"BLOCK_N": 64, "num_warps": 2, "num_stages": 1}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--contexts", default="1024,2048,2064,3072,4096,8192,16384")
    parser.add_argument("--splits", default="16,32,64")
    parser.add_argument("--time-limit", type=float, default=240.0)
    args = parser.parse_args()
    from pdserve.model import triton_attention as ta
    deadline = time.time() + args.time_limit
    chosen_config = ta.decode_launch_config
    rows = []
    try:
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                q, cache, md, _, kv_bytes = setup(batch, "NHD", context, LAYERS)
                now_splits = ta.decode_num_splits(batch, KV_HEADS, ta.num_sms(q.device))
                now_cfg = chosen_config(now_splits, False)
                for splits in map(int, args.splits.split(",")):
                    for cfg in CONFIGS:
                        if time.time() > deadline:
                            raise TimeoutError
                        ta.decode_launch_config = lambda s, ieee, cfg=cfg: dict(cfg)

                        def run():
                            for layer in range(LAYERS):
                                ta.paged_attention_triton(q, cache[:, layer], md.query_start_loc, md.seq_lens,
                                                          md.block_tables, BLOCK, DIM ** -0.5, 1, splits)
                        t = graph_median(run, 20) / LAYERS
                        rows.append({"batch": batch, "context": context, "splits": splits, **cfg,
                                     "chosen_now": splits == now_splits and cfg == now_cfg,
                                     "us_per_layer": t * 1e6, "kv_tbps": kv_bytes / t / 1e12,
                                     "hbm_bound_us": kv_bytes / HBM_BYTES_PER_S * 1e6})
                best = min((r for r in rows if r["batch"] == batch and r["context"] == context),
                           key=lambda r: r["us_per_layer"])
                print(f"batch {batch} context {context}: best {best['splits']} splits {best['BLOCK_N']}/"
                      f"{best['num_warps']}/{best['num_stages']} {best['us_per_layer']:.2f} us", flush=True)
    except TimeoutError:
        print("time limit reached", flush=True)
    finally:
        ta.decode_launch_config = chosen_config
    print_rows("split-K decode attention per layer (graph of 32 layers)", rows)
    write_json(args.out_dir, f"gpu-split-sweep-{today()}.json",
               {"date": today(), "machine": machine(), "configs": CONFIGS, "rows": rows})


if __name__ == "__main__":
    main()
