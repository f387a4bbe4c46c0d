"""Where an offline run's time goes, step by step: the anchor's workload (64 random prompts of 256 tokens ->
128 tokens, greedy, ignore_eos, float32) through `LLM`, timing every engine step.

    .venv/bin/python benchmarks/cpu_offline_steps.py [--kv-cache-memory BYTES] [--num-prompts 64] [--out F.json]

Prints the wall time, the time in steps that carry prefill tokens and in pure decode steps, the
prefill steps one by one (ms, tokens, sequences), every tenth decode step, and the scheduler's
preemptions (a KV cache too small for the batch makes it recompute).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pdserve.engine.llm import LLM
from pdserve.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: the engine's)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    llm = LLM("default", dtype="float32", enable_prefix_caching=False, kv_cache_memory=args.kv_cache_memory,
              num_threads=args.num_threads)
    rng = np.random.default_rng(0)   # the same prompts as the anchor's bench_offline_pdserve.py
    prompts = [rng.integers(100, 49152, size=args.input_len).tolist() for _ in range(args.num_prompts)]
    warm = [rng.integers(100, 49152, size=32).tolist() for _ in range(2)]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    scheduler = llm.engine.scheduler
    marks: list[tuple[float, int, int]] = []
    schedule = scheduler.schedule

    def timed_schedule():
        out = schedule()
        marks.append((time.perf_counter(), out.num_scheduled_tokens, len(out.scheduled)))
        return out

    scheduler.schedule = timed_schedule
    preempted_before = scheduler.num_preemptions
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True))
    wall = time.perf_counter() - start
    marks.append((time.perf_counter(), 0, 0))
    steps = [(marks[i + 1][0] - marks[i][0], marks[i][1], marks[i][2]) for i in range(len(marks) - 1)]
    steps = [s for s in steps if s[1]]           # the empty schedule that ends the run
    prefill = [s for s in steps if s[1] > s[2]]
    decode = [s for s in steps if s[1] == s[2]]
    result = {
        "wall_s": round(wall, 2), "output_tok_s": round(args.num_prompts * args.output_len / wall, 2),
        "kv_cache_bytes": llm.engine.runner.kv_cache.numel() * llm.engine.runner.kv_cache.element_size(),
        "steps": len(steps), "prefill_steps": len(prefill),
        "prefill_steps_s": round(sum(s[0] for s in prefill), 2), "decode_steps": len(decode),
        "decode_steps_s": round(sum(s[0] for s in decode), 2),
        "preemptions": scheduler.num_preemptions - preempted_before,
        "prefill_step_ms_tokens_seqs": [(round(s[0] * 1e3), s[1], s[2]) for s in prefill],
        "every_tenth_decode_step_ms": [round(s[0] * 1e3) for s in decode[::10]],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), **result}, f, indent=1)
    llm.shutdown()


if __name__ == "__main__":
    main()
