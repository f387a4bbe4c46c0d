"""What the router costs, on CPU (issue 14): time added to each request, and its own throughput.

  1. added TTFT, router alone: a mock instance (this script, `mock`: it answers /v1/load and a 1-token
     completion at once, in its own process) and `pdserve proxy` in front of it (as `pdserve up` starts it:
     --model, so it tokenizes prompts, and its default policy). The same `pdserve bench serve` workload
     (--rate req/s of --input-len-token prompts, 1 output token, streamed) goes straight to the mock and
     through the router, alternately, --repeats times each; the figure is the difference of TTFT p50 (each
     pair, and their median). The mock answers in well under a millisecond, so nothing but the router's
     hop differs.
  2. added TTFT, real instance: the same with one colocated `pdserve serve` on the default model, at
     --instance-rate req/s (a rate the instance sustains on this machine: at 100 req/s of 8-token prompts
     a 2-core machine's instance is overloaded and its queue, not the router, sets TTFT).
  3. the router's throughput: the router in front of --num-mocks mocks, driven at rate inf with
     --mock-concurrency requests in flight. Reported: requests per second, and the router process's CPU
     time per request (from /proc: user + system), which bounds what one core can route whatever the
     client's own speed.

All processes share this machine's cores (2 here): every figure includes that contention.

  python benchmarks/cpu_router_overhead.py --out benchmarks/results/cpu-router-overhead-DATE.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import procs  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def bench(base_url: str, out: Path, args: argparse.Namespace, num_prompts: int, rate: str,
          max_concurrency: int | None = None, model: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", base_url, "--num-prompts",
           str(num_prompts), "--request-rate", rate, "--input-len", str(args.input_len), "--output-len", "1",
           "--range-ratio", "0", "--temperature", "0", "--seed", str(args.seed), "--out", str(out), "--no-progress"]
    if max_concurrency is not None:
        cmd += ["--max-concurrency", str(max_concurrency)]
    if model is not None:
        cmd += ["--model", model]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    return json.loads(out.read_text())["metrics"]


def summary(m: dict) -> dict:
    return {"num_completed": m["num_completed"], "num_failed": m["num_failed"],
            "request_throughput": m["request_throughput"], "ttft_ms": m["ttft_ms"]}


def start_mocks(ports: list[int], work: Path) -> list:
    mocks = [procs.start([sys.executable, __file__, "mock", "--port", str(port)], work / f"mock-{port}.log")
             for port in ports]
    for port, mock in zip(ports, mocks):
        procs.wait_ready(f"http://127.0.0.1:{port}", mock, 60)
    return mocks


def added_ttft(args: argparse.Namespace, work: Path, backend: str, loop: str) -> dict:
    """backend: "mock" or "instance"; loop: the router's event loop, uvloop or asyncio."""
    backend_url, proxy_url = f"http://127.0.0.1:{args.port + 1}", f"http://127.0.0.1:{args.port}"
    for url in (backend_url, proxy_url):
        procs.refuse_if_answering(url)
    rate = args.rate if backend == "mock" else args.instance_rate
    num_prompts = args.num_prompts if backend == "mock" else args.instance_prompts
    model = "mock" if backend == "mock" else None
    if backend == "mock":
        servers = start_mocks([args.port + 1], work)
    else:
        servers = [procs.start([sys.executable, "-m", "pdserve", "serve", "--port", str(args.port + 1)],
                               work / "instance.log")]
        procs.wait_ready(backend_url, servers[0], 600)
    proxy = None
    try:
        proxy = procs.start([sys.executable, "-m", "pdserve", "proxy", "--colocated", backend_url, "--port",
                             str(args.port), "--model", "default"], work / f"proxy-{backend}-{loop}.log",
                            env={"PDSERVE_UVLOOP": "1" if loop == "uvloop" else "0"})
        procs.wait_ready(proxy_url, proxy, 300)
        bench(proxy_url, work / f"{backend}-warmup.json", args, 200, str(rate), model=model)
        runs: dict[str, list[dict]] = {"direct": [], "router": []}
        for i in range(args.repeats):
            for name, url in (("direct", backend_url), ("router", proxy_url)):
                m = bench(url, work / f"{backend}-{name}-{i}.json", args, num_prompts, str(rate), model=model)
                runs[name].append(summary(m))
                print(f"  {backend} {name} {i}: TTFT p50 {m['ttft_ms']['p50']:.2f} ms, "
                      f"{m['request_throughput']:.1f} req/s, {m['num_failed']} failed", flush=True)
        added = [r["ttft_ms"]["p50"] - d["ttft_ms"]["p50"] for d, r in zip(runs["direct"], runs["router"])]
        return {"event_loop": loop, "rate_req_s": rate, "input_len": args.input_len, "num_prompts": num_prompts, "runs": runs,
                "added_ttft_p50_ms": added, "added_ttft_p50_ms_median": statistics.median(added)}
    finally:
        if proxy is not None:
            procs.stop(proxy)
        for server in servers:
            procs.stop(server)


