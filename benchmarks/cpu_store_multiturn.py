"""Multi-turn conversations on two instances, with and without the KV store (issue 16): TTFT when a
conversation's next turn lands on the other instance, which without the store has none of its history.

For each configuration, in alternating order over --repeats:
  none   `pdserve up --num-colocated 2 --policy round-robin` (each instance's own prefix cache only)
  store  the same with `--kv-connector store`: `up` starts a `pdserve kv-store`, both instances insert every
         finished prompt there and load a prompt's longest stored prefix
then `pdserve bench serve --endpoint chat --dataset multi-turn` through the router: --num-users
conversations of --num-turns turns, each turn resending the whole history. Round-robin sends consecutive
turns of one conversation to different instances about half the time, which is the case the store is for
(a prefix-aware policy would hide it by keeping a conversation on one instance). Prints a table and saves
JSON, with the per-turn TTFT and the instances' store counters.

  python benchmarks/cpu_store_multiturn.py --out benchmarks/results/cpu-store-multiturn-DATE.json
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


def instance_counters(port: int, names: list[str]) -> dict:
    """These counters of both instances (`up` gives them the two ports after the router's; /metrics is open)."""
    import urllib.request
    out = {}
    for i in range(2):
        with urllib.request.urlopen(f"http://127.0.0.1:{port + 1 + i}/metrics", timeout=5) as r:
            text = r.read().decode()
        out[f"colocated-{i}"] = {line.split()[0].removeprefix("pdserve:"): float(line.split()[1])
                                 for line in text.splitlines()
                                 if line.startswith("pdserve:") and line.split()[0].removeprefix("pdserve:") in names}
    return out


def run_one(args: argparse.Namespace, config: str, work: Path) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    procs.refuse_if_answering(url)
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pdserve", "up", "--num-prefill", "0", "--num-decode", "0", "--num-colocated", "2",
           "--port", str(args.port), "--policy", "round-robin"]
    if config == "store":
        cmd += ["--kv-connector", "store", "--kv-store-capacity", args.store_capacity]
    proc = procs.start(cmd, work / f"{config}.up.log")
    try:
        procs.wait_ready(url, proc, 600)
        if config == "store":   # the instances connect to the store in the background
            deadline = time.monotonic() + 60
            while not all(c.get("kv_store_connected") for c in instance_counters(args.port, ["kv_store_connected"]).values()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the instances did not connect to the kv-store")
                time.sleep(0.5)
        out = work / f"{config}.json"
        bench = [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", url, "--endpoint", "chat",
                 "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--no-progress",
                 "--out", str(out), "--dataset", "multi-turn", "--num-users", str(args.num_users),
                 "--num-turns", str(args.num_turns), "--num-groups", str(args.num_users),
                 "--prefix-len", str(args.prefix_len), "--turn-len", str(args.turn_len),
                 "--output-len", str(args.output_len)]
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL, timeout=3600)
        result = json.loads(out.read_text())
        counters = instance_counters(args.port, ["kv_store_loaded_blocks_total", "kv_store_inserted_blocks_total",
                                           "kv_store_hits_total", "kv_store_lookups_total",
                                           "kv_transfer_failures_total", "prefix_cache_hits_total",
                                           "prefix_cache_queries_total"])
    finally:
        procs.stop(proc)
    metrics = result.get("metrics", result)
    return {"config": config, "num_completed": metrics["num_completed"], "num_failed": metrics["num_failed"],
            "ttft_ms": metrics["ttft_ms"], "tpot_ms": metrics["tpot_ms"], "e2e_ms": metrics["e2e_ms"],
            "request_throughput": metrics["request_throughput"], "per_turn": metrics.get("per_turn"),
            "instances": counters}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="none,store")
    p.add_argument("--num-users", type=int, default=12, help="conversations (each its own system prompt)")
    p.add_argument("--num-turns", type=int, default=5)
    p.add_argument("--prefix-len", type=int, default=512, help="tokens of each conversation's system prompt")
    p.add_argument("--turn-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--request-rate", type=float, default=0.3, help="new conversations per second")
    p.add_argument("--store-capacity", default="2GiB")
    p.add_argument("--repeats", type=int, default=2, help="runs of every configuration, in alternating order")
    p.add_argument("--port", type=int, default=8650)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    configs = args.configs.split(",")
    runs = []
    with tempfile.TemporaryDirectory(prefix="pdserve-store-") as tmp:
        for repeat in range(args.repeats):
            for config in (configs if repeat % 2 == 0 else configs[::-1]):
                print(f"[store] run {repeat + 1}: {config}", flush=True)
                run = run_one(args, config, Path(tmp) / str(repeat))
                run["repeat"] = repeat
                runs.append(run)
                print(f"  TTFT p50 {run['ttft_ms']['p50']:.1f} ms, p90 {run['ttft_ms']['p90']:.1f} ms; TPOT p50 "
                      f"{run['tpot_ms']['p50']:.1f} ms; {run['num_completed']} ok, {run['num_failed']} failed; "
                      f"{run['instances']}", flush=True)
    summary = []
    for config in configs:
        mine = [r for r in runs if r["config"] == config]
        p50s = [r["ttft_ms"]["p50"] for r in mine]
        summary.append({"config": config, "runs": len(mine), "ttft_p50_ms_mean": statistics.mean(p50s),
                        "ttft_p50_ms_min": min(p50s), "ttft_p50_ms_max": max(p50s),
                        "ttft_p90_ms_mean": statistics.mean(r["ttft_ms"]["p90"] for r in mine),
                        "tpot_p50_ms_mean": statistics.mean(r["tpot_ms"]["p50"] for r in mine),
                        "num_failed": sum(r["num_failed"] for r in mine)})
    base = summary[0]["ttft_p50_ms_mean"]
    print(f"\n{'config':<8}{'runs':>5}{'TTFT p50':>10}{'min-max':>15}{'p90':>9}{'TPOT p50':>10}{'vs first':>9}{'failed':>8}")
    for r in summary:
        r["vs_first"] = r["ttft_p50_ms_mean"] / base
        print(f"{r['config']:<8}{r['runs']:>5}{r['ttft_p50_ms_mean']:>10.1f}{r['ttft_p50_ms_min']:>8.0f}-"
              f"{r['ttft_p50_ms_max']:<6.0f}{r['ttft_p90_ms_mean']:>9.1f}{r['tpot_p50_ms_mean']:>10.1f}"
              f"{r['vs_first']:>9.2f}{r['num_failed']:>8}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "summary": summary,
                                         "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
