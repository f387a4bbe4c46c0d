"""End to end on two GPUs: a 1P1D cluster (P on GPU 0, D on GPU 1, the proxy in front) against a
colocated instance on one GPU, the same requests, the same arrival times.

    PYTHONPATH=$PWD python3 benchmarks/gpu_e2e.py --model llama-3.1-8b --num-requests 64 \
        --input-len 1024 --output-len 128 --request-rate 8 [--kv-connector nixl|cuda_ipc]

Random weights of the model's shape (--load-format dummy, same --seed on every instance, so P, D and
the colocated instance hold identical weights). Prompts are random token ids; outputs are compared
token by token (return_token_ids). Reports TTFT / TPOT / ITL percentiles for both setups and writes
JSON (to --out, default benchmarks/results/gpu-e2e-<date>.json).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.e2e.cluster import Process  # noqa: E402  (the same process helpers as the tests)


def describe_gpus() -> str:
    names = [line.split(":")[1].split("(")[0].strip() for line in
             subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines()
             if line.startswith("GPU ")]
    return f"{len(names)}x {names[0]}" if names else "no GPU listed"


def child(args: list[str], gpu: str | None, log_dir: Path, name: str) -> Process:
    return Process(args, name, env={"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None,
                   log_dir=str(log_dir))


async def one_request(session, url: str, model: str, prompt: list[int], output_len: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    stamps, token_ids, error = [], [], None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}: {(await resp.text())[:300]}", "token_ids": [],
                        "ttft": None, "e2e": None, "itls": []}
            async for line in resp.content:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                for choice in chunk.get("choices") or ():
                    if choice.get("token_ids"):
                        stamps.append(time.perf_counter() - start)
                        token_ids += choice["token_ids"]
    except Exception as e:  # a failed request is reported, not dropped
        error = repr(e)
    return {"error": error, "token_ids": token_ids, "ttft": stamps[0] if stamps else None,
            "e2e": stamps[-1] if stamps else None,
            "itls": [b - a for a, b in zip(stamps, stamps[1:])]}


async def run_workload(url: str, model: str, prompts, output_len: int, arrivals) -> tuple[list[dict], float]:
    import aiohttp
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        await one_request(session, url, model, prompts[0][:32], 4, 0)  # warm-up, not measured
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(session, url, model, p, output_len, t)
                                          for p, t in zip(prompts, arrivals)))
        return results, time.perf_counter() - start


def percentiles(values: list[float]) -> dict:
    import numpy as np
    if not values:
        return {}
    arr = np.array(values) * 1e3
    return {"mean_ms": float(arr.mean()), "p50_ms": float(np.percentile(arr, 50)),
            "p90_ms": float(np.percentile(arr, 90)), "p99_ms": float(np.percentile(arr, 99))}


def summarize(results: list[dict], duration: float, output_len: int) -> dict:
    ok = [r for r in results if not r["error"]]
    tpots = [(r["e2e"] - r["ttft"]) / (len(r["token_ids"]) - 1) for r in ok if len(r["token_ids"]) > 1]
    return {"num_ok": len(ok), "num_failed": len(results) - len(ok), "duration_s": duration,
            "output_tokens_per_s": sum(len(r["token_ids"]) for r in ok) / duration,
            "ttft": percentiles([r["ttft"] for r in ok]), "tpot": percentiles(tpots),
            "itl": percentiles([x for r in ok for x in r["itls"]]),
            "errors": [r["error"] for r in results if r["error"]][:5]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=8.0)
    p.add_argument("--kv-connector", default="nixl")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--log-dir", default="/tmp/pdserve-e2e")
    p.add_argument("--gpus", default="0,1", help="P's and D's GPU (the colocated instance takes P's)")
    args = p.parse_args()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 30000) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(args.request_rate) if args.request_rate != float("inf") else 0.0
    common = ["serve", "--model", args.model, "--load-format", "dummy", "--seed", str(args.seed),
              "--dtype", args.dtype, "--max-model-len", str(args.input_len + args.output_len + 64)]

    gpu_p, gpu_d = args.gpus.split(",")
    children = []
    try:
        prefill = child(common + ["--kv-connector", args.kv_connector, "--kv-role", "producer"], gpu_p, log_dir, "prefill")
        decode = child(common + ["--kv-connector", args.kv_connector, "--kv-role", "consumer"], gpu_d, log_dir, "decode")
        children += [prefill, decode]
        prefill.wait_healthy(300), decode.wait_healthy(300)
        proxy = child(["proxy", "--prefill", prefill.url, "--decode", decode.url], None, log_dir, "proxy")
        children.append(proxy)
        proxy.wait_healthy(60)
        pd_results, pd_duration = asyncio.run(run_workload(proxy.url, args.model, prompts, args.output_len, arrivals))
    finally:
        for c in reversed(children):
            c.stop()
    colocated = child(common, gpu_p, log_dir, "colocated")
    try:
        colocated.wait_healthy(300)
        co_results, co_duration = asyncio.run(run_workload(colocated.url, args.model, prompts, args.output_len, arrivals))
    finally:
        colocated.stop()

    identical = sum(a["token_ids"] == b["token_ids"] and not a["error"] and not b["error"] for a, b in zip(pd_results, co_results))
    first_divergence = [next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y), None)
                        for a, b in zip(pd_results, co_results)]
    result = {
        "date": datetime.date.today().isoformat(), "machine": f"{describe_gpus()}; P on GPU {gpu_p}, D on GPU {gpu_d}",
        "args": vars(args),
        "disaggregated_1p1d": summarize(pd_results, pd_duration, args.output_len),
        "colocated_1gpu": summarize(co_results, co_duration, args.output_len),
        "outputs_identical": identical, "num_requests": len(prompts),
        "first_divergence_positions": [d for d in first_divergence if d is not None],
        # in arrival order: a one-time stall (a compile, a first mapping) shows as a run of slow TTFTs
        "ttft_s_by_arrival": {"disaggregated_1p1d": [r["ttft"] and round(r["ttft"], 3) for r in pd_results],
                              "colocated_1gpu": [r["ttft"] and round(r["ttft"], 3) for r in co_results]},
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("args", "ttft_s_by_arrival")}, indent=1))
    out = Path(args.out or f"benchmarks/results/gpu-e2e-{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
