"""TTFT and handoff time of the pull, push and store handoffs, one request at a time, prompts of 128 to 8,192
tokens (issue 16): a 1P1D cluster (`pdserve serve` P and D, the router in front; for `store` also a
`pdserve kv-store`) per connector, the same prompts.

    PYTHONPATH=$PWD python3 benchmarks/push_vs_pull.py --out $OUT/push-vs-pull.json              # GPU: 8B shape
    PYTHONPATH=$PWD python3 benchmarks/push_vs_pull.py --device cpu --prompt-lens 128,512,2048 --out F   # CPU

GPU: Llama-3.1-8B shape, random weights (--load-format dummy, one seed: P and D hold the same weights);
--gpus P,D (default 0,1; 0,0 puts both on one GPU, each with --gpu-memory-utilization 0.4). CPU: the
default model, each instance on its own core. Per connector and prompt length: one warm-up request, then
--repeats timed ones (random token ids, max_tokens 4, ignore_eos, streamed): TTFT as the client sees it,
and the handoff's own time per request from the instances' kv_transfer_seconds histograms (D times a pull's
READ, P a push's WRITE; a store handoff is two transfers, P's WRITE into the pool and D's READ from it, and
its time is their sum). Outputs are compared token by token between the connectors. Prints and saves JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import random
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu_e2e import child, describe_gpus, one_request  # noqa: E402


def transfer_seconds(prefill, decode) -> tuple[float, float]:
    """(sum, count) of kv_transfer_seconds over P and D (only one side counts a given handoff)."""
    total = count = 0.0
    for inst in (prefill, decode):
        m = inst.metrics()
        total += m.get("kv_transfer_seconds_sum", 0.0)
        count += m.get("kv_transfer_seconds_count", 0.0)
    return total, count


async def measure(proxy, prefill, decode, model: str, prompts: dict[int, list[list[int]]]) -> dict:
    import aiohttp
    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600)) as session:
        for n, group in prompts.items():
            await one_request(session, proxy.url, model, group[0], 4, 0)  # warm-up at this length
            ttfts, token_ids, errors = [], [], []
            before = transfer_seconds(prefill, decode)
            for prompt in group[1:]:
                r = await one_request(session, proxy.url, model, prompt, 4, 0)
                if r["error"]:
                    errors.append(r["error"])
                else:
                    ttfts.append(r["ttft"])
                token_ids.append(r["token_ids"])
            await asyncio.sleep(0.3)  # the instances' stats snapshots (every 100 ms)
            after = transfer_seconds(prefill, decode)
            handoffs = after[1] - before[1]
            out[str(n)] = {"ttft_ms_p50": 1e3 * statistics.median(ttfts) if ttfts else None,
                           "ttft_ms_min": 1e3 * min(ttfts) if ttfts else None,
                           "ttft_ms": [round(1e3 * t, 2) for t in ttfts],
                           # per request: a store handoff's two transfers add up
                           "handoff_ms_mean": 1e3 * (after[0] - before[0]) / len(group[1:]) if handoffs else None,
                           "num_handoffs": handoffs, "errors": errors[:3], "token_ids": token_ids}
            print(f"  {n:>5} tokens: TTFT p50 {out[str(n)]['ttft_ms_p50']} ms, handoff "
                  f"{out[str(n)]['handoff_ms_mean']} ms ({handoffs:g} counted), {len(errors)} errors", flush=True)
    return out


def wait_listening(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on 127.0.0.1:{port}") from None
            time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default=None, help="default: llama-3.1-8b (cuda), default (cpu)")
    p.add_argument("--prompt-lens", default="128,512,2048,8192")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--connectors", default="nixl,nixl-push", help="any of nixl, nixl-push, cuda_ipc, store")
    p.add_argument("--store-capacity", default="4GiB", help="the kv-store's pool (store)")
    p.add_argument("--gpus", default="0,1", help="P's and D's GPU (cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp/pdserve-push-vs-pull")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    lens = [int(x) for x in args.prompt_lens.split(",")]
    model = args.model or ("llama-3.1-8b" if args.device == "cuda" else "default")
    rng = random.Random(args.seed)
    prompts = {n: [[rng.randrange(1000, 30000) for _ in range(n)] for _ in range(args.repeats + 1)] for n in lens}
    common = ["serve", "--model", model, "--seed", str(args.seed), "--max-model-len", str(max(lens) + 64)]
    gpu_p = gpu_d = None
    if args.device == "cuda":
        common += ["--load-format", "dummy", "--dtype", "bfloat16"]
        gpu_p, gpu_d = args.gpus.split(",")
        if gpu_p == gpu_d:
            common += ["--gpu-memory-utilization", "0.4"]
    else:
        common += ["--device", "cpu", "--num-threads", "1", "--kv-cache-memory", str(1 << 30)]
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    result = {"date": datetime.date.today().isoformat(), "args": vars(args), "model": model,
              "machine": describe_gpus() if args.device == "cuda" else f"{platform.processor() or 'cpu'}, CPU",
              "connectors": {}}
    for connector in args.connectors.split(","):
        print(f"[push-vs-pull] {connector}", flush=True)
        children = []
        try:
            pin = lambda core: ["--cpu-cores", core] if args.device == "cpu" else []  # noqa: E731
            kv = ["--kv-connector", connector]
            if connector == "store":
                store = child(["kv-store", "--capacity", args.store_capacity], None, log_dir, "kv-store")
                children.append(store)
                wait_listening(store.port)
                kv += ["--kv-store", f"127.0.0.1:{store.port}"]
            prefill = child(common + pin("0") + kv + ["--kv-role", "producer"], gpu_p, log_dir, f"prefill-{connector}")
            decode = child(common + pin("1") + kv + ["--kv-role", "consumer"], gpu_d, log_dir, f"decode-{connector}")
            children += [prefill, decode]
            prefill.wait_healthy(600), decode.wait_healthy(600)
            deadline = time.monotonic() + 30
            while connector == "store" and not all(i.metrics().get("kv_store_connected") for i in (prefill, decode)):
                if time.monotonic() > deadline:
                    raise RuntimeError("the instances did not connect to the kv-store within 30 s")
                time.sleep(0.2)
            proxy = child(["proxy", "--prefill", prefill.url, "--decode", decode.url], None, log_dir, f"proxy-{connector}")
            children.append(proxy)
            proxy.wait_healthy(60)
            result["connectors"][connector] = asyncio.run(measure(proxy, prefill, decode, model, prompts))
        finally:
            for c in reversed(children):
                c.stop()
    names = list(result["connectors"])
    if len(names) > 1:
        first = result["connectors"][names[0]]
        result["outputs_identical"] = {
            name: all(first[n]["token_ids"] == result["connectors"][name][n]["token_ids"] for n in first)
            for name in names[1:]}
    summary = {name: {n: {k: v for k, v in row.items() if k in ("ttft_ms_p50", "handoff_ms_mean", "errors")}
                      for n, row in rows.items()} for name, rows in result["connectors"].items()}
    print(json.dumps({"summary": summary, "outputs_identical": result.get("outputs_identical")}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
