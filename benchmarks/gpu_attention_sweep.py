"""Decode attention on one GPU: KV cache layout x tile configuration, against the HBM bound.

    PYTHONPATH=$PWD python3 benchmarks/gpu_attention_sweep.py --out-dir $OUT [--time-limit 240]

Layouts of one block's K (and V) for one layer:
  NHD  [slots, kv_heads, dim]  (pdserve up to 2026-11-29): a (sequence, kv head) program reads 256-byte rows
                               2 KiB apart
  HND  [kv_heads, slots, dim]: the same program reads one contiguous 4 KiB run per block
Both keep a block contiguous across layers ([blocks, layers, 2, ...]), so the handoff is unchanged. The
kernel reads the cache by strides, so HND is passed as a permuted view of a contiguous HND tensor.

Phase 1 times every configuration at batch 64 and 256 (one program per sequence and kv head); phase 2 the
best few at batch 1 and 16 (split-K). Each time is a CUDA graph of one call per layer, over as many layers as
make the KV read exceed the 50 MB L2, divided by the layer count. Llama-3.1-8B attention shape, bf16,
2,048-token contexts, blocks of 16 scattered at random. A device-to-device copy gives the attainable
bandwidth for scale. Writes gpu-attention-sweep-<date>.json.
"""
from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from gpu_bench import HBM_BYTES_PER_S, gpu_median, graph_median, machine, print_rows, today, write_json

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
CONTEXT = 2048


