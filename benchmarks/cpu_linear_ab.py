"""A/B of the CPU linear path (oneDNN vs ATen's F.linear) inside one engine, alternating step by step so
that the noisy shared machine affects both sides alike.

    .venv/bin/python benchmarks/cpu_linear_ab.py [--threads 2] [--batch 64] [--steps 12] [--out F.json]

Prefills `batch` random 256-token prompts, then times pure-decode steps (schedule + execute + update)
with pdserve.model.layers.CPU_ONEDNN_LINEAR on and off in turn (ABBA order), and one decode step of a
single sequence the same way (the single-stream TPOT's engine part). Timing only: token identity is the
test suite's job (tests/engine/test_llm_greedy.py runs with the oneDNN path on).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pdserve.engine.llm import LLM
from pdserve.model import layers
from pdserve.sampling_params import SamplingParams


def run(batch: int, steps: int, threads: int) -> dict:
    llm = LLM("default", num_threads=threads, max_num_seqs=batch, enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(0)
    for _ in range(batch):
        llm.add([rng.randrange(1000, 20000) for _ in range(256)],
                SamplingParams(max_tokens=steps * 2 + 8, temperature=0, ignore_eos=True))

    def step():
        out = engine.scheduler.schedule()
        engine.scheduler.update_from_output(out, engine.runner.execute_model(out))
        return out

    while len((out := step()).scheduled) != batch or out.num_scheduled_tokens != batch:
        pass
    times = {True: [], False: []}
    for i in range(steps * 2):
        flag = (i % 4) in (0, 3)   # ABBA
        layers.CPU_ONEDNN_LINEAR = flag
        start = time.perf_counter()
        step()
        times[flag].append(time.perf_counter() - start)
    layers.CPU_ONEDNN_LINEAR = True
    return {"batch": batch, "onednn_ms": [round(t * 1e3, 1) for t in times[True]],
            "aten_ms": [round(t * 1e3, 1) for t in times[False]],
            "onednn_median_ms": round(statistics.median(times[True]) * 1e3, 1),
            "aten_median_ms": round(statistics.median(times[False]) * 1e3, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = [run(b, args.steps, args.threads) for b in (args.batch, 1)]
    for r in results:
        print(f"batch {r['batch']}: decode step median oneDNN {r['onednn_median_ms']} ms, "
              f"ATen {r['aten_median_ms']} ms ({r['aten_median_ms'] / r['onednn_median_ms']:.2f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
