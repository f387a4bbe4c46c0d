"""How long the simulator takes at the issue's scale: a 1,000-instance cluster, a million requests.

    .venv/bin/python benchmarks/plan_scale.py [--instances 1000] [--requests 1000000] [--out F.json]

Decode-heavy requests (prompts 256-1,024, answers 512-1,024) at 10 req/s per instance (about 80 % of what
one H200 instance sustains under TPOT <= 30 ms, docs/planner.md), on the shipped H200 profile, through
a 3:7 P:D split and through as many colocated instances; the router picks by least load, two random
choices at this size. Prints wall seconds, simulated seconds, engine steps and steps per second.
"""
from __future__ import annotations

import argparse
import json
import time

from pdserve.planner.plan import DEFAULT_PROFILE, load_lengths
from pdserve.planner.profile import load_step_model
from pdserve.planner.simulator import ClusterSpec, EngineSpec, Workload, simulate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, default=1000)
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--rate-per-instance", type=float, default=10.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = load_step_model(DEFAULT_PROFILE)
    prompt, output = load_lengths("decode-heavy", args.requests, seed=0)
    workload = Workload.poisson(args.rate_per_instance * args.instances, prompt, output)
    engine = EngineSpec(max_num_seqs=512, max_num_batched_tokens=9216)
    rows = []
    num_p = args.instances * 3 // 10
    for cluster in (ClusterSpec(num_prefill=num_p, num_decode=args.instances - num_p, engine=engine),
                    ClusterSpec(num_colocated=args.instances, engine=engine)):
        start = time.perf_counter()
        result = simulate(cluster, model, workload)
        wall = time.perf_counter() - start
        summary = result.summary(2.0, 0.030)
        row = {"cluster": cluster.describe(), "requests": len(workload), "wall_s": round(wall, 1),
               "simulated_s": round(summary["duration_s"], 1), "steps": result.steps,
               "steps_per_wall_s": round(result.steps / wall), "slo_attainment_2s_30ms": summary["slo_attainment"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"instances": args.instances, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
