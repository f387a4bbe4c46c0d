"""Throughput at rate inf of two OpenAI-compatible servers, measured burst by burst in turn.

The sequential scripts (cpu_pd_serve.sh) time one server's burst, then the other's; on these shared 2-core
machines the speed drifts by up to 20 % within minutes, as much as the ratio being measured. Here both
servers are up at once and each round sends one burst of fresh prompts (`pdserve bench serve`, the random
dataset, all requests at once, the same prompts to both) to each, in AB BA order, so that a drift falls on
both alike; each round's ratio of output throughputs is reported, and their median is the figure. Every
request must complete.

    .venv/bin/python benchmarks/rate_inf_pair.py --a NAME=PORT --b NAME=PORT [--rounds 4]
        [--num-prompts 64] [--input-len 256] [--output-len 128] [--gap-s 2] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from single_stream_pair import add_server_args, parse_servers   # (this script's folder)


def burst(port: int, model: str, num_prompts: int, input_len: int, output_len: int, seed: int,
          timeout_s: float) -> dict:
    """One `pdserve bench serve` burst at rate inf; its metrics (raises unless every request completed)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "burst.json")
        cmd = [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
               "--model", model, "--dataset", "random", "--num-prompts", str(num_prompts),
               "--input-len", str(input_len), "--output-len", str(output_len), "--ignore-eos",
               "--temperature", "0", "--request-rate", "inf", "--seed", str(seed), "--out", out, "--no-progress"]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"port {port}: `pdserve bench serve` exited {done.returncode}: "
                               f"{done.stdout[-2000:].strip()}")
        with open(out) as f:
            metrics = json.load(f)["metrics"]
    if metrics["num_completed"] != num_prompts:
        raise RuntimeError(f"port {port}: {metrics['num_failed']} of {num_prompts} requests failed: "
                           f"{metrics['errors']}")
    return metrics


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)   # (no TPOT in one-token answers)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p)
    p.add_argument("--rounds", type=int, default=4, help="bursts to each server, an even number")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup-prompts", type=int, default=4, help="a small burst to each server first")
    p.add_argument("--gap-s", type=float, default=2.0, help="idle time before each burst")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per burst")
    p.add_argument("--seed", type=int, default=None, help="the warm-up's prompt seed (default: the clock, so "
                   "that a rerun against the same servers meets no prefix-cache hits); each round takes the next")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.rounds < 2 or args.rounds % 2 or args.num_prompts < 1:
        p.error("--rounds must be even (AB then BA: each server first as often) and --num-prompts at least 1")
    servers = parse_servers(p, args, reserved={"a", "b", "rounds", "num_prompts", "input_len", "output_len",
                                               "gap_s", "throughput_ratio_median", "throughput_ratio_range"})
    (a_name, _), (b_name, _) = servers
    seed = args.seed if args.seed is not None else time.time_ns() % 2 ** 31
    if args.warmup_prompts > 0:
        for name, port in servers:
            burst(port, args.model, args.warmup_prompts, args.input_len, args.output_len, seed, args.timeout_s)
    results: dict[str, list[dict]] = {a_name: [], b_name: []}
    for i in range(args.rounds):
        seed += 1   # a round's prompts are new to both servers, and the same for both
        for name, port in (servers if i % 2 == 0 else servers[::-1]):   # AB BA AB ...
            time.sleep(args.gap_s)
            m = burst(port, args.model, args.num_prompts, args.input_len, args.output_len, seed, args.timeout_s)
            results[name].append(m)
            print(f"round {i}: {name} {m['output_token_throughput']:.1f} output tok/s, TTFT p50 "
                  f"{_ms(m['ttft_ms']['p50'])}, TPOT p50 {_ms(m['tpot_ms']['p50'])}", flush=True)
    summary = {"a": a_name, "b": b_name, "rounds": args.rounds, "num_prompts": args.num_prompts,
               "input_len": args.input_len, "output_len": args.output_len, "gap_s": args.gap_s}
    for name, rows in results.items():
        tput = [round(m["output_token_throughput"], 1) for m in rows]
        summary[name] = {"output_tok_s_median": round(statistics.median(tput), 1), "output_tok_s": tput,
                         "ttft_ms_p50": [_round(m["ttft_ms"]["p50"], 1) for m in rows],
                         "tpot_ms_p50": [_round(m["tpot_ms"]["p50"], 2) for m in rows]}
        print(f"{name}: output tok/s median {summary[name]['output_tok_s_median']} ({tput})")
    ratios = [x["output_token_throughput"] / y["output_token_throughput"]
              for x, y in zip(results[a_name], results[b_name])]
    summary["throughput_ratio_median"] = round(statistics.median(ratios), 3)
    summary["throughput_ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    print(f"output tok/s {a_name} / {b_name}, round by round: median {summary['throughput_ratio_median']} "
          f"(range {summary['throughput_ratio_range'][0]}-{summary['throughput_ratio_range'][1]})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
