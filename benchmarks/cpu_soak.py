"""Soak: many requests through a local xPyD cluster (`pdserve up`) at a fraction of its capacity on CPU.

What it checks (issue 13's soak): no failed request, no leaked KV blocks or requests on any instance at
the end, and every process's resident memory flat after warm-up (the curve is saved).

  1. start `pdserve up --num-prefill P --num-decode D` on 127.0.0.1 (its own process group)
  2. capacity: --probe-prompts requests kept --probe-concurrency at a time (a closed loop, so the queue
     stays put); the cluster's sustained rate is the completions per second between the first and the
     last fifth of them (no ramp-up, no drain). A burst (all at once) overstates it: the 2026-12-01 soak
     measured 8.30 req/s from a 200-request burst and then sustained only 5.76
  3. soak: --num-prompts requests at --load x that throughput (Poisson arrivals), through the proxy,
     while every process's RSS (VmRSS of the proxy, each `pdserve serve` and its engine process) is
     sampled every --rss-interval seconds
  4. leak check on every instance's /metrics after the last answer; save everything as JSON

  python benchmarks/cpu_soak.py --num-prompts 10000 --out benchmarks/results/cpu-soak-DATE.json
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import procs  # noqa: E402

LEAK_GAUGES = ("num_requests_running", "num_requests_waiting", "num_requests_waiting_for_remote_kvs",
               "num_blocks_held_for_transfer", "kv_cache_usage_perc")


def descendants(pid: int) -> list[int]:
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for c in map(int, children):
            out.append(c)
            stack.append(c)
    return out


def rss_mib(pid: int) -> float | None:
    try:
        m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
    return int(m.group(1)) / 1024 if m else None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {k: float(v) for k, v in re.findall(r"^pdserve:(\w+) (\S+)$", text, re.M)}


def sustained_rate(records: list[dict], trim: float = 0.2) -> float:
    """Completions per second between the first and the last `trim` of the completions."""
    ends = sorted(r["start_time"] + r["e2e"] for r in records if r["success"])
    lo, hi = int(len(ends) * trim), int(len(ends) * (1 - trim)) - 1
    if hi - lo < 10:
        raise ValueError(f"too few completed requests ({len(ends)}) to measure a sustained rate")
    return (hi - lo) / (ends[hi] - ends[lo])


def bench(base_url: str, args: argparse.Namespace, num_prompts: int, rate: str, out: Path,
          max_concurrency: int | None = None) -> dict:
    cmd = [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", base_url, "--num-prompts",
           str(num_prompts), "--request-rate", rate, "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--range-ratio", "0.5", "--ignore-eos", "--temperature", "0", "--seed",
           str(args.seed), "--out", str(out), "--no-progress"]
    if max_concurrency is not None:
        cmd += ["--max-concurrency", str(max_concurrency)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prefill", type=int, default=2)
    parser.add_argument("--num-decode", type=int, default=2)
    parser.add_argument("--port", type=int, default=28000)
    parser.add_argument("--num-prompts", type=int, default=10000)
    parser.add_argument("--probe-prompts", type=int, default=600)
    parser.add_argument("--probe-concurrency", type=int, default=64,
                        help="requests in flight during the capacity probe (enough to fill the batches)")
    parser.add_argument("--load", type=float, default=0.8, help="fraction of the measured capacity")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rss-interval", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="the summary JSON (RSS curve included)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp"),
                        help="where the per-request records of the probe and the soak and the cluster's log go")
    args = parser.parse_args()

    work = args.work_dir / args.out.stem
    log = open(work.with_suffix(".up.log"), "w")
    up = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--num-prefill", str(args.num_prefill),
                           "--num-decode", str(args.num_decode), "--port", str(args.port)],
                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{args.port}"
    instance_ports = [args.port + 1 + i for i in range(args.num_prefill + args.num_decode)]
    samples: list[dict] = []
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 600
        while "cluster ready" not in Path(log.name).read_text():
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up did not start; see {log.name}")
            time.sleep(1)
        pids = {pid: cmdline(pid) for pid in descendants(up.pid)}

        def sample_rss() -> None:
            start = time.monotonic()
            while not stop.is_set():
                samples.append({"t": round(time.monotonic() - start, 1),
                                "rss_mib": {str(pid): rss_mib(pid) for pid in pids}})
                stop.wait(args.rss_interval)

        probe = bench(base_url, args, args.probe_prompts, "inf", work.with_suffix(".probe.json"),
                      max_concurrency=args.probe_concurrency)
        capacity = sustained_rate(probe["requests"])
        rate = args.load * capacity
        print(f"capacity {capacity:.2f} req/s; soak at {rate:.2f} req/s for {args.num_prompts} requests", flush=True)
        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        soak = bench(base_url, args, args.num_prompts, f"{rate:.3f}", work.with_suffix(".soak.json"))
        stop.set()
        sampler.join()
        time.sleep(2)   # stats snapshots lag by up to 100 ms; leases by nothing (every request ended)
        leaks = {port: {k: v for k, v in metrics(port).items() if k in LEAK_GAUGES and v != 0}
                 for port in instance_ports}
        summary = soak["metrics"]
        result = {
            "date": time.strftime("%Y-%m-%d"), "cluster": f"{args.num_prefill}P{args.num_decode}D",
            "workload": {"input_len": args.input_len, "output_len": args.output_len, "range_ratio": 0.5,
                         "num_prompts": args.num_prompts},
            "capacity_req_s": capacity, "rate_req_s": rate,
            "probe": {"num_prompts": args.probe_prompts, "concurrency": args.probe_concurrency,
                      "num_failed": probe["metrics"].get("num_failed"),
                      "whole_run_req_s": probe["metrics"]["request_throughput"]},
            "num_completed": summary.get("num_completed"), "num_failed": summary.get("num_failed"),
            "request_throughput": summary.get("request_throughput"),
            "ttft_ms": summary["ttft_ms"], "tpot_ms": summary["tpot_ms"], "errors": summary.get("errors"),
            "leaks_at_end": leaks,
            "processes": {str(pid): cmd for pid, cmd in pids.items()},
            "rss_samples": samples,
        }
        args.out.write_text(json.dumps(result, indent=1))
        first, last = samples[min(2, len(samples) - 1)], samples[-1]   # after warm-up: the third sample on
        print(f"completed {result['num_completed']}, failed {result['num_failed']}, leaks {leaks or 'none'}")
        for pid, cmd in pids.items():
            print(f"  pid {pid} RSS {first['rss_mib'][str(pid)]} -> {last['rss_mib'][str(pid)]} MiB  {cmd[:90]}")
        return 0 if not result["num_failed"] and not any(leaks.values()) else 1
    finally:
        stop.set()
        procs.stop(up)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
