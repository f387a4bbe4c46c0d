"""Tensor parallelism against its roofline (issue 17): the engine's decode step at several batch sizes and one
long prefill, for each tensor-parallel size, Llama-3.1-8B shape, random bf16 weights built on the GPUs.

    PYTHONPATH=$PWD python3 benchmarks/gpu_tp.py --tp 1,2 --out $OUT/gpu-tp.json          # two GPUs
    python benchmarks/gpu_tp.py --device cpu --model default --dtype float32 --tp 1,3 --batches 1,4 \
        --context 128 --prefill-tokens 256 --steps 4 --out /tmp/tp-smoke.json              # CPU: a smoke run

Each size runs in a process of its own (one tensor-parallel instance per process; its GPUs freed after).
Per size:
  decode   n requests of --context tokens all decoding; a step = the wall time of --steps consecutive
           EngineCore.step() calls over their number (async scheduling on, as served), between device syncs
  prefill  one prompt of --prefill-tokens tokens in one chunk: the wall time of the step that computes it
The roofline of T GPUs (ceilings of ../shared/GPU.md, an H200: HBM 4.3e12 B/s, bf16 dense 800e12 FLOP/s, the
NVLink between two GPUs 397e9 B/s each way):
  decode   = (weight bytes + KV bytes one rank reads) / HBM + all-reduce bytes one rank sends / link
             a rank reads 1/T of every decoder layer's weights and of the LM head, and 1/T of the KV heads;
             2 all-reduces a layer of [n, hidden] (ring: 2 (T-1)/T of it sent per rank), and the logits'
             all-gather ((T-1)/T of [n, vocab]); latency is not in it: at batch 1 each of the 2 x layers
             all-reduces costs its launch and NCCL's round trip, which the bytes do not show
  prefill  = FLOPs (gpu_bench.py's count: 2 N T + 2 N_head + 4 L H d sum ctx) / (T x 800e12)
             + all-reduce bytes / link
A row that fails (a batch whose KV does not fit this GPU, say) is recorded with its error and the others go
on; the JSON is written after each size. The ceilings are an H200's: on another GPU (the device tool may lend
H100s for a two-GPU kind) the ratios are against those, and the JSON names the GPU. Prints a table and saves
JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS_PER_S = 800e12
LINK_BYTES_PER_S = 397e9


def shape_of(model: str) -> dict:
    from pdserve.model.loader import load_model_config
    c = load_model_config(model)
    attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return {"layers": c.num_layers, "hidden": c.hidden_size, "heads": c.num_heads, "kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "vocab": c.vocab_size, "layer_params": c.num_layers * (attn + mlp),
            "lm_head_params": c.vocab_size * c.hidden_size}


def decode_roofline(s: dict, tp: int, contexts: list[int], elem: int) -> dict:
    weights = (s["layer_params"] + s["lm_head_params"]) * elem / tp
    kv = sum(contexts) * s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * elem / tp
    n = len(contexts)
    sent = 0.0 if tp == 1 else (2 * s["layers"] * n * s["hidden"] * elem * 2 * (tp - 1) / tp
                                + n * s["vocab"] * elem * (tp - 1) / tp)
    return {"hbm_s": (weights + kv) / HBM_BYTES_PER_S, "link_s": sent / LINK_BYTES_PER_S,
            "roofline_s": (weights + kv) / HBM_BYTES_PER_S + sent / LINK_BYTES_PER_S}


def prefill_roofline(s: dict, tp: int, tokens: int, elem: int) -> dict:
    flops = (2 * s["layer_params"] * tokens + 2 * s["lm_head_params"]
             + 4 * s["layers"] * s["heads"] * s["head_dim"] * tokens * (tokens + 1) // 2)
    sent = 0.0 if tp == 1 else 2 * s["layers"] * tokens * s["hidden"] * elem * 2 * (tp - 1) / tp
    return {"flops": flops, "compute_s": flops / (tp * BF16_FLOPS_PER_S), "link_s": sent / LINK_BYTES_PER_S,
            "roofline_s": flops / (tp * BF16_FLOPS_PER_S) + sent / LINK_BYTES_PER_S}


def sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def measure(args: argparse.Namespace, tp: int) -> dict:
    """In this process: one instance of tp ranks, its decode steps and its prefill."""
    import random
    from pdserve.engine.llm import LLM
    s = shape_of(args.model)
    elem = 2 if args.dtype == "bfloat16" else 4
    max_batch = max(args.batches)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
              tensor_parallel_size=tp, max_num_seqs=max(max_batch, 1),
              max_num_batched_tokens=max(args.prefill_tokens, 2048),
              max_model_len=max(args.context, args.prefill_tokens) + args.steps + 64,
              kv_cache_memory=args.kv_cache_memory)
    engine, rng = llm.engine, random.Random(tp)
    try:
        rows = [measure_decode(args, engine, s, tp, elem, rng, n) for n in args.batches]
        rows.append(measure_prefill(args, engine, s, tp, elem, rng))
    finally:
        llm.shutdown()
    return {"tp": tp, "device": device_name(args.device), "rows": rows}


def measure_decode(args: argparse.Namespace, engine, s: dict, tp: int, elem: int, rng, n: int) -> dict:
    """n requests all decoding: a step's wall time over --steps steps, or the error (a batch whose KV this
    GPU cannot hold: some requests wait while others finish)."""
    from pdserve.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=args.steps + 32, temperature=0.0, ignore_eos=True)
    ids = [f"decode{n}-{i}" for i in range(n)]
    try:
        for rid in ids:
            engine.add_request(rid, [rng.randrange(1, s["vocab"]) for _ in range(args.context - 8)], params)
        requests = [engine.scheduler.requests[rid] for rid in ids]
        while any(r.num_output_tokens < 2 for r in requests):   # every prompt done, everyone decoding
            engine.step()
        for _ in range(3):
            engine.step()
        contexts = [r.num_tokens + args.steps // 2 for r in requests]
        sync(args.device)
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync(args.device)
        step_s = (time.perf_counter() - start) / args.steps
        if any(r.is_finished for r in requests):
            raise RuntimeError("some requests finished before the others were decoding (KV too small)")
    except Exception as e:
        return {"kind": "decode", "batch": n, "error": f"{type(e).__name__}: {e}"}
    finally:
        engine.abort(ids)
        while engine.has_work():
            engine.step()
    bound = decode_roofline(s, tp, contexts, elem)
    return {"kind": "decode", "batch": n, "step_ms": step_s * 1e3,
            **{k.replace("_s", "_ms"): v * 1e3 for k, v in bound.items()}, "over_roofline": step_s / bound["roofline_s"]}


def measure_prefill(args: argparse.Namespace, engine, s: dict, tp: int, elem: int, rng) -> dict:
    from pdserve.sampling_params import SamplingParams
    try:
        prompt = [rng.randrange(1, s["vocab"]) for _ in range(args.prefill_tokens)]
        times = []
        for i in range(args.prefill_repeats + 1):   # the first one warms up
            rid = f"prefill-{i}"
            prompt[0] = i + 1   # (no prefix-cache hit)
            engine.add_request(rid, list(prompt), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            sync(args.device)
            start = time.perf_counter()
            while engine.has_work():
                engine.step()
            sync(args.device)
            times.append(time.perf_counter() - start)
        prefill_s = sorted(times[1:])[len(times[1:]) // 2]
    except Exception as e:
        return {"kind": "prefill", "tokens": args.prefill_tokens, "error": f"{type(e).__name__}: {e}"}
    bound = prefill_roofline(s, tp, args.prefill_tokens, elem)
    return {"kind": "prefill", "tokens": args.prefill_tokens, "step_ms": prefill_s * 1e3,
            "tflops_per_gpu": bound["flops"] / prefill_s / tp / 1e12,
            **{k.replace("_s", "_ms"): v * 1e3 for k, v in bound.items() if k != "flops"},
            "over_roofline": prefill_s / bound["roofline_s"]}


def device_name(device: str) -> str:
    if device == "cuda":
        import torch
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes, each in a process of its own")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--load-format", default=None, help="default: dummy for the shipped shapes, auto otherwise")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens of each decoding request")
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per batch size")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes per rank (default: the engine's)")
    p.add_argument("--one-tp", type=int, default=None, help=argparse.SUPPRESS)   # (the child's)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.load_format is None:
        args.load_format = "dummy" if args.model in ("llama-3.1-8b", "qwen3-8b") else "auto"
    if args.one_tp is not None:
        Path(args.out).write_text(json.dumps(measure(args, args.one_tp)))
        return
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.node(), "args": {k: v for k, v in vars(args).items() if k != "one_tp"},
              "ceilings": {"hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops_per_s": BF16_FLOPS_PER_S,
                           "link_bytes_per_s": LINK_BYTES_PER_S},
              "shape": shape_of(args.model), "sizes": []}
    for tp in (int(t) for t in args.tp.split(",")):
        part = Path(args.out).with_suffix(f".tp{tp}.json")
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one-tp", str(tp), "--out", str(part)]
        done = subprocess.run(cmd)
        if done.returncode != 0 or not part.exists():
            result["sizes"].append({"tp": tp, "error": f"exit {done.returncode}"})
        else:
            result["sizes"].append(json.loads(part.read_text()))
            part.unlink()
        Path(args.out).write_text(json.dumps(result, indent=1))   # (each size as it comes: a timeout keeps them)
    print(f"{'TP':>3} {'kind':>8} {'batch/tokens':>12} {'step ms':>9} {'roofline ms':>12} {'x':>6}")
    for size in result["sizes"]:
        for row in size.get("rows", []):
            where = f"{size['tp']:>3} {row['kind']:>8} {row.get('batch', row.get('tokens')):>12}"
            if "error" in row:
                print(f"{where} failed: {row['error']}")
                continue
            print(f"{where} {row['step_ms']:>9.3f} {row['roofline_ms']:>12.3f} {row['over_roofline']:>6.2f}")
        if "error" in size:
            print(f"{size['tp']:>3} failed: {size['error']}")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
