"""P/D handoff on CPU with the default model: per-request KV transfer time, bytes and descriptors for
prompts of 128 to 4,096 tokens, and TTFT through the proxy (1P1D) against a colocated instance.

    .venv/bin/python benchmarks/cpu_pd_handoff.py [--lengths 128,256,512,1024,2048,4096 --repeats 3]

P is pinned to core 0 and D to core 1 (one torch thread each); the colocated instance gets core 0
with one thread, the same compute a prefill gets in the split. Each prompt is new random tokens,
so no prefix cache helps. Writes benchmarks/results/cpu-pd-handoff-<date>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.e2e.cluster import Process, wait_until  # noqa: E402  (the same process helpers as the tests)


def instance(name: str, cores: str, *extra: str) -> Process:
    return Process(["serve", "--model", "default", "--kv-cache-memory", str(1 << 30), "--num-threads", "1",
                    "--cpu-cores", cores, "--no-prefix-caching", *extra], name)


def ttft_and_text(server: Process, prompt: list[int], max_tokens: int) -> tuple[float, str]:
    import urllib.request
    body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"{server.url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft, text = None, ""
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = ttft or time.perf_counter() - start
                text += chunk["choices"][0]["text"]
    return ttft, text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(0)

    procs = []
    try:
        prefill = instance("bench-prefill", "0", "--kv-connector", "nixl", "--kv-role", "producer")
        decode = instance("bench-decode", "1", "--kv-connector", "nixl", "--kv-role", "consumer")
        colocated = instance("bench-colocated", "0")
        procs += [prefill, decode, colocated]
        for proc in procs:
            proc.wait_healthy()
        proxy = Process(["proxy", "--prefill", prefill.url, "--decode", decode.url], "bench-proxy")
        procs.append(proxy)
        proxy.wait_healthy(60)
        warm = [rng.randrange(1000, 20000) for _ in range(64)]
        ttft_and_text(proxy, warm, 2)  # the first handshake is not part of any figure
        rows = []
        for length in lengths:
            for rep in range(args.repeats):
                prompt = [rng.randrange(1000, 20000) for _ in range(length)]
                before = decode.metrics()
                pd_ttft, pd_text = ttft_and_text(proxy, prompt, args.max_tokens)
                after = decode.metrics()
                co_ttft, co_text = ttft_and_text(colocated, prompt, args.max_tokens)
                row = {
                    "prompt_tokens": length, "repeat": rep,
                    "handoff_seconds": after["kv_transfer_seconds_sum"] - before["kv_transfer_seconds_sum"],
                    "handoff_bytes": after["kv_transfer_bytes_total"] - before["kv_transfer_bytes_total"],
                    "descriptors": after["kv_transfer_descriptors_total"] - before["kv_transfer_descriptors_total"],
                    "pd_ttft_s": pd_ttft, "colocated_ttft_s": co_ttft, "identical": pd_text == co_text,
                }
                row["handoff_gbps"] = row["handoff_bytes"] / row["handoff_seconds"] / 1e9
                rows.append(row)
                print(f"{length:5d} tok: handoff {row['handoff_seconds'] * 1e3:7.2f} ms, "
                      f"{row['handoff_bytes'] / 2**20:7.1f} MiB, {row['descriptors']:.0f} desc, "
                      f"{row['handoff_gbps']:.2f} GB/s | TTFT P/D {pd_ttft * 1e3:8.1f} ms, "
                      f"colocated {co_ttft * 1e3:8.1f} ms | identical {row['identical']}", flush=True)
        assert wait_until(lambda: prefill.metrics()["num_blocks_held_for_transfer"] == 0, timeout=10)
    finally:
        for proc in reversed(procs):
            proc.stop()
    date = datetime.date.today().isoformat()
    result = {"date": date, "machine": f"{platform.machine()} {os.cpu_count()} cores (CPU)",
              "model": "SmolLM2-135M-Instruct (default), float32, block_size 16",
              "setup": "P on core 0, D on core 1, 1 torch thread each; NIXL DRAM->DRAM over UCX, "
                       "progress thread off; colocated instance on core 0",
              "args": vars(args), "rows": rows}
    out = Path(args.out or f"benchmarks/results/cpu-pd-handoff-{date}.json")
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
