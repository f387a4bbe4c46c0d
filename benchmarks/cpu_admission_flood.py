"""Admission under a flood: N concurrent requests through `pdserve up`'s proxy on CPU.

What a user expects at the front door: every request gets a 200 or a 503 with Retry-After (never a
502 blaming a healthy instance, never a hang), every instance is idle afterwards, and the next request
succeeds. Prints and saves the counts.

  python benchmarks/cpu_admission_flood.py --num-requests 2000 --out benchmarks/results/cpu-admission-flood-DATE.json
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

IDLE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
               "num_blocks_held_for_transfer")


async def flood(url: str, num_requests: int) -> tuple[list[tuple], float]:
    import aiohttp
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=900)) as session:
        async def one(i: int) -> tuple:
            try:
                async with session.post(f"{url}/v1/completions",
                                        json={"prompt": f"Hello number {i}", "max_tokens": 4}) as resp:
                    await resp.read()
                    return resp.status, resp.headers.get("Retry-After")
            except Exception as e:  # noqa: BLE001 - counted by kind
                return type(e).__name__, None
        start = time.monotonic()
        answers = await asyncio.gather(*(one(i) for i in range(num_requests)))
        return answers, time.monotonic() - start


def gauges(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {k: float(v) for k, v in re.findall(r"^pdserve:(\w+) (\S+)$", text, re.M) if k in IDLE_GAUGES}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--port", type=int, default=24000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    log_path = args.out.with_suffix(".up.log")
    up = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--port", str(args.port)],
                          stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 600
        while "cluster ready" not in log_path.read_text():
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up did not start; see {log_path}")
            time.sleep(1)
        answers, seconds = asyncio.run(flood(url, args.num_requests))
        statuses = collections.Counter(str(status) for status, _ in answers)
        time.sleep(3)
        idle = {port: gauges(port) for port in (args.port + 1, args.port + 2)}
        after = urllib.request.urlopen(urllib.request.Request(
            f"{url}/v1/completions", data=json.dumps({"prompt": "The capital of France is", "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"}), timeout=120).status
        result = {"date": time.strftime("%Y-%m-%d"), "num_requests": args.num_requests, "seconds": seconds,
                  "statuses": dict(statuses),
                  "num_503_with_retry_after": sum(1 for s, r in answers if s == 503 and r),
                  "instances_after": idle, "next_request_status": after}
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        is_clean = set(statuses) <= {"200", "503"} and result["num_503_with_retry_after"] == statuses.get("503", 0)
        is_idle = all(v == 0 for g in idle.values() for v in g.values())
        return 0 if is_clean and is_idle and after == 200 else 1
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGTERM)
            up.wait(60)
        log_path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
