"""CPU decode step and prefill time of the default model, at a chosen number of torch threads.

    .venv/bin/python benchmarks/cpu_decode_step.py [--threads 1] [--batch 64] [--prompt-len 256] [--out F.json]
        [--profile-prefill]

Prefills `batch` random prompts, runs until every request is decoding, then times 5 pure-decode steps
(schedule + execute + update), and a [64x576]x[576x3072] fp32 matmul (the machine's GFLOP/s at these threads). Prints the figures and a torch profile of one step (top ops), so
that a change to the attention path or to threads can be measured before and after. --profile-prefill
also prints a torch profile of the first prefill step (a full token budget), by op and input shape.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from torch.profiler import ProfilerActivity, profile

from pdserve.engine.llm import LLM
from pdserve.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--out", default=None, help="also write the figures here (JSON)")
    p.add_argument("--profile-prefill", action="store_true")
    args = p.parse_args()
    llm = LLM("default", num_threads=args.threads, max_num_seqs=args.batch, enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    engine = llm.engine

    def step():
        out = engine.scheduler.schedule()
        engine.scheduler.update_from_output(out, engine.runner.execute_model(out))
        return out

    for prompt in prompts:
        llm.add(prompt, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    if args.profile_prefill:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out = step()
        print(f"prefill step of {out.num_scheduled_tokens} tokens (profiled):")
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12))
    while len((out := step()).scheduled) != args.batch or out.num_scheduled_tokens != args.batch:
        pass
    prefill_s = time.perf_counter() - start
    times = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(f"threads={args.threads} batch={args.batch} prompt={args.prompt_len}: prefill {prefill_s:.1f} s, "
          f"decode step {', '.join(f'{t * 1e3:.0f}' for t in times)} ms")
    a, b = torch.randn(64, 576), torch.randn(576, 3072)
    a @ b
    seconds = []
    for _ in range(20):
        start = time.perf_counter()
        a @ b
        seconds.append(time.perf_counter() - start)
    gflops = 2 * 64 * 576 * 3072 / statistics.median(seconds) / 1e9
    print(f"matmul [64x576]x[576x3072]: {gflops:.0f} GFLOP/s (median of 20)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "batch": args.batch, "prompt_len": args.prompt_len,
                       "prefill_s": prefill_s, "decode_step_ms": [t * 1e3 for t in times],
                       "matmul_gflops": gflops}, f, indent=1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
