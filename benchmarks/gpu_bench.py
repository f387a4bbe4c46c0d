"""pdserve on one GPU against the roofline: attention kernels, decode step, prefill MFU, offline throughput
beside Hugging Face transformers. Llama-3.1-8B shape, bf16, random weights built on the GPU.

    PYTHONPATH=$PWD python3 benchmarks/gpu_bench.py all --out-dir benchmarks/results
    PYTHONPATH=$PWD python3 benchmarks/gpu_bench.py decode,prefill,offline [--quick]
    PDSERVE_FUSE_SMALL_OPS=0 ... for the model without the fused norms/SwiGLU (see model/layers.py)

Each stage prints a table and writes <out-dir>/gpu-<stage>-<date>.json, and updates gpu-summary.json
(the figures of the stages run now replace the previous ones; the others are kept). Ceilings (measured on this machine, shared/GPU.md): HBM 4.3e12 B/s (device copy,
read + write), bf16 dense matmul 800e12 FLOP/s (8192^3).

Formulas (also written into each JSON):
  decode roofline  = (weight bytes read + KV bytes read) / 4.3e12 B/s
                     weight bytes: every parameter but the embedding table (only n rows of it are read);
                     KV bytes: n * context * layers * 2 * kv_heads * head_dim * 2 B
  prefill FLOPs    = 2 * N_layers * T                      (matmuls of the decoder layers, N_layers params)
                   + 2 * N_lm_head * num_sampled_rows      (logits only for the last token of a prompt)
                   + 4 * L * H * d * sum_t ctx(t)           (QK^T and PV, causal: token t sees ctx(t) keys)
                     (the nanoGPT/PaLM MFU count, with the attention term counted causally, not T^2)
  MFU              = prefill FLOPs / time / 800e12
  offline roofline = sum(prefill FLOPs) / 800e12 + sum over steps with decodes (weight bytes + KV bytes the
                     decodes read) / 4.3e12, over the schedule the engine actually ran (recorded per step);
                     a stricter per-step figure, sum over steps of max(FLOPs / 800e12, bytes / 4.3e12), too.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
import statistics
import time
import warnings
from pathlib import Path

import torch

HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS_PER_S = 800e12
MODEL = "llama-3.1-8b"
RESULTS = Path(__file__).resolve().parent / "results"


# -- helpers -------------------------------------------------------------------------------------

def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def machine() -> str:
    import triton
    props = torch.cuda.get_device_properties(0)
    return (f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB), "
            f"torch {torch.__version__}, triton {triton.__version__}")


def write_json(out_dir: Path, name: str, data: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}", flush=True)


def wall_median(fn, iters: int, warmup: int = 2) -> float:
    """Median wall seconds of fn() with a device sync after each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gpu_median(fn, iters: int, warmup: int = 2) -> float:
    """Median seconds of fn() between CUDA events (device time, no host overhead)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def timed_steps(engine, steps: int) -> float:
    """Wall seconds per EngineCore.step() over `steps` consecutive steps, from a device sync to one
    after the last: with async scheduling the window then holds the GPU time of exactly `steps` steps."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def graph_median(run, iters: int) -> float:
    """Median seconds of one replay of a CUDA graph of run() (run once before capture: compiles,
    workspaces). Kernels shorter than their launch from Python must be timed this way."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    try:
        return gpu_median(graph.replay, iters)
    finally:
        del graph


class Shape:
    """Byte and FLOP counts of a model (see the module docstring)."""

    def __init__(self, model) -> None:
        cfg = model.config
        self.num_layers, self.num_heads, self.head_dim = cfg.num_layers, cfg.num_heads, cfg.head_dim
        self.num_kv_heads, self.hidden, self.vocab = cfg.num_kv_heads, cfg.hidden_size, cfg.vocab_size
        elem = model.embed_tokens.weight.element_size()
        self.layer_params = sum(p.numel() for n, p in model.named_parameters()
                                if n.startswith("layers.") or n.startswith("norm."))
        self.lm_head_params = self.vocab * self.hidden
        self.weight_bytes = (self.layer_params + self.lm_head_params) * elem
        self.kv_bytes_per_token = self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    def decode_bytes(self, context_lens: list[int]) -> float:
        return self.weight_bytes + sum(context_lens) * self.kv_bytes_per_token

    def prefill_flops(self, chunks: list[tuple[int, int]], num_sampled: int) -> float:
        """chunks: (num_cached, num_new) per sequence."""
        tokens = sum(new for _, new in chunks)
        ctx_sum = sum(new * cached + new * (new + 1) // 2 for cached, new in chunks)
        return (2 * self.layer_params * tokens + 2 * self.lm_head_params * num_sampled
                + 4 * self.num_layers * self.num_heads * self.head_dim * ctx_sum)


def make_runner(num_blocks: int, max_model_len: int, enforce_eager: bool = False):
    from pdserve.config import CacheConfig, ModelConfig
    from pdserve.worker.model_runner import ModelRunner
    mc = ModelConfig(model=MODEL, dtype="bfloat16", device="cuda", load_format="dummy",
                     max_model_len=max_model_len)
    return ModelRunner(mc, CacheConfig(block_size=16), num_blocks=num_blocks, enforce_eager=enforce_eager)


def scheduled(request_id: str, token_ids: list[int], num_computed: int, block_ids: list[int]):
    from pdserve.core.batch import ScheduledRequest
    from pdserve.sampling_params import SamplingParams
    return ScheduledRequest(request_id, token_ids, num_computed, block_ids,
                            SamplingParams(temperature=0.0), True)


def count_syncs(fn) -> int:
    """How many synchronizing CUDA calls fn() makes (torch's sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


# -- stage: attention kernels --------------------------------------------------------------------

def paged_setup(lens: list[tuple[int, int]], heads=32, kv_heads=8, dim=128, block_size=16, layers=2):
    """Random K/V in a [blocks, layers, 2, slots, heads, dim] cache (layer 1 used), random q, metadata."""
    from pdserve.model.attention import AttentionMetadata
    gen_blocks = [list(range(1 + sum(-(-s // block_size) for _, s in lens[:i]),
                             1 + sum(-(-s // block_size) for _, s in lens[:i + 1]))) for i in range(len(lens))]
    num_blocks = 1 + sum(len(b) for b in gen_blocks)
    perm = torch.randperm(num_blocks - 1) + 1  # scattered blocks
    tables = [[int(perm[b - 1]) for b in blocks] for blocks in gen_blocks]
    cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    width = max(len(t) for t in tables)
    starts = [0]
    for q, _ in lens:
        starts.append(starts[-1] + q)
    md = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32, device="cuda"),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda"),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device="cuda"),
        query_lens_cpu=[q for q, _ in lens], seq_lens_cpu=[s for _, s in lens], block_size=block_size)
    q = torch.randn(starts[-1], heads, dim, dtype=torch.bfloat16, device="cuda")
    return q, cache[:, 1], md


def bench_kernels(quick: bool) -> dict:
    from pdserve.model import triton_attention as ta
    from pdserve.model.attention import paged_attention_reference
    scale = 128 ** -0.5

    def triton_fn(q, kv, md, splits=None):
        return lambda: ta.paged_attention_triton(q, kv, md.query_start_loc, md.seq_lens, md.block_tables,
                                                 md.block_size, scale, max(md.query_lens_cpu), splits)

    def rel_err(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    import triton.testing
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3  # noqa: E731
    result = {"date": today(), "machine": machine(), "shape": "Llama-3.1-8B layer: 32 heads, 8 kv heads, d 128, "
              "block 16, bf16, KV cache [blocks, layers, 2, slots, heads, dim] (strided layer view)",
              "decode": [], "prefill": []}
    # Decode: batch 64 x 2048 context, reference vs Triton configs; then the winner at batch 1 and 256.
    decode_configs = [{"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}, {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
                      {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}]
    if quick:
        decode_configs = decode_configs[:2]
    q, kv, md = paged_setup([(1, 2048)] * 64)
    kv_bytes = 64 * 2048 * 2 * 8 * 128 * 2
    ref = paged_attention_reference(q, kv, md, scale)
    t_ref = bench(lambda: paged_attention_reference(q, kv, md, scale))
    result["decode"].append({"impl": "reference (torch gather + SDPA)", "batch": 64, "context": 2048,
                             "us": t_ref * 1e6, "kv_gbps": kv_bytes / t_ref / 1e9})
    best = None
    for cfg in decode_configs:
        ta.DECODE_CONFIG = cfg
        try:
            err = rel_err(triton_fn(q, kv, md)(), ref)
            t = bench(triton_fn(q, kv, md))
        except Exception as e:  # a config that does not compile or fit: skip it
            result["decode"].append({"impl": f"triton {cfg}", "error": repr(e)[:300]})
            continue
        row = {"impl": f"triton {cfg}", "batch": 64, "context": 2048, "us": t * 1e6,
               "kv_gbps": kv_bytes / t / 1e9, "rel_err_vs_reference": err}
        result["decode"].append(row)
        if err < 2e-2 and (best is None or t < best[0]):
            best = (t, cfg)
    ta.DECODE_CONFIG = best[1]
    result["decode_config"] = best[1]
    for n in (1, 256):
        q, kv, md = paged_setup([(1, 2048)] * n)
        for splits in sorted({None, 1}, key=str):
            t = bench(triton_fn(q, kv, md, splits))
            actual = splits or ta.decode_num_splits(n, 8, torch.cuda.get_device_properties(0).multi_processor_count)
            # (at MAX_SPLITS the split-K tiles run, not the winner: decode_launch_config says which)
            result["decode"].append({"impl": f"triton {ta.decode_launch_config(actual, False)} splits={actual}",
                                     "batch": n, "context": 2048,
                                     "us": t * 1e6, "kv_gbps": n * 2048 * 2 * 8 * 128 * 2 / t / 1e9})

    # Prefill: 1 x 8192 and 4 x 2048 (no cached prefix) and 4 x 1024 over a 1024 prefix.
    prefill_configs = [{"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
                       {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
                       {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}]
    if quick:
        prefill_configs = prefill_configs[:2]
    cases = {"1x8192": [(8192, 8192)], "4x2048": [(2048, 2048)] * 4, "4x1024 over 1024 cached": [(1024, 2048)] * 4}
    best_by_case: dict[str, tuple[float, int, dict]] = {}  # config -> (total time, cases passed, config)
    for name, lens in cases.items():
        q, kv, md = paged_setup(lens)
        flops = 4 * 32 * 128 * sum(new * (s - new) + new * (new + 1) // 2 for new, s in lens)
        ref = paged_attention_reference(q, kv, md, scale)
        t_ref = bench(lambda: paged_attention_reference(q, kv, md, scale))
        result["prefill"].append({"impl": "reference (torch gather + SDPA per sequence)", "case": name,
                                  "us": t_ref * 1e6, "tflops": flops / t_ref / 1e12})
        for cfg in prefill_configs:
            ta.PREFILL_CONFIG = cfg
            try:
                err = rel_err(triton_fn(q, kv, md)(), ref)
                t = bench(triton_fn(q, kv, md))
            except Exception as e:
                result["prefill"].append({"impl": f"triton {cfg}", "case": name, "error": repr(e)[:300]})
                continue
            result["prefill"].append({"impl": f"triton {cfg}", "case": name, "us": t * 1e6,
                                      "tflops": flops / t / 1e12, "rel_err_vs_reference": err})
            if err < 2e-2:
                total, count, _ = best_by_case.get(str(cfg), (0.0, 0, cfg))
                best_by_case[str(cfg)] = (total + t, count + 1, cfg)
        if name == "1x8192":  # what flash attention reaches on contiguous K/V, for scale
            qc = q.transpose(0, 1)[None]
            kc = torch.randn(1, 32, 8192, 128, dtype=torch.bfloat16, device="cuda")  # heads repeated: flash
            t = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qc, kc, kc, is_causal=True))
            result["prefill"].append({"impl": "SDPA flash, contiguous K/V (not paged), for scale", "case": name,
                                      "us": t * 1e6, "tflops": flops / t / 1e12})
    complete = [v for v in best_by_case.values() if v[1] == len(cases)]
    ta.PREFILL_CONFIG = min(complete, key=lambda v: v[0])[2]
    result["prefill_config"] = ta.PREFILL_CONFIG
    print_rows("attention kernels", result["decode"] + result["prefill"])
    return result


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    for row in rows:
        print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


def bench_splits(quick: bool) -> dict:
    """Split-K factor of the decode kernel at small batches (2,048-token contexts), each factor forced
    with the tiles decode_launch_config() gives it. Timed as a CUDA graph of 32 calls: a single call at
    batch 1 takes ~10 us, less than launching it from Python. The 32 calls read one layer's cache, which
    at batch <= 4 (<= 34 MB of KV) stays in L2, so small batches time faster here than in a decode
    step; gpu_split_sweep.py reads 32 distinct layers, across contexts and tiles."""
    from pdserve.model import triton_attention as ta
    rows = []
    for n in (1, 4, 16, 64):
        q, kv, md = paged_setup([(1, 2048)] * n)
        chosen = ta.decode_num_splits(n, 8, torch.cuda.get_device_properties(0).multi_processor_count)
        for splits in (1, 4, 8, 16, 32, 64):
            def layers():
                for _ in range(32):
                    ta.paged_attention_triton(q, kv, md.query_start_loc, md.seq_lens, md.block_tables,
                                              md.block_size, 128 ** -0.5, 1, splits)
            t = graph_median(layers, 10 if quick else 30) / 32
            rows.append({"batch": n, "splits": splits, "chosen_now": splits == chosen, "us_per_layer": t * 1e6,
                         "kv_gbps": n * 2048 * 2 * 8 * 128 * 2 / t / 1e9})
    print_rows("decode attention: split-K factor (per layer, in a graph of 32 calls, 2,048 context)", rows)
    return {"date": today(), "machine": machine(), "max_splits_now": ta.MAX_SPLITS, "rows": rows}


# -- stage: decode step --------------------------------------------------------------------------

def kernel_family(kernel_name: str) -> str:
    """attention | write_kv | matmul | other, for a profile by family."""
    name = kernel_name.lower()
    if "splitkreduce" in name:  # cuBLAS's split-K reduction: part of a matmul, not attention's _reduce_kernel
        return "matmul"
    if "attn" in name or name.startswith("_reduce_kernel"):
        return "attention"
    if "write_kv" in name:
        return "write_kv"
    if any(k in name for k in ("gemm", "gemv", "sm90", "cutlass", "nvjet", "cublas")):
        return "matmul"
    return "other"


def profile_replay(graph) -> dict:
    """Device time of one graph replay by kernel family (CUPTI via torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    families: dict[str, float] = {}
    by_name: list[tuple[float, str, int]] = []
    count = 0
    for event in prof.key_averages():
        us = event.self_device_time_total
        if us <= 0:
            continue
        by_name.append((us / 1e3, event.key[:90], event.count))
        family = kernel_family(event.key)
        families[family] = families.get(family, 0.0) + us / 1e3
        count += event.count
    top = [{"kernel": k, "ms": ms, "count": n} for ms, k, n in sorted(by_name, reverse=True)[:12]]
    return {"kernel_ms_by_family": families, "num_kernels": count, "top_kernels": top}


def bench_decode(runner, quick: bool, context: int = 2048, variants: bool = True) -> dict:
    from pdserve.core.batch import SchedulerOutput
    from pdserve.model import attention
    shape = Shape(runner.model)
    bs = runner.block_size
    blocks_per_seq = -(-context // bs)
    batches = (1, 64, 256)
    runner.kv_cache[:max(batches) * blocks_per_seq + 1].normal_()  # never time on zeros
    iters = 5 if quick else 20
    rows = []
    for n in batches:
        out = SchedulerOutput([scheduled(f"r{i}", [(1000 + i) % shape.vocab], context - 1,
                                         list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)))
                               for i in range(n)], n)
        roofline = shape.decode_bytes([context] * n) / HBM_BYTES_PER_S
        row = {"batch": n, "context": context, "roofline_ms": roofline * 1e3,
               "weight_gb": shape.weight_bytes / 1e9, "kv_gb": n * context * shape.kv_bytes_per_token / 1e9}
        graphs = runner.decode_graphs
        row["step_ms"] = wall_median(lambda: runner.execute_model(out), iters) * 1e3
        row["step_over_roofline"] = row["step_ms"] / row["roofline_ms"]
        row["syncs_per_step"] = count_syncs(lambda: runner.execute_model(out))
        if graphs is not None:
            size = graphs.bucket(n)
            row["graph_replay_gpu_ms"] = gpu_median(graphs.graphs[size].replay, iters) * 1e3
            row["graph_replay_over_roofline"] = row["graph_replay_gpu_ms"] / row["roofline_ms"]
            row["achieved_hbm_tbps"] = shape.decode_bytes([context] * n) / (row["graph_replay_gpu_ms"] / 1e3) / 1e12
            try:
                row.update(profile_replay(graphs.graphs[size]))
            except Exception as e:  # the profiler is a nicety
                row["profile_error"] = repr(e)[:200]
        if graphs is not None and variants and n == 1:
            # Before/after of the small-batch Triton matmuls (o, down): the same step with every matmul
            # on cuBLAS, in graphs captured again. A fresh capture's static inputs are its defaults
            # (context 1): one step through execute_model loads this batch's before the replays are timed.
            from pdserve.model import layers
            routed = layers.SMALL_BATCH_TRITON_LINEAR
            graphs = None  # the old graphs' pool goes with the recapture
            try:
                layers.SMALL_BATCH_TRITON_LINEAR = not routed
                runner.capture_decode_graphs()
                runner.execute_model(out)
                other = gpu_median(runner.decode_graphs.graphs[runner.decode_graphs.bucket(n)].replay, iters) * 1e3
                key = "all_cublas" if routed else "triton_linear"
                row[f"graph_replay_gpu_ms_{key}"] = other
                row[f"graph_replay_over_roofline_{key}"] = other / row["roofline_ms"]
            finally:
                layers.SMALL_BATCH_TRITON_LINEAR = routed
                runner.capture_decode_graphs()
                runner.execute_model(out)
                graphs = runner.decode_graphs
        if graphs is not None and variants:
            runner.decode_graphs = None  # eager, Triton attention: what the graphs buy
            row["eager_triton_step_ms"] = wall_median(lambda: runner.execute_model(out), max(3, iters // 4)) * 1e3
            if n == 64:  # before: eager with the torch reference attention
                attention.BACKEND = "reference"
                try:
                    row["eager_reference_step_ms"] = wall_median(lambda: runner.execute_model(out), 3, 1) * 1e3
                finally:
                    attention.BACKEND = "auto"
            runner.decode_graphs = graphs
        rows.append(row)
    print_rows("decode step (Llama-3.1-8B shape, bf16)", rows)
    return {"date": today(), "machine": machine(), "model": MODEL + " (dummy weights)",
            "formula": "roofline = (weight bytes + KV bytes read) / 4.3e12 B/s; step_ms = ModelRunner.execute_model "
                       "wall time incl. host input build, copies, sampling and the one .tolist() sync",
            "rows": rows}


# -- stage: prefill ------------------------------------------------------------------------------

def bench_prefill(runner, quick: bool, variants: bool = True) -> dict:
    from pdserve.core.batch import SchedulerOutput
    from pdserve.model import attention
    shape = Shape(runner.model)
    bs = runner.block_size
    rng = random.Random(0)
    rows = []
    for name, lens in (("1x8192", [8192]), ("4x2048", [2048] * 4)):
        items, first = [], 1
        for i, n in enumerate(lens):
            nblk = -(-n // bs)
            items.append(scheduled(f"p{i}", [rng.randrange(shape.vocab) for _ in range(n)], 0,
                                   list(range(first, first + nblk))))
            first += nblk
        out = SchedulerOutput(items, sum(lens))
        flops = shape.prefill_flops([(0, n) for n in lens], len(lens))
        row = {"case": name, "tokens": sum(lens), "tflop": flops / 1e12}
        t = wall_median(lambda: runner.execute_model(out), 3 if quick else 5)
        row.update(ms=t * 1e3, mfu=flops / t / BF16_FLOPS_PER_S, tokens_per_s=sum(lens) / t,
                   matmul_only_mfu=(flops - 4 * shape.num_layers * shape.num_heads * shape.head_dim
                                    * sum(n * (n + 1) // 2 for n in lens)) / t / BF16_FLOPS_PER_S)
        row["syncs_per_step"] = count_syncs(lambda: runner.execute_model(out))
        if variants:
            attention.BACKEND = "reference"  # before: torch reference attention
            try:
                t_ref = wall_median(lambda: runner.execute_model(out), 2, 1)
            finally:
                attention.BACKEND = "auto"
            row.update(reference_attention_ms=t_ref * 1e3, reference_attention_mfu=flops / t_ref / BF16_FLOPS_PER_S)
        rows.append(row)
    print_rows("prefill (Llama-3.1-8B shape, bf16)", rows)
    return {"date": today(), "machine": machine(), "model": MODEL + " (dummy weights)",
            "formula": "FLOPs = 2*N_layers*T + 2*N_lm_head*sampled_rows + 4*L*H*d*sum_t ctx(t) (causal); "
                       "MFU = FLOPs / time / 800e12",
            "N_layers": shape.layer_params, "N_lm_head": shape.lm_head_params, "rows": rows}


# -- stage: offline throughput -------------------------------------------------------------------

def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def bench_engine_decode(llm, quick: bool, context: int = 2048) -> dict:
    """Decode steps as the engine runs them (schedule, inputs, replay, sampling, outputs), with async
    scheduling on (the CUDA default: the host work of step N+1 overlaps the device running step N)
    and off, on the same requests. A step's time is the wall time of many consecutive engine steps
    over their number, once every request is decoding."""
    from pdserve.sampling_params import SamplingParams
    engine = llm.engine
    shape = Shape(engine.runner.model)
    steps = 8 if quick else 30
    rows = []
    for n in (1, 64, 256):
        prompts = random_prompts(n, context - 8, shape.vocab, seed=n)
        # early prompts decode while later ones prefill (up to ~64 steps at 256 x 2,040 tokens)
        params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
        ids = [f"decode{n}-{i}" for i in range(n)]
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        requests = [engine.scheduler.requests[rid] for rid in ids]
        while any(r.num_output_tokens < 2 for r in requests):  # every prompt done, everyone decoding
            engine.step()
        row = {"batch": n}
        for mode in (True, False):
            engine.async_scheduling = mode
            for _ in range(3):
                engine.step()
            contexts = [r.num_tokens for r in requests]
            elapsed = timed_steps(engine, steps)
            assert all(not r.is_finished for r in requests)
            roofline = shape.decode_bytes([c + steps // 2 for c in contexts]) / HBM_BYTES_PER_S
            key = "async" if mode else "sync"
            row.update({f"{key}_step_ms": elapsed * 1e3, f"{key}_roofline_ms": roofline * 1e3,
                        f"{key}_step_over_roofline": elapsed / roofline})
        engine.async_scheduling = True
        engine.abort(ids)
        while engine.has_work():
            engine.step()
        rows.append(row)
    print_rows("engine decode step (Llama-3.1-8B shape, bf16, ~2,048-token contexts)", rows)
    return {"date": today(), "machine": machine(), "model": MODEL + " (dummy weights)",
            "formula": "step = wall time of consecutive EngineCore.step() calls / their number, all requests "
                       "decoding; roofline = (weight bytes + KV bytes read at the middle context) / 4.3e12 B/s",
            "rows": rows}


def bench_offline(num_prompts: int, input_len: int, output_len: int, max_num_seqs: int, budget: int,
                  hf_prompts: int, engine_decode: dict | None = None, quick: bool = False) -> dict:
    """engine_decode: a dict to fill with bench_engine_decode's result on the same engine first."""
    from pdserve.engine.llm import LLM
    from pdserve.sampling_params import SamplingParams
    llm = LLM(MODEL, dtype="bfloat16", device="cuda", load_format="dummy", max_num_seqs=max_num_seqs,
              max_num_batched_tokens=budget, max_model_len=max(input_len + output_len, 2048 + 256) + 16)
    if engine_decode is not None:
        engine_decode.update(bench_engine_decode(llm, quick))
    runner = llm.engine.runner
    shape = Shape(runner.model)
    prompts = random_prompts(num_prompts, input_len, shape.vocab)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts(16, input_len, shape.vocab, seed=1), SamplingParams(max_tokens=4, temperature=0.0,
                                                                       ignore_eos=True))  # warm-up

    steps: list[list[tuple[int, int, bool]]] = []  # per step: (num_cached, num_new, do_sample)
    launch = runner.launch  # every step goes through launch(), with async scheduling or without

    def recording_launch(out):
        steps.append([(s.num_computed_tokens, len(s.token_ids), s.do_sample) for s in out.scheduled])
        return launch(out)
    runner.launch = recording_launch

    def timed(batch, async_scheduling=True):
        llm.engine.async_scheduling = async_scheduling
        steps.clear()
        try:
            start = time.perf_counter()
            results = llm.generate(batch, params)
            elapsed = time.perf_counter() - start
        finally:
            llm.engine.async_scheduling = True  # the CUDA default
        num_out = sum(len(r.token_ids) for r in results)
        assert num_out == len(batch) * output_len
        return elapsed, num_out, roofline(shape, steps), len(steps)

    small = timed(prompts[:hf_prompts])
    full = timed(prompts)
    full_sync = timed(prompts, async_scheduling=False)  # before: the synchronous engine loop
    del runner.launch  # back to the class's method
    llm = runner = launch = recording_launch = None  # free the engine's weights and KV cache before transformers loads its own
    gc.collect()
    torch.cuda.empty_cache()
    hf = bench_transformers(prompts[:hf_prompts], output_len)

    def summary(name, t, num_out, roof, num_steps, n):
        return {"case": name, "prompts": n, "seconds": t, "output_tokens": num_out,
                "output_tokens_per_s": num_out / t, "steps": num_steps, **roof,
                "time_over_roofline": t / roof["roofline_s"],
                "time_over_roofline_per_step_max": t / roof["roofline_per_step_max_s"]}
    rows = [summary(f"pdserve {num_prompts}x{input_len}->{output_len}", *full, num_prompts),
            summary(f"pdserve {hf_prompts}x{input_len}->{output_len}", *small, hf_prompts),
            {"case": f"transformers generate {hf_prompts}x{input_len}->{output_len}", **hf},
            summary(f"pdserve {num_prompts}x{input_len}->{output_len}, async scheduling off", *full_sync,
                    num_prompts)]
    rows[2]["time_over_roofline"] = hf["seconds"] / rows[1]["roofline_s"]
    print_rows("offline throughput", rows)
    return {"date": today(), "machine": machine(), "model": MODEL + " (dummy weights, bf16)",
            "config": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget, "greedy": True,
                       "ignore_eos": True},
            "formula": "roofline_s = sum(prefill FLOPs)/800e12 + sum over steps with decodes (weight bytes + KV "
                       "bytes read by decodes)/4.3e12; roofline_per_step_max_s = sum over steps of max(step FLOPs/"
                       "800e12, step bytes/4.3e12); both over the schedule the engine ran",
            "speedup_vs_transformers_same_prompts": rows[1]["output_tokens_per_s"] / hf["output_tokens_per_s"],
            "speedup_vs_transformers_full_vs_subset": rows[0]["output_tokens_per_s"] / hf["output_tokens_per_s"],
            "rows": rows}


def roofline(shape: Shape, steps: list[list[tuple[int, int, bool]]]) -> dict:
    prefill_flops = decode_bytes = per_step = 0.0
    for step in steps:
        chunks = [(c, n) for c, n, _ in step if n > 1]
        decodes = [c + 1 for c, n, _ in step if n == 1]
        sampled = sum(s for _, _, s in step)
        flops = shape.prefill_flops(chunks, sum(1 for c, n, s in step if n > 1 and s))
        prefill_flops += flops
        step_bytes = shape.decode_bytes(decodes) if decodes else 0.0
        decode_bytes += step_bytes
        step_flops = flops + 2 * (shape.layer_params + shape.lm_head_params) * len(decodes)
        per_step += max(step_flops / BF16_FLOPS_PER_S,
                        max(step_bytes, shape.weight_bytes) / HBM_BYTES_PER_S) if sampled or chunks else 0.0
    return {"prefill_tflop": prefill_flops / 1e12, "decode_step_tb": decode_bytes / 1e12,
            "roofline_s": prefill_flops / BF16_FLOPS_PER_S + decode_bytes / HBM_BYTES_PER_S,
            "roofline_per_step_max_s": per_step}


def bench_transformers(prompts: list[list[int]], output_len: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.model.loader import resolve_model_path
    cfg = AutoConfig.from_pretrained(resolve_model_path(MODEL), local_files_only=True)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    batch = torch.tensor(prompts, device="cuda")
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(batch[:2], attention_mask=torch.ones_like(batch[:2]), max_new_tokens=2, **kwargs)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=output_len,
                             min_new_tokens=output_len, **kwargs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    num_out = (out.shape[1] - batch.shape[1]) * out.shape[0]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"prompts": len(prompts), "seconds": elapsed, "output_tokens": num_out,
            "output_tokens_per_s": num_out / elapsed, "batch_size": len(prompts), "attn": "sdpa"}


# -- main ----------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stages", help="all, or a comma list of kernels,splits,decode,prefill,engine,offline "
                                  "(engine: decode steps through the engine, async scheduling on and off; "
                                  "it runs on the offline stage's engine)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help="fewer configs and iterations")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--hf-prompts", type=int, default=64)
    p.add_argument("--tests-log", type=Path, default=None, help="pytest output to quote in the summary")
    args = p.parse_args()
    stages = ({"kernels", "splits", "decode", "prefill", "engine", "offline"} if args.stages == "all"
              else set(args.stages.split(",")))
    date = today()
    # gpu-summary.json is updated in place: a run of some stages keeps the others' latest figures.
    summary_path = args.out_dir / "gpu-summary.json"
    previous = summary_path if summary_path.is_file() else RESULTS / "gpu-summary.json"
    summary = json.loads(previous.read_text()) if previous.is_file() else {}
    summary.update(date=date, machine=machine())
    errors = summary.setdefault("errors", {})

    def stage(name, fn):
        errors.pop(name, None)
        try:
            fn()
        except Exception:  # one stage failing must not lose the others' figures
            import traceback
            traceback.print_exc()
            errors[name] = traceback.format_exc()[-1500:]

    def kernels():
        result = bench_kernels(args.quick)
        write_json(args.out_dir, f"gpu-kernels-{date}.json", result)
        summary["attention_configs"] = {"decode": result["decode_config"], "prefill": result["prefill_config"]}

    def model_stages():
        runner = make_runner(num_blocks=256 * 129 + 600, max_model_len=8192 + 16)
        if "decode" in stages:
            def decode():
                result = bench_decode(runner, args.quick)
                write_json(args.out_dir, f"gpu-decode-{date}.json", result)
                summary["decode_runner_step_over_roofline"] = {str(r["batch"]): r["step_over_roofline"]
                                                               for r in result["rows"]}
                summary["decode_runner_step_ms"] = {str(r["batch"]): r["step_ms"] for r in result["rows"]}
                summary["decode_roofline_ms"] = {str(r["batch"]): r["roofline_ms"] for r in result["rows"]}
                summary["decode_graph_replay_over_roofline"] = {str(r["batch"]): r.get("graph_replay_over_roofline")
                                                                for r in result["rows"]}
            stage("decode", decode)
        if "prefill" in stages:
            def prefill():
                result = bench_prefill(runner, args.quick)
                write_json(args.out_dir, f"gpu-prefill-{date}.json", result)
                summary["prefill_mfu"] = {r["case"]: r["mfu"] for r in result["rows"]}
            stage("prefill", prefill)
    def offline():
        engine_decode = {} if "engine" in stages else None
        try:
            result = bench_offline(args.num_prompts, args.input_len, args.output_len, args.max_num_seqs,
                                   args.max_num_batched_tokens, args.hf_prompts, engine_decode, args.quick)
        finally:
            if engine_decode:
                write_json(args.out_dir, f"gpu-engine-decode-{date}.json", engine_decode)
                rows = engine_decode["rows"]
                # The decode step: what a served request waits per token, the engine's step
                # as it runs on CUDA (async scheduling). The runner alone, synchronous, is kept beside.
                summary["decode_step_over_roofline"] = {str(r["batch"]): r["async_step_over_roofline"] for r in rows}
                summary["decode_step_ms"] = {str(r["batch"]): r["async_step_ms"] for r in rows}
                summary["decode_step_over_roofline_sync_loop"] = {
                    str(r["batch"]): r["sync_step_over_roofline"] for r in rows}
                summary["decode_step_definition"] = (
                    "EngineCore.step() with async scheduling (the CUDA default), all requests decoding at "
                    "~2,048 tokens of context; *_sync_loop: the same with async scheduling off; "
                    "decode_runner_*: ModelRunner.execute_model alone, synchronous")
        write_json(args.out_dir, f"gpu-offline-{date}.json", result)
        summary["offline_time_over_roofline"] = result["rows"][0]["time_over_roofline"]
        summary["offline_time_over_roofline_sync"] = result["rows"][3]["time_over_roofline"]
        summary["offline_time_over_roofline_per_step_max"] = result["rows"][0]["time_over_roofline_per_step_max"]
        summary["offline_output_tokens_per_s"] = result["rows"][0]["output_tokens_per_s"]
        summary["offline_speedup_vs_transformers"] = result["speedup_vs_transformers_same_prompts"]

    if "kernels" in stages:
        stage("kernels", kernels)
    if "splits" in stages:
        stage("splits", lambda: write_json(args.out_dir, f"gpu-splits-{date}.json", bench_splits(args.quick)))
    if stages & {"decode", "prefill"}:
        stage("model", model_stages)
        gc.collect()
        torch.cuda.empty_cache()
    if stages & {"engine", "offline"}:
        stage("offline", offline)
    if args.tests_log is not None and args.tests_log.is_file():
        lines = [ln for ln in args.tests_log.read_text().splitlines() if ln.strip()]
        summary["gpu_tests"] = lines[-1] if lines else None
    write_json(args.out_dir, "gpu-summary.json", summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "errors"}, indent=2))
    print("errors in stages:", sorted(errors) or "none")


if __name__ == "__main__":
    main()
