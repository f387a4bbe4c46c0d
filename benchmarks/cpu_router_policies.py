"""The router's policies on CPU: the same xPyD cluster, the same workloads, one routing configuration at a time.

For every configuration (policy, --pd-min-prompt-tokens) and workload:
  1. start `pdserve up --num-prefill P --num-decode D --policy X --pd-min-prompt-tokens T` on 127.0.0.1
     (a fresh cluster each time: every configuration starts with cold prefix caches)
  2. run `pdserve bench serve` with the workload through the router
  3. read the router's GET /cluster (decisions by reason, picks) and stop the cluster
Then it prints a table and saves everything as JSON, with TTFT p50 of each configuration relative to
round-robin on the same workload. With --repeats N the configurations run N times, in alternating order
(forward, backward, ...) so that a drift of the machine's speed falls on all of them alike; the table then
gives the mean of the runs' p50s and their spread, which is the noise a difference must exceed.

Workloads (pdserve bench's datasets, chat endpoint):
  multi-turn  --num-users users in --num-groups groups sharing a system prompt, each resending its growing
              history (the prefix-shared workload of issue 14)
  mixed       independent requests, mostly short prompts, some long ones

  python benchmarks/cpu_router_policies.py --out benchmarks/results/cpu-router-policies-DATE.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import procs  # noqa: E402

SHORT_PROMPT_TOKENS = 256   # the TTFT split by prompt: below this a prompt is short (the mixed workload's)
DEFAULT_CONFIGS = "round-robin:0,least-load:0,prefix-affinity:0,cost:0,cost:256"
WORKLOADS = {
    "multi-turn": ["--dataset", "multi-turn", "--num-users", "24", "--num-turns", "4", "--num-groups", "4",
                   "--prefix-len", "384", "--turn-len", "48", "--output-len", "24"],
    "mixed": ["--dataset", "mixed", "--num-prompts", "80", "--short-fraction", "0.8", "--short-len", "32", "128",
              "--long-len", "768", "1024", "--output-len", "24"],
}


def run_one(args: argparse.Namespace, policy: str, threshold: int, tolerance: float | None, workload: str,
            work: Path) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    name = f"{workload}-{policy}-{threshold}-{tolerance}"
    procs.refuse_if_answering(url)
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pdserve", "up", "--num-prefill", str(args.num_prefill), "--num-decode",
           str(args.num_decode), "--port", str(args.port), "--policy", policy,
           "--pd-min-prompt-tokens", str(threshold)]
    if tolerance is not None:
        cmd += ["--cost-tolerance", str(tolerance)]
    proc = procs.start(cmd, work / f"{name}.up.log")
    try:
        procs.wait_ready(url, proc, 600)
        out = work / f"{name}.json"
        bench = [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", url, "--endpoint", "chat",
                 "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--no-progress",
                 "--out", str(out), *WORKLOADS[workload]]
        if args.num_prompts is not None and workload == "mixed":
            bench[bench.index("--num-prompts") + 1] = str(args.num_prompts)
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL, timeout=3600)
        result = json.loads(out.read_text())
        cluster = procs.get_json(url + "/cluster")
    finally:
        procs.stop(proc)
    metrics = result.get("metrics", result)
    by_length = {}
    for label, keep in (("short", lambda n: n < SHORT_PROMPT_TOKENS), ("long", lambda n: n >= SHORT_PROMPT_TOKENS)):
        ttfts = [r["ttft"] * 1e3 for r in result.get("requests", [])
                 if r.get("success") and r.get("ttft") is not None and keep(r.get("prompt_tokens") or 0)]
        by_length[label] = {"n": len(ttfts), "p50": statistics.median(ttfts) if ttfts else None}
    return {"workload": workload, "policy": policy, "pd_min_prompt_tokens": threshold, "cost_tolerance": tolerance,
            "num_completed": metrics["num_completed"], "num_failed": metrics["num_failed"],
            "ttft_ms": metrics["ttft_ms"], "tpot_ms": metrics["tpot_ms"], "e2e_ms": metrics["e2e_ms"],
            "request_throughput": metrics["request_throughput"], "per_turn": metrics.get("per_turn"),
            "ttft_ms_by_prompt_length": by_length,
            "decisions": cluster.get("decisions"), "picks": cluster.get("picks"),
            "sent": {i["name"]: i.get("sent") for i in cluster.get("instances", [])}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="POLICY:T[:F],... (T: --pd-min-prompt-tokens; F: --cost-tolerance, else the router's default)")
    p.add_argument("--workloads", default="multi-turn,mixed")
    p.add_argument("--num-prefill", type=int, default=2)
    p.add_argument("--num-decode", type=int, default=2)
    p.add_argument("--request-rate", type=float, default=2.0, help="new requests (conversations) per second")
    p.add_argument("--port", type=int, default=8600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="runs of every configuration, in alternating order")
    p.add_argument("--num-prompts", type=int, default=None, help="mixed: requests per run (default 80)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    configs = []
    for c in args.configs.split(","):
        fields = c.split(":")
        configs.append((fields[0], int(fields[1]) if len(fields) > 1 else 0,
                        float(fields[2]) if len(fields) > 2 else None))
    runs = []
    with tempfile.TemporaryDirectory(prefix="pdserve-policies-") as tmp:
        for workload in args.workloads.split(","):
            for repeat in range(args.repeats):
                for policy, threshold, tolerance in (configs if repeat % 2 == 0 else configs[::-1]):
                    print(f"[policies] {workload} run {repeat + 1}: {policy}, pd-min-prompt-tokens {threshold}, "
                          f"cost-tolerance {tolerance}", flush=True)
                    run = run_one(args, policy, threshold, tolerance, workload, Path(tmp) / str(repeat))
                    run["repeat"] = repeat
                    runs.append(run)
                    short, long = (run["ttft_ms_by_prompt_length"][k]["p50"] for k in ("short", "long"))
                    print(f"  TTFT p50 {run['ttft_ms']['p50']:.1f} ms (short {short}, long {long}), p90 "
                          f"{run['ttft_ms']['p90']:.1f} ms; TPOT p50 {run['tpot_ms']['p50']:.1f} ms; "
                          f"{run['num_completed']} ok, {run['num_failed']} failed; decisions {run['decisions']}",
                          flush=True)
    for run in runs:
        base = next(r for r in runs if r["workload"] == run["workload"] and r["policy"] == "round-robin"
                    and r["pd_min_prompt_tokens"] == 0 and r["repeat"] == run["repeat"])
        run["ttft_p50_vs_round_robin"] = run["ttft_ms"]["p50"] / base["ttft_ms"]["p50"]
    summary = []
    for workload in args.workloads.split(","):
        for policy, threshold, tolerance in configs:
            mine = [r for r in runs if (r["workload"], r["policy"], r["pd_min_prompt_tokens"], r["cost_tolerance"]) ==
                    (workload, policy, threshold, tolerance)]
            p50s = [r["ttft_ms"]["p50"] for r in mine]
            ratios = [r["ttft_p50_vs_round_robin"] for r in mine]
            summary.append({"workload": workload, "policy": policy, "pd_min_prompt_tokens": threshold,
                            "cost_tolerance": tolerance, "runs": len(mine), "ttft_p50_ms_mean": statistics.mean(p50s),
                            "ttft_p50_ms_min": min(p50s), "ttft_p50_ms_max": max(p50s),
                            "ttft_p90_ms_mean": statistics.mean(r["ttft_ms"]["p90"] for r in mine),
                            "tpot_p50_ms_mean": statistics.mean(r["tpot_ms"]["p50"] for r in mine),
                            "vs_round_robin_mean": statistics.mean(ratios),
                            "vs_round_robin_min": min(ratios), "vs_round_robin_max": max(ratios),
                            "num_failed": sum(r["num_failed"] for r in mine)})
    print(f"\n{'workload':<12}{'policy':<17}{'T':>5}{'runs':>5}{'TTFT p50':>10}{'min-max':>15}{'p90':>9}"
          f"{'TPOT p50':>10}{'vs rr':>7}{'min-max':>12}{'failed':>8}")
    for r in summary:
        label = r["policy"] if r["cost_tolerance"] is None else f"{r['policy']} tol {r['cost_tolerance']:g}"
        print(f"{r['workload']:<12}{label:<17}{r['pd_min_prompt_tokens']:>5}{r['runs']:>5}"
              f"{r['ttft_p50_ms_mean']:>10.1f}{r['ttft_p50_ms_min']:>8.0f}-{r['ttft_p50_ms_max']:<6.0f}"
              f"{r['ttft_p90_ms_mean']:>9.1f}{r['tpot_p50_ms_mean']:>10.1f}{r['vs_round_robin_mean']:>7.2f}"
              f"{r['vs_round_robin_min']:>7.2f}-{r['vs_round_robin_max']:<4.2f}{r['num_failed']:>8}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "summary": summary,
                                         "runs": runs},
                                         indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
