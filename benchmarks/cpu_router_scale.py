"""What the router costs as the cluster grows (issue 14: design for hundreds of instances), on CPU.

N mock instances (one process serving N ports: each answers /v1/load as an idle colocated pdserve instance and
one token for every completion, at once) behind one `pdserve proxy`, for N in --sizes:
  idle     the router's CPU (user + system, /proc) over --idle-seconds with no request: the cost of polling
           N instances' /v1/load (every --poll-interval, or less often past the router's poll budget)
  load     `pdserve bench serve` at rate inf with --concurrency requests in flight (--num-prompts of
           --input-len tokens, 1 token out): requests per second, TTFT p50, and the router's CPU per request
           (the polls' CPU over that time included)
per --policies (cost needs the prompt's tokens: the router runs with --model default, as `pdserve up` starts it).
All processes share this machine's cores: the mocks' own CPU (answering the polls) competes with the router's.

  python benchmarks/cpu_router_scale.py --sizes 10,100,500 --out benchmarks/results/cpu-router-scale-DATE.json
  python benchmarks/cpu_router_scale.py route --sizes 10,500 [--max-candidates 0] [--shared-first-block]
                                                        # Router.route alone, in process
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import procs  # noqa: E402
from cpu_router_overhead import cpu_seconds, mock_app  # noqa: E402


def serve_mocks(first_port: int, count: int) -> None:
    """`count` idle colocated instances (cpu_router_overhead.mock_app) on first_port.., in one process and one
    event loop."""
    import asyncio

    from aiohttp import web

    async def run() -> None:
        for port in range(first_port, first_port + count):
            runner = web.AppRunner(mock_app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        print(f"serving {count} mocks", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


def bench(url: str, out: Path, args: argparse.Namespace) -> dict:
    subprocess.run([sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", url, "--model", "mock",
                    "--num-prompts", str(args.num_prompts), "--request-rate", "inf", "--max-concurrency",
                    str(args.concurrency), "--input-len", str(args.input_len), "--output-len", "1", "--range-ratio", "0",
                    "--temperature", "0", "--seed", "0", "--out", str(out), "--no-progress"],
                   check=True, stdout=subprocess.DEVNULL, timeout=3600)
    return json.loads(out.read_text())["metrics"]


def measure(args: argparse.Namespace, work: Path, size: int, policy: str) -> dict:
    proxy_url = f"http://127.0.0.1:{args.port}"
    first = args.port + 1
    urls = [f"http://127.0.0.1:{p}" for p in range(first, first + size)]
    procs.refuse_if_answering(proxy_url)
    mocks = procs.start([sys.executable, __file__, "mocks", str(first), str(size)], work / f"mocks-{size}.log")
    proxy = None
    try:
        procs.wait_ready(urls[-1], mocks, 120)
        proxy = procs.start([sys.executable, "-m", "pdserve", "proxy", "--colocated", *urls, "--port", str(args.port),
                             "--policy", policy, "--poll-interval", str(args.poll_interval), "--model", "default",
                             *args.router_args.split()],
                            work / f"proxy-{size}-{policy}.log")
        procs.wait_ready(proxy_url, proxy, 300)
        time.sleep(2.0)   # every instance polled once at least
        before, start = cpu_seconds(proxy.pid), time.monotonic()
        time.sleep(args.idle_seconds)
        idle = (cpu_seconds(proxy.pid) - before) / (time.monotonic() - start)
        bench(proxy_url, work / f"warmup-{size}-{policy}.json", argparse.Namespace(**{**vars(args), "num_prompts": 200}))
        before = cpu_seconds(proxy.pid)
        m = bench(proxy_url, work / f"load-{size}-{policy}.json", args)
        used = cpu_seconds(proxy.pid) - before
        row = {"instances": size, "policy": policy, "idle_router_cpu_fraction": idle,
               "request_throughput": m["request_throughput"], "ttft_p50_ms": m["ttft_ms"]["p50"],
               "num_failed": m["num_failed"], "router_cpu_us_per_request": 1e6 * used / max(m["num_completed"], 1)}
        print(f"  {size:>4} instances, {policy:>11}: idle router CPU {100 * idle:5.1f} % of a core, "
              f"{row['request_throughput']:7.0f} req/s, TTFT p50 {row['ttft_p50_ms']:6.2f} ms, "
              f"{row['router_cpu_us_per_request']:5.0f} us CPU/request, {row['num_failed']} failed", flush=True)
        return row
    finally:
        if proxy is not None:
            procs.stop(proxy)
        procs.stop(mocks, timeout=10)


def route_only(argv: list[str]) -> None:
    """Router.route's own time per request, in this process: no HTTP, no polls; idle colocated instances
    and random 64-token prompts."""
    import random

    from pdserve.router.instances import Instance
    from pdserve.router.policy import Router, RouterConfig
    p = argparse.ArgumentParser(prog="cpu_router_scale.py route")
    p.add_argument("--sizes", default="10,500")
    p.add_argument("--policies", default="round-robin,prefix-affinity,cost")
    p.add_argument("--max-candidates", type=int, default=None, help="default: the router's")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--out", type=Path, default=None, help="also save the figures as JSON")
    p.add_argument("--shared-first-block", action="store_true",
                   help="every instance holds the prompts' first block (a chat template's), in the prefix index")
    args = p.parse_args(argv)
    report = {"boot_id": "b", "kv_role": None, "healthy": True, "health": "ok", "block_size": 16,
              "hash_extra": "", "num_blocks": 100000, "num_free_blocks": 100000, "num_requests_running": 0,
              "num_requests_waiting": 0, "kv_events": {"last_seq": 0, "reset": False, "snapshot": None, "batches": []}}
    rows = []
    for size in (int(n) for n in args.sizes.split(",")):
        for policy in args.policies.split(","):
            instances = [Instance(f"i{i}", f"http://127.0.0.1:{30000 + i}", "colocated") for i in range(size)]
            for inst in instances:
                inst.update(dict(report), time.monotonic())
            config = RouterConfig() if args.max_candidates is None else RouterConfig(max_candidates=args.max_candidates)
            router, rng = Router(instances, policy, config), random.Random(0)
            head = [rng.randrange(1000) for _ in range(16)] if args.shared_first_block else []
            reqs = [router.request(64, 1, head + [rng.randrange(1000) for _ in range(64 - len(head))])
                    for _ in range(args.requests)]
            if head:
                first = router.request(16, 1, head).block_hashes
                for inst in instances:
                    router.index.apply_report(inst.name, {"last_seq": 1, "reset": True, "snapshot": list(first),
                                                          "batches": []}, time.monotonic())
            start = time.perf_counter()
            for req in reqs:
                router.route(req, now=time.monotonic())
            us = 1e6 * (time.perf_counter() - start) / len(reqs)
            rows.append({"instances": size, "policy": policy, "us_per_route": us})
            print(f"{size:>5} instances, {policy:>15}: {us:7.0f} µs a route", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": {k: str(v) for k, v in
                                                                                   vars(args).items()},
                                        "rows": rows}, indent=1))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "mocks":
        serve_mocks(int(sys.argv[2]), int(sys.argv[3]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "route":
        route_only(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10,100,500")
    p.add_argument("--policies", default="round-robin,cost")
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--poll-interval", type=float, default=0.1, help="the router's (its default)")
    p.add_argument("--router-args", default="", help="more `pdserve proxy` flags, e.g. '--max-candidates 0 "
                   "--max-polls-per-second 1e9' for the router as it was before both limits (a full scan, every "
                   "instance polled every interval)")
    p.add_argument("--idle-seconds", type=float, default=10.0)
    p.add_argument("--num-prompts", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp"))
    args = p.parse_args()
    work = args.work_dir / args.out.stem
    work.mkdir(parents=True, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "args": {k: str(v) for k, v in vars(args).items()},
              "rows": []}
    for size in (int(s) for s in args.sizes.split(",")):
        for policy in args.policies.split(","):
            result["rows"].append(measure(args, work, size, policy))
            args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