def router_throughput(args: argparse.Namespace, work: Path, loop: str) -> dict:
    proxy_url = f"http://127.0.0.1:{args.port}"
    mock_urls = [f"http://127.0.0.1:{args.port + 1 + i}" for i in range(args.num_mocks)]
    for url in (proxy_url, *mock_urls):
        procs.refuse_if_answering(url)
    mocks = start_mocks([args.port + 1 + i for i in range(args.num_mocks)], work)
    proxy = None
    try:
        proxy = procs.start([sys.executable, "-m", "pdserve", "proxy", "--colocated", *mock_urls, "--port",
                             str(args.port)], work / f"proxy-throughput-{loop}.log",
                            env={"PDSERVE_UVLOOP": "1" if loop == "uvloop" else "0"})
        procs.wait_ready(proxy_url, proxy, 60)
        bench(proxy_url, work / "mock-warmup.json", args, 500, "inf", args.mock_concurrency, model="mock")
        before = cpu_seconds(proxy.pid)
        m = bench(proxy_url, work / "mock.json", args, args.mock_prompts, "inf", args.mock_concurrency, model="mock")
        used = cpu_seconds(proxy.pid) - before
        return {"event_loop": loop, "num_mocks": args.num_mocks, "concurrency": args.mock_concurrency, **summary(m),
                "router_cpu_s": used, "router_cpu_us_per_request": 1e6 * used / max(m["num_completed"], 1)}
    finally:
        if proxy is not None:
            procs.stop(proxy)
        for mock in mocks:
            procs.stop(mock, timeout=10)


def mock_app():
    """An instance that answers at once: /v1/load as a colocated pdserve instance with nothing to do (a boot of
    its own), and one token for every completion (JSON or SSE)."""
    from aiohttp import web

    from pdserve import protocol
    report = json.dumps({"boot_id": uuid.uuid4().hex, "kv_role": None, "healthy": True, "health": "ok",
                         "block_size": 16, "hash_extra": "", "num_blocks": 100000, "num_free_blocks": 100000,
                         "num_requests_running": 0, "num_requests_waiting": 0,
                         "kv_events": {"last_seq": 0, "reset": False, "snapshot": None, "batches": []}})

    async def load(request: web.Request) -> web.Response:
        return web.Response(text=report, content_type="application/json")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        usage = protocol.usage(8, 1)
        if not body.get("stream"):
            return web.json_response(protocol.completion_response("id-m", "mock", "x", "length", usage))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        chunk = protocol.completion_chunk("id-m", "mock", 0, "x")
        if body.get("router_token_ids"):
            chunk["router_token_ids"] = [42]
        await out.write(protocol.sse_event(chunk) + protocol.sse_event(
            protocol.completion_chunk("id-m", "mock", 0, "", "length")))
        if (body.get("stream_options") or {}).get("include_usage"):
            await out.write(protocol.sse_event(protocol.usage_chunk("id-m", "mock", 0, usage, chat=False)))
        await out.write(protocol.SSE_DONE)
        await out.write_eof()
        return out

    app = web.Application()
    app.add_routes([web.get("/health", lambda r: web.json_response({"status": "ok"})), web.get("/v1/load", load),
                    web.get("/v1/models", lambda r: web.json_response(protocol.models_response("mock", 2048))),
                    web.post("/v1/completions", completions)])
    return app


def serve_mock(port: int) -> None:
    from aiohttp import web
    web.run_app(mock_app(), host="127.0.0.1", port=port, print=None, access_log=None)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "mock":
        serve_mock(int(sys.argv[sys.argv.index("--port") + 1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=29000)
    parser.add_argument("--rate", type=float, default=100.0, help="req/s through the mock")
    parser.add_argument("--instance-rate", type=float, default=10.0, help="req/s through the real instance")
    parser.add_argument("--instance-prompts", type=int, default=600)
    parser.add_argument("--input-len", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-mocks", type=int, default=2)
    parser.add_argument("--mock-concurrency", type=int, default=64)
    parser.add_argument("--mock-prompts", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--event-loops", default="uvloop,asyncio",
                        help="the router's event loop in turn (PDSERVE_UVLOOP), for the mock and throughput parts")
    parser.add_argument("--skip", choices=["mock", "instance", "throughput"], action="append", default=[])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    work = args.work_dir / args.out.stem
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count()}
    loops = args.event_loops.split(",")
    for backend in ("mock", "instance"):
        for loop in loops if backend == "mock" else loops[:1]:
            if backend not in args.skip:
                print(f"added TTFT: straight to the {backend} vs through the router ({loop})", flush=True)
                result.setdefault(f"added_ttft_{backend}", []).append(r := added_ttft(args, work, backend, loop))
                print(f"added TTFT p50 ({backend}, {loop}): {[round(x, 2) for x in r['added_ttft_p50_ms']]} ms",
                      flush=True)
                args.out.write_text(json.dumps(result, indent=1))
    for loop in loops if "throughput" not in args.skip else ():
        print(f"router throughput on mock instances ({loop})", flush=True)
        result.setdefault("throughput", []).append(t := router_throughput(args, work, loop))
        print(f"router ({loop}): {t['request_throughput']:.0f} req/s, {t['router_cpu_us_per_request']:.0f} us CPU "
              f"per request, {t['num_failed']} failed", flush=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
