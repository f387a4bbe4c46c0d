"""The simulator against the measured GPU comparison: replay every request of every measured rate (its
arrival, prompt and answer lengths, as sent) through `pdserve.planner.simulator` on the H200 step
profile, and set the predicted SLO attainment, TTFT p90 and TPOT p90 beside the measured ones, and each
configuration's highest rate meeting the SLO (>= 90 % of requests, every lower rate too).

    .venv/bin/python benchmarks/plan_validate.py [--compare-dir benchmarks/results/gpu-compare-2026-11-29-s3]
        [--sweep benchmarks/results/gpu-plan-validate-2026-12-04/prefill-heavy.json=256 ...]
        [--profile pdserve/planner/profiles/h200-llama-3.1-8b.json] [--out F.json]

--compare-dir: the deployments are read from each configuration's JSON (instances, budget, chunking,
max_num_seqs); the router was round-robin, the handoff cuda_ipc (300 GB/s and 3 ms a request,
docs/benchmarks.md). --sweep FILE=MAX_NUM_SEQS: a `pdserve bench sweep` of one colocated instance as
benchmarks/gpu_plan_validate.sh runs it (9,216-token budget, no chunking).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from pdserve.planner.plan import DEFAULT_PROFILE
from pdserve.planner.profile import load_step_model
from pdserve.planner.simulator import ClusterSpec, EngineSpec, Workload, simulate

SLOS = [(2.0, 0.030), (2.0, 0.020), (2.0, 0.015)]


def flag(command: list[str], name: str, default):
    return type(default)(command[command.index(name) + 1]) if name in command else default


def cluster_of(deployment: dict) -> ClusterSpec:
    instances = deployment["instances"]
    command = instances[0]["command"]
    engine = EngineSpec(max_num_seqs=flag(command, "--max-num-seqs", 256),
                        max_num_batched_tokens=flag(command, "--max-num-batched-tokens", 2048),
                        enable_chunked_prefill="--no-chunked-prefill" not in command)
    roles = [i["role"] for i in instances]
    return ClusterSpec(num_prefill=roles.count("prefill"), num_decode=roles.count("decode"),
                       num_colocated=roles.count("colocated"), engine=engine, policy="round-robin")


def max_rate(rows: list[dict], key: str, target: float = 0.9) -> float | None:
    best = None
    for row in sorted(rows, key=lambda r: r["rate"]):
        if row[key] < target:
            break
        best = row["rate"]
    return best


def measured(requests: list[dict], slo_ttft: float, slo_tpot: float) -> float:
    ok = [r["success"] and r["ttft"] <= slo_ttft and (r["tpot"] or 0.0) <= slo_tpot for r in requests]
    return float(np.mean(ok))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare-dir", type=Path, default=None)
    p.add_argument("--profile", default=str(DEFAULT_PROFILE),
                   help="the step profile (default: the one `pdserve plan` ships, with its decode-kernel term)")
    p.add_argument("--sweep", action="append", default=[], metavar="FILE=MAX_NUM_SEQS")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = load_step_model(args.profile)
    report = {"profile": args.profile, "model": model.as_dict(), "runs": []}
    runs = []
    if args.compare_dir:
        for path in sorted(args.compare_dir.glob("*/*.json")):
            data = json.loads(path.read_text())
            if "deployment" in data and "results" in data:
                runs.append((path.parent.name, path.stem, data, cluster_of(data["deployment"])))
    for item in args.sweep:
        file, _, seqs = item.partition("=")
        engine = EngineSpec(max_num_seqs=int(seqs or 256), max_num_batched_tokens=9216, enable_chunked_prefill=False)
        runs.append((Path(file).stem, "colocated-1", json.loads(Path(file).read_text()),
                     ClusterSpec(num_colocated=1, engine=engine)))
    for workload_name, config, data, cluster in runs:
        rows = []
        for result in data["results"]:
            reqs = sorted(result["requests"], key=lambda r: r["scheduled_time"])
            workload = Workload([r["scheduled_time"] for r in reqs], [r["prompt_tokens"] for r in reqs],
                                [max(1, r["output_tokens"]) for r in reqs])
            sim = simulate(cluster, model, workload)
            row = {"rate": result["request_rate"], "requests": len(reqs)}
            for ttft, tpot in SLOS:
                tag = f"{int(ttft * 1e3)}/{int(tpot * 1e3)}"
                row[f"measured {tag}"] = measured(reqs, ttft, tpot)
                row[f"simulated {tag}"] = sim.attainment(ttft, tpot)
            ok = [r for r in reqs if r["success"]]
            row["measured ttft p90 ms"] = float(np.percentile([r["ttft"] for r in ok], 90) * 1e3)
            row["simulated ttft p90 ms"] = float(np.percentile(sim.ttft, 90) * 1e3)
            row["measured tpot p90 ms"] = float(np.percentile([r["tpot"] or 0.0 for r in ok], 90) * 1e3)
            row["simulated tpot p90 ms"] = float(np.percentile(sim.tpot, 90) * 1e3)
            rows.append(row)
        run = {"workload": workload_name, "config": config, "cluster": cluster.describe(), "rows": rows,
               "max_rate": {}}
        for ttft, tpot in SLOS:
            tag = f"{int(ttft * 1e3)}/{int(tpot * 1e3)}"
            run["max_rate"][tag] = {"measured": max_rate(rows, f"measured {tag}"),
                                    "simulated": max_rate(rows, f"simulated {tag}"),
                                    "highest_swept": max(r["rate"] for r in rows)}
        report["runs"].append(run)
        print(f"\n{workload_name} / {config} ({cluster.describe()})")
        for row in rows:
            print(f"  rate {row['rate']:5.1f}: attainment 2s/30ms measured {row['measured 2000/30']:.2f} "
                  f"simulated {row['simulated 2000/30']:.2f}; TTFT p90 {row['measured ttft p90 ms']:7.0f} / "
                  f"{row['simulated ttft p90 ms']:7.0f} ms; TPOT p90 {row['measured tpot p90 ms']:5.1f} / "
                  f"{row['simulated tpot p90 ms']:5.1f} ms")
        for tag, v in run["max_rate"].items():
            print(f"  max rate at {tag}: measured {v['measured']}, simulated {v['simulated']} "
                  f"(highest swept {v['highest_swept']})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
