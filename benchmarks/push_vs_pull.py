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
its time is their sum; `store` maps the pool where it runs on the store's host, as here, `store-nixl` is
the same store started with --no-shared-memory, so that its KV moves over NIXL, and `store-vram` keeps the
pool in P's GPU, --pool-device cuda). Outputs are compared token by
token between the connectors. Prints and saves JSON.
--concurrency C keeps C requests in flight (a closed loop; under load): TTFT p50 and p90, requests per
second, and the handoff's time per request then include the queueing that load brings.

--tp-pairs P:D,... (issue 17; `nixl` and `nixl-push`): the same for P and D of
those tensor-parallel sizes, e.g. `--connectors nixl --tp-pairs 1:1,3:3,3:1,1:3 --device cpu` (the default
model's 3 KV heads) or `1:1,2:2,2:1,1:2` on two GPUs (an instance of T ranks takes T consecutive GPUs from its own in --gpus, wrapping round): per
request also the bytes and NIXL descriptors D's ranks moved.
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


def transfer_seconds(prefill, decode) -> tuple[float, float, float, float]:
    """(sum, count) of kv_transfer_seconds over P and D (only one side counts a given handoff), and the
    bytes and descriptors they moved."""
    total = count = num_bytes = descriptors = 0.0
    for inst in (prefill, decode):
        m = inst.metrics()
        total += m.get("kv_transfer_seconds_sum", 0.0)
        count += m.get("kv_transfer_seconds_count", 0.0)
        num_bytes += m.get("kv_transfer_bytes_total", 0.0)
        descriptors += m.get("kv_transfer_descriptors_total", 0.0)
    return total, count, num_bytes, descriptors


async def measure(proxy, prefill, decode, model: str, prompts: dict[int, list[list[int]]],
                  concurrency: int = 1) -> dict:
    import aiohttp
    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600)) as session:
        for n, group in prompts.items():
            await one_request(session, proxy.url, model, group[0], 4, 0)  # warm-up at this length
            ttfts, first_gaps, e2es, token_ids, errors = [], [], [], [], []
            before = transfer_seconds(prefill, decode)
            began = time.monotonic()
            slots = asyncio.Semaphore(concurrency)   # under load: this many requests in flight, closed loop

            async def send(prompt):
                async with slots:
                    return await one_request(session, proxy.url, model, prompt, 4, 0)
            for r in await asyncio.gather(*(send(prompt) for prompt in group[1:])):
                if r["error"]:
                    errors.append(r["error"])
                else:
                    ttfts.append(r["ttft"])
                    e2es.append(r["e2e"])
                    if r["itls"]:   # first token -> second: pull's READ (after P's answer) is in it
                        first_gaps.append(r["itls"][0])
                token_ids.append(r["token_ids"])
            wall = time.monotonic() - began
            await asyncio.sleep(0.3)  # the instances' stats snapshots (every 100 ms)
            after = transfer_seconds(prefill, decode)
            handoffs = after[1] - before[1]
            seconds = after[0] - before[0]
            out[str(n)] = {"ttft_ms_p50": 1e3 * statistics.median(ttfts) if ttfts else None,
                           "ttft_ms_p90": 1e3 * sorted(ttfts)[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
                           "requests_per_s": len(group[1:]) / wall, "concurrency": concurrency,
                           "bytes_per_handoff": (after[2] - before[2]) / handoffs if handoffs else None,
                           "descriptors_per_handoff": (after[3] - before[3]) / handoffs if handoffs else None,
                           "handoff_gb_per_s": (after[2] - before[2]) / seconds / 1e9 if seconds else None,
                           "ttft_ms_min": 1e3 * min(ttfts) if ttfts else None,
                           "ttft_ms": [round(1e3 * t, 2) for t in ttfts],
                           "first_gap_ms_p50": 1e3 * statistics.median(first_gaps) if first_gaps else None,
                           "first_gap_ms_max": 1e3 * max(first_gaps) if first_gaps else None,
                           "first_gap_ms": [round(1e3 * g, 2) for g in first_gaps],
                           "e2e_ms_p50": 1e3 * statistics.median(e2es) if e2es else None,
                           # per request: a store handoff's two transfers add up
                           "handoff_ms_mean": 1e3 * (after[0] - before[0]) / len(group[1:]) if handoffs else None,
                           "num_handoffs": handoffs, "errors": errors[:3], "token_ids": token_ids}
            print(f"  {n:>5} tokens: TTFT p50 {out[str(n)]['ttft_ms_p50']} ms, first gap p50 "
                  f"{out[str(n)]['first_gap_ms_p50']} ms, handoff "
                  f"{out[str(n)]['handoff_ms_mean']} ms ({handoffs:g} counted, "
                  f"{out[str(n)]['descriptors_per_handoff']} descriptors each), {len(errors)} errors", flush=True)
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


def gpu_set(first: str | None, size: int) -> str | None:
    """CUDA_VISIBLE_DEVICES for an instance of `size` ranks whose first GPU is `first` (wrapping round)."""
    if first is None or size == 1:
        return first
    import torch
    count = torch.cuda.device_count()
    return ",".join(str((int(first) + i) % count) for i in range(size))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default=None, help="default: llama-3.1-8b (cuda), default (cpu)")
    p.add_argument("--prompt-lens", default="128,512,2048,8192")
    p.add_argument("--repeats", type=int, default=5, help="timed requests per prompt length")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests in flight at once (1: one at a time; more: under load, a closed loop)")
    p.add_argument("--connectors", default="nixl,nixl-push", help="any of nixl, nixl-push, cuda_ipc, store, store-nixl, store-vram")
    p.add_argument("--store-capacity", default="4GiB", help="the kv-store's pool (store)")
    p.add_argument("--gpus", default="0,1", help="P's and D's GPU (cuda)")
    p.add_argument("--tp-pairs", default="1:1", help="P:D tensor-parallel sizes to measure, e.g. 1:1,2:2,2:1,1:2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-range", default="1000,30000",
                   help="prompts are random token ids in [LO, HI) (a tiny test model: e.g. 10,250)")
    p.add_argument("--log-dir", default="/tmp/pdserve-push-vs-pull")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.concurrency < 1 or args.repeats < 1:
        p.error("--concurrency and --repeats must be >= 1")
    lens = [int(x) for x in args.prompt_lens.split(",")]
    model = args.model or ("llama-3.1-8b" if args.device == "cuda" else "default")
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.token_range.split(","))
    prompts = {n: [[rng.randrange(lo, hi) for _ in range(n)] for _ in range(args.repeats + 1)] for n in lens}
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
    configs = [(c, int(tp_p), int(tp_d)) for c in args.connectors.split(",")
               for tp_p, tp_d in (pair.split(":") for pair in args.tp_pairs.split(","))]
    for connector, tp_p, tp_d in configs:
        name = connector if (tp_p, tp_d) == (1, 1) else f"{connector}-tp{tp_p}to{tp_d}"
        print(f"[push-vs-pull] {name}", flush=True)
        children = []
        try:
            pin = lambda core: ["--cpu-cores", core] if args.device == "cpu" else []  # noqa: E731
            is_store = connector in ("store", "store-nixl", "store-vram")
            kv = ["--kv-connector", "store" if is_store else connector]
            if is_store:
                flags = {"store-nixl": ["--no-shared-memory"], "store-vram": ["--pool-device", "cuda"]}
                store = child(["kv-store", "--capacity", args.store_capacity] + flags.get(connector, []),
                              gpu_p if connector == "store-vram" else None, log_dir, "kv-store")
                children.append(store)
                wait_listening(store.port)
                kv += ["--kv-store", f"127.0.0.1:{store.port}"]
            prefill = child(common + pin("0") + kv + ["--kv-role", "producer", "-tp", str(tp_p)],
                            gpu_set(gpu_p, tp_p), log_dir, f"prefill-{name}")
            decode = child(common + pin("1") + kv + ["--kv-role", "consumer", "-tp", str(tp_d)],
                           gpu_set(gpu_d, tp_d), log_dir, f"decode-{name}")
            children += [prefill, decode]
            prefill.wait_healthy(600), decode.wait_healthy(600)
            deadline = time.monotonic() + 30
            while is_store and not all(i.metrics().get("kv_store_connected") for i in (prefill, decode)):
                if time.monotonic() > deadline:
                    raise RuntimeError("the instances did not connect to the kv-store within 30 s")
                time.sleep(0.2)
            proxy = child(["proxy", "--prefill", prefill.url, "--decode", decode.url], None, log_dir, f"proxy-{name}")
            children.append(proxy)
            proxy.wait_healthy(60)
            result["connectors"][name] = asyncio.run(measure(proxy, prefill, decode, model, prompts,
                                                             args.concurrency))
            if is_store:   # did the instances map the pool, or move KV over NIXL?
                result.setdefault("store_shared_memory", {})[name] = [
                    i.metrics().get("kv_store_shared_memory") for i in (prefill, decode)]
        finally:
            for c in reversed(children):
                c.stop()
    names = list(result["connectors"])
    if len(names) > 1:
        first = result["connectors"][names[0]]
        result["outputs_identical"] = {
            name: all(first[n]["token_ids"] == result["connectors"][name][n]["token_ids"] for n in first)
            for name in names[1:]}
    summary = {name: {n: {k: v for k, v in row.items() if k in ("ttft_ms_p50", "ttft_ms_p90", "first_gap_ms_p50",
                                                                 "handoff_ms_mean", "errors", "descriptors_per_handoff",
                                                                 "handoff_gb_per_s", "requests_per_s")}
                      for n, row in rows.items()} for name, rows in result["connectors"].items()}
    print(json.dumps({"summary": summary, "outputs_identical": result.get("outputs_identical")}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
