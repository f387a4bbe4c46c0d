"""Host time of one engine step outside the model: scheduler, KV cache manager, detokenizer and
output building, with the model runner replaced by a stub that returns a token at once. On a GPU this
time is the gap between two decode steps (the GPU waits for it), so it is measured on its own here.

  .venv/bin/python benchmarks/cpu_engine_host_overhead.py [--num-requests 256 --prompt-len 256]

Prints and writes JSON (--out) with ms per step and µs per running request and step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from pdserve.core.batch import ModelRunnerOutput
from pdserve.engine.llm import LLM
from pdserve.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    kv_bytes = (args.prompt_len + args.steps + 64) * args.num_requests * 47_000  # default model, fp32
    llm = LLM("default", kv_cache_memory=kv_bytes, max_num_seqs=args.num_requests,
              max_num_batched_tokens=max(8192, args.prompt_len))
    engine = llm.engine
    engine.runner.execute_model = lambda out: ModelRunnerOutput(
        {s.request_id: 1000 + len(s.token_ids) for s in out.scheduled if s.do_sample})
    params = SamplingParams(max_tokens=args.steps + 1000, temperature=0.0, ignore_eos=True)
    for i in range(args.num_requests):
        engine.add_request(f"r{i}", [1 + (i * 7 + j) % 5000 for j in range(args.prompt_len)], params)
    while len(engine.scheduler.running) < args.num_requests or engine.scheduler.waiting:
        engine.step()  # prefills
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    result = {"num_requests": args.num_requests, "prompt_len": args.prompt_len, "steps": args.steps,
              "running": len(engine.scheduler.running), "median_step_ms": ms,
              "us_per_request_step": ms * 1e3 / len(engine.scheduler.running)}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    llm.shutdown()


if __name__ == "__main__":
    main()
