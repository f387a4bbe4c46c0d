"""A/B of one CPU fast path inside one engine, alternating step by step so that the noisy shared machine
affects both sides alike.

    .venv/bin/python benchmarks/cpu_step_ab.py --switch attention|linear|packed|gemm|fused|prefetch|rope
        [--threads 2] [--batch 64] [--prompt-len 256] [--steps 12] [--prefill [--prefill-tokens N]] [--out F.json]

  attention  the C decode attention kernel (model/cpu_kernels.py) against plain torch (BACKEND reference)
  linear     oneDNN's linear against ATen's F.linear (layers.CPU_ONEDNN_LINEAR)
  packed     the packed GEMM (layers.CPU_PACKED_LINEAR: MKL on Intel, oneDNN elsewhere) against the oneDNN/ATen rule
  gemm       pdserve's own packed GEMM (model/csrc/cpu_linear.c) against oneDNN's packed weights
  fused      RMSNorm and SwiGLU as C kernels (model/csrc/cpu_norm.c) against eager torch (layers.CPU_FUSED_OPS)
  prefetch   pdserve's GEMM asking for the next panels' weights ahead (model/csrc/cpu_linear.c,
             pdserve_linear_prefetch) against the hardware prefetcher alone
  rope       rotary + KV cache write as one C kernel (model/csrc/cpu_rope.c) against apply_rotary + write_kv
             (the attention and fused switches' "off" sides turn this kernel off too: since 2026-12-04 their
             A/B figures include it)

Prefills `batch` random prompts, then times pure-decode steps (schedule + execute + update) with the
path on and off in turn (ABBA order), and one decode step of a single sequence the same way (the
single-stream TPOT's engine part). With --prefill it times prefill steps instead: each one a full token
budget (2,048, or --prefill-tokens) of fresh prompts, which finish there (one output token). Timing only:
token identity is the test suite's job (tests/engine/test_llm_greedy.py runs with both fast paths on).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import time

from pdserve.engine.llm import LLM
from pdserve.model import attention, cpu_kernels, layers
from pdserve.sampling_params import SamplingParams


def set_linear(on: bool) -> None:
    layers.CPU_ONEDNN_LINEAR = on


def set_packed(on: bool) -> None:
    layers.CPU_PACKED_LINEAR = on


def set_gemm(on: bool) -> None:
    if on and not cpu_kernels.available():
        raise SystemExit("--switch gemm: the C kernels do not build here")
    name = "pdserve" if on else "onednn"
    layers.packer = lambda: name   # every step asks layers.packer(); main() puts the real one back


def set_fused(on: bool) -> None:
    layers.CPU_FUSED_OPS = on


def set_prefetch(on: bool) -> None:
    ctypes.c_int.in_dll(cpu_kernels._library(), "pdserve_linear_prefetch").value = int(on)


def set_attention(on: bool) -> None:
    attention.BACKEND = "auto" if on else "reference"


_rope_write_kv = cpu_kernels.rope_write_kv


def set_rope(on: bool) -> None:
    cpu_kernels.rope_write_kv = _rope_write_kv if on else (lambda *args: False)


SWITCHES = {"linear": (set_linear, "onednn", "aten"), "packed": (set_packed, "packed", "onednn_aten"),
            "gemm": (set_gemm, "pdserve_gemm", "onednn_packed"),
            "fused": (set_fused, "c_kernels", "eager"), "prefetch": (set_prefetch, "prefetch", "no_prefetch"),
            "attention": (set_attention, "kernel", "torch"), "rope": (set_rope, "c_rope", "torch_rope")}


def run_prefill(switch: str, prompt_len: int, steps: int, threads: int, tokens: int | None) -> dict:
    flip, on_name, off_name = SWITCHES[switch]
    llm = LLM("default", num_threads=threads, enable_prefix_caching=False)
    engine = llm.engine
    budget = engine.scheduler.config.max_num_batched_tokens
    budget = min(tokens or budget, budget)
    rng = random.Random(0)
    times = {True: [], False: []}
    for i in range(steps * 2 + 2):
        for _ in range(-(-budget // prompt_len)):
            llm.add([rng.randrange(1000, 20000) for _ in range(prompt_len)],
                    SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        # an untimed first step on each side (packs weights, warms), then ABBA
        flag = i == 0 if i < 2 else ((i - 2) % 4) in (0, 3)
        flip(flag)
        start = time.perf_counter()
        out = engine.scheduler.schedule()
        engine.scheduler.update_from_output(out, engine.runner.execute_model(out))
        if i >= 2:
            times[flag].append(time.perf_counter() - start)
    flip(True)
    llm.shutdown()
    return {"prefill_tokens_per_step": budget, "prompt_len": prompt_len, **timings(on_name, off_name, times)}


def timings(on_name: str, off_name: str, times: dict[bool, list[float]]) -> dict:
    return {f"{on_name}_ms": [round(t * 1e3, 1) for t in times[True]],
            f"{off_name}_ms": [round(t * 1e3, 1) for t in times[False]],
            f"{on_name}_median_ms": round(statistics.median(times[True]) * 1e3, 1),
            f"{off_name}_median_ms": round(statistics.median(times[False]) * 1e3, 1)}


def run(switch: str, batch: int, prompt_len: int, steps: int, threads: int) -> dict:
    flip, on_name, off_name = SWITCHES[switch]
    llm = LLM("default", num_threads=threads, max_num_seqs=batch, enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(0)
    for _ in range(batch):
        llm.add([rng.randrange(1000, 20000) for _ in range(prompt_len)],
                SamplingParams(max_tokens=steps * 2 + 8, temperature=0, ignore_eos=True))

    def step():
        out = engine.scheduler.schedule()
        engine.scheduler.update_from_output(out, engine.runner.execute_model(out))
        return out

    while len((out := step()).scheduled) != batch or out.num_scheduled_tokens != batch:
        pass
    for flag in (False, True):   # an untimed step on each side first: packs its weights, warms
        flip(flag)
        step()
    times = {True: [], False: []}
    for i in range(steps * 2):
        flag = (i % 4) in (0, 3)   # ABBA
        flip(flag)
        start = time.perf_counter()
        step()
        times[flag].append(time.perf_counter() - start)
    flip(True)
    llm.shutdown()
    return {"batch": batch, "prompt_len": prompt_len, **timings(on_name, off_name, times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--switch", choices=list(SWITCHES), required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prefill", action="store_true", help="time prefill steps, not decode steps")
    p.add_argument("--prefill-tokens", type=int, default=None,
                   help="with --prefill: prompt tokens per step (whole prompts; default the token budget, 2,048)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    _, on_name, off_name = SWITCHES[args.switch]
    real_packer = layers.packer
    if args.prefill:
        results = [run_prefill(args.switch, args.prompt_len, args.steps, args.threads, args.prefill_tokens)]
    else:
        results = [run(args.switch, b, args.prompt_len, args.steps, args.threads) for b in (args.batch, 1)]
    layers.packer = real_packer
    for r in results:
        on, off = r[f"{on_name}_median_ms"], r[f"{off_name}_median_ms"]
        what = (f"prefill step of {r['prefill_tokens_per_step']} tokens ({args.prompt_len}-token prompts)"
                if args.prefill else f"batch {r['batch']} x {r['prompt_len']} tokens: decode step")
        print(f"{what}: median {on_name} {on} ms, {off_name} {off} ms ({off / on:.2f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"switch": args.switch, "threads": args.threads, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
