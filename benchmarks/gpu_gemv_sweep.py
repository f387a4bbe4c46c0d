"""Small-batch matmuls of a decode step on one GPU: cuBLAS (F.linear) against pdserve's Triton kernel
(model/triton_linear.py) over its tile configurations, against the HBM bound.

    PYTHONPATH=$PWD python3 benchmarks/gpu_gemv_sweep.py --out-dir $OUT [--time-limit 200]

The Llama-3.1-8B matmuls (qkv, o, gate_up, down, lm_head) in bf16 with 1, 4 and 16 rows. Each time is a
CUDA graph of calls over as many distinct weight copies as make the bytes read exceed 8x the 50 MB L2,
divided by the call count. Phase 1 times every configuration with one row; phase 2 the best few and
cuBLAS with 4 and 16 rows. The per-step figure weights each matmul by its count in a decode step (32 of
each layer matmul, one lm_head). The kernels cuBLAS launches per call are counted with the profiler.
Writes gpu-gemv-sweep-<date>.json.
"""
from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_bench import HBM_BYTES_PER_S, graph_median, machine, print_rows, today, write_json

SHAPES = {"qkv": (6144, 4096, 32), "o": (4096, 4096, 32), "gate_up": (28672, 4096, 32),
          "down": (4096, 14336, 32), "lm_head": (128256, 4096, 1)}  # name: (N, K, calls per step)


def weights_for(n: int, k: int) -> list[torch.Tensor]:
    copies = max(1, -(-400_000_000 // (n * k * 2)))
    return [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]


def time_calls(fn, x, weights) -> float:
    def run():
        for w in weights:
            fn(x, w)
    return graph_median(run, 15) / len(weights)


def cublas_kernels(x, w) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    F.linear(x, w)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.linear(x, w)
        torch.cuda.synchronize()
    return [e.key[:90] for e in prof.key_averages() if e.self_device_time_total > 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--time-limit", type=float, default=200.0)
    parser.add_argument("--top", type=int, default=4)
    args = parser.parse_args()
    from pdserve.model import triton_linear as tlin
    start = time.monotonic()
    result = {"date": today(), "machine": machine(), "default_config": tlin.CONFIG, "rows": [], "cublas": [],
              "hbm_bound_tbps": HBM_BYTES_PER_S / 1e12}
    configs = [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s}
               for bn, bk, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 5))]
    weights = {name: weights_for(n, k) for name, (n, k, _) in SHAPES.items()}

    def step_ms(times: dict[str, float]) -> float:
        return sum(times[name] * SHAPES[name][2] for name in SHAPES) * 1e3

    step_bytes = sum(n * k * 2 * calls for n, k, calls in SHAPES.values())
    try:
        # The model's two call sites as it makes them, with the default tiles, one row.
        from pdserve.model.layers import _silu_and_mul
        qkv = torch.randn(1, 6144, dtype=torch.bfloat16, device="cuda")
        attn_out = qkv[:, :4096]                                    # a row of a wider buffer
        gate_up = torch.randn(1, 2 * 14336, dtype=torch.bfloat16, device="cuda")
        site = {
            "o, cuBLAS": time_calls(F.linear, attn_out.contiguous(), weights["o"]),
            "o, triton, contiguous row": time_calls(tlin.linear_triton, attn_out.contiguous(), weights["o"]),
            "o, triton, strided row": time_calls(tlin.linear_triton, attn_out, weights["o"]),
            "down, cuBLAS after eager SwiGLU": time_calls(lambda a, b: F.linear(_silu_and_mul(a), b), gate_up,
                                                          weights["down"]),
            "down, triton after eager SwiGLU": time_calls(lambda a, b: tlin.linear_triton(_silu_and_mul(a), b),
                                                          gate_up, weights["down"]),
        }
        result["call_sites_us"] = {k: v * 1e6 for k, v in site.items()}
        print_rows("model call sites, one row (us per call)", [result["call_sites_us"]])
        for rows in (1, 4, 16):
            x = {name: torch.randn(rows, k, dtype=torch.bfloat16, device="cuda") for name, (_, k, _) in SHAPES.items()}
            times = {name: time_calls(F.linear, x[name], weights[name]) for name in SHAPES}
            entry = {"rows": rows, "step_ms": step_ms(times), "step_tbps": step_bytes / step_ms(times) / 1e9,
                     "us": {k: v * 1e6 for k, v in times.items()}}
            if rows == 1:
                entry["kernels_per_call"] = {name: cublas_kernels(x[name], weights[name][0]) for name in SHAPES}
            result["cublas"].append(entry)
            print_rows(f"cuBLAS, {rows} rows", [entry])
        x1 = {name: torch.randn(1, k, dtype=torch.bfloat16, device="cuda") for name, (_, k, _) in SHAPES.items()}
        scored = []
        for cfg in configs:
            if time.monotonic() - start > args.time_limit:
                raise TimeoutError
            try:
                w0 = weights["down"][0]
                err = float((tlin.linear_triton(x1["down"], w0, config=cfg).float() - F.linear(x1["down"], w0).float())
                            .norm() / F.linear(x1["down"], w0).float().norm())
                times = {name: time_calls(lambda a, b: tlin.linear_triton(a, b, config=cfg), x1[name], weights[name])
                         for name in SHAPES}
            except Exception as e:  # does not fit: recorded, skipped
                result["rows"].append({**cfg, "rows": 1, "error": repr(e)[:200]})
                continue
            row = {**cfg, "rows": 1, "step_ms": step_ms(times), "step_tbps": step_bytes / step_ms(times) / 1e9,
                   "rel_err_down": err, "us": {k: v * 1e6 for k, v in times.items()}}
            result["rows"].append(row)
            scored.append((row["step_ms"], cfg))
            print_rows("", [{k: v for k, v in row.items() if k != "us"}])
        scored.sort(key=lambda s: s[0])
        if not scored:  # every configuration failed or the time limit came first: nothing to carry over
            result.setdefault("stopped", "no configuration completed")
            return
        result["best_rows1"] = scored[0][1]
        for rows in (4, 16):
            x = {name: torch.randn(rows, k, dtype=torch.bfloat16, device="cuda") for name, (_, k, _) in SHAPES.items()}
            for _, cfg in scored[:args.top]:
                if time.monotonic() - start > args.time_limit + 60:
                    raise TimeoutError
                times = {name: time_calls(lambda a, b: tlin.linear_triton(a, b, config=cfg), x[name], weights[name])
                         for name in SHAPES}
                row = {**cfg, "rows": rows, "step_ms": step_ms(times), "step_tbps": step_bytes / step_ms(times) / 1e9,
                       "us": {k: v * 1e6 for k, v in times.items()}}
                result["rows"].append(row)
                print_rows("", [{k: v for k, v in row.items() if k != "us"}])
    except TimeoutError:
        result["stopped"] = f"time limit {args.time_limit} s"
    finally:
        write_json(args.out_dir, f"gpu-gemv-sweep-{today()}.json", result)


if __name__ == "__main__":
    main()