def make_cache(layout: str, num_blocks: int, layers: int) -> torch.Tensor:
    """[blocks, layers, 2, slots, kv_heads, dim] logical shape, in the given memory order."""
    if layout == "NHD":
        return torch.randn(num_blocks, layers, 2, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    hnd = torch.randn(num_blocks, layers, 2, KV_HEADS, BLOCK, DIM, dtype=torch.bfloat16, device="cuda")
    return hnd.permute(0, 1, 2, 4, 3, 5)


def setup(batch: int, layout: str, context: int = CONTEXT, layers: int | None = None):
    """q, a cache of `layers` layers' K/V (default: enough for > 8x the L2 per graph replay), decode
    metadata for `batch` sequences of `context` tokens on scattered blocks, the layer count, KV bytes
    per layer."""
    from pdserve.model.attention import AttentionMetadata
    per_seq = -(-context // BLOCK)
    kv_layer_bytes = batch * context * 2 * KV_HEADS * DIM * 2
    if layers is None:
        layers = max(1, min(32, -(-400_000_000 // kv_layer_bytes)))
    num_blocks = batch * per_seq + 1
    perm = (torch.randperm(num_blocks - 1) + 1).to(torch.int32)
    tables = perm.view(batch, per_seq).cuda()
    cache = make_cache(layout, num_blocks, layers)
    md = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        block_tables=tables, slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        query_lens_cpu=[1] * batch, seq_lens_cpu=[context] * batch, block_size=BLOCK)
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    return q, cache, md, layers, kv_layer_bytes


def time_config(ta, q, cache, md, layers, splits=None) -> float:
    def run():
        for i in range(layers):
            ta.paged_attention_triton(q, cache[:, i], md.query_start_loc, md.seq_lens, md.block_tables, BLOCK,
                                      DIM ** -0.5, 1, splits)
    return graph_median(run, 15) / layers


def copy_and_read_bandwidth() -> tuple[float, float]:
    """Bytes/s of a 2 GiB device copy (read + write counted) and of a 2 GiB sum (read only)."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t_copy = gpu_median(lambda: b.copy_(a), 10)
    floats = a.view(torch.float32)
    t_read = gpu_median(lambda: floats.sum(), 10)
    return 2 * a.numel() / t_copy, a.numel() / t_read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--time-limit", type=float, default=240.0, help="stop starting new configurations after this")
    parser.add_argument("--top", type=int, default=6, help="configurations carried to the small-batch phase")
    parser.add_argument("--block-n", default="16,32,64", help="KV tile lengths to try (comma-separated)")
    parser.add_argument("--warps", default="4,8", help="num_warps values to try")
    parser.add_argument("--stages", default="2,3,4", help="num_stages values to try")
    parser.add_argument("--layouts", default="NHD,HND")
    args = parser.parse_args()
    from pdserve.model import triton_attention as ta
    from pdserve.model.attention import paged_attention_reference
    start = time.monotonic()
    default, default_split = dict(ta.DECODE_CONFIG), dict(ta.DECODE_SPLIT_CONFIG)
    copy, read = copy_and_read_bandwidth()
    result = {"date": today(), "machine": machine(), "context": CONTEXT,
              "shape": "Llama-3.1-8B attention: 32 heads, 8 kv heads, d 128, block 16, bf16",
              "copy_tbps": copy / 1e12, "read_tbps": read / 1e12, "hbm_bound_tbps": HBM_BYTES_PER_S / 1e12,
              "default_config": default, "default_split_config": default_split, "rows": []}
    print(f"device copy: {result['copy_tbps']:.2f} TB/s, read-only sum: {result['read_tbps']:.2f} TB/s")
    configs = [{"BLOCK_N": n, "num_warps": w, "num_stages": s}
               for n, w, s in itertools.product(*(map(int, v.split(",")) for v in (args.block_n, args.warps, args.stages)))]
    layouts = tuple(args.layouts.split(","))

    def measure(layout, cfg, batch, state):
        q, cache, md, layers, layer_bytes = state
        ta.DECODE_CONFIG = ta.DECODE_SPLIT_CONFIG = cfg  # batch 1 and 16 run split-K
        try:
            t = time_config(ta, q, cache, md, layers)
        except Exception as e:  # a configuration that does not fit (shared memory, registers): recorded, skipped
            row = {"layout": layout, **cfg, "batch": batch, "error": repr(e)[:200]}
        else:
            row = {"layout": layout, **cfg, "batch": batch, "us_per_layer": t * 1e6,
                   "kv_tbps": layer_bytes / t / 1e12, "over_hbm_bound": t / (layer_bytes / HBM_BYTES_PER_S)}
        result["rows"].append(row)
        print_rows("", [row])
        return row

    try:
        # Correctness of every layout with the default tiles, against the torch reference.
        for layout in layouts:
            q, cache, md, _, _ = setup(16, layout)
            ta.DECODE_CONFIG, ta.DECODE_SPLIT_CONFIG = default, default_split
            ref = paged_attention_reference(q, cache[:, 0], md, DIM ** -0.5)
            out = ta.paged_attention_triton(q, cache[:, 0], md.query_start_loc, md.seq_lens, md.block_tables,
                                            BLOCK, DIM ** -0.5, 1)
            result[f"rel_err_{layout}"] = float((out.float() - ref.float()).norm() / ref.float().norm())
            del cache
        phase1: dict[tuple, float] = {}
        for layout in layouts:
            for batch in (256, 64):
                state = setup(batch, layout)
                for cfg in configs:
                    if time.monotonic() - start > args.time_limit:
                        raise TimeoutError("time limit")
                    row = measure(layout, cfg, batch, state)
                    if "us_per_layer" in row:
                        key = (layout, tuple(cfg.items()))
                        phase1[key] = phase1.get(key, 0.0) + row["us_per_layer"] * (1 if batch == 256 else 4)
                del state
                torch.cuda.empty_cache()
        ranked = sorted(phase1, key=phase1.get)
        result["phase1_ranking"] = [{"layout": k[0], **dict(k[1]), "score_us": phase1[k]} for k in ranked]
        carried = ranked[:args.top] + [(layout, tuple(default.items())) for layout in layouts
                                       if (layout, tuple(default.items())) not in ranked[:args.top]]
        for batch in (1, 16):
            for layout in layouts:
                state = setup(batch, layout)
                for key in carried:
                    if key[0] == layout:
                        if time.monotonic() - start > args.time_limit:
                            raise TimeoutError("time limit")
                        measure(layout, dict(key[1]), batch, state)
                del state
    except TimeoutError:
        result["stopped"] = f"time limit {args.time_limit} s"
    finally:
        ta.DECODE_CONFIG, ta.DECODE_SPLIT_CONFIG = default, default_split
        write_json(args.out_dir, f"gpu-attention-sweep-{today()}.json", result)


if __name__ == "__main__":
    main()
