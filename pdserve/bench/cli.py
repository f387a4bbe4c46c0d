"""`pdserve bench serve | sweep`: arguments → BenchConfig → run → summary, JSON and plot.

pdserve/cli.py owns argv; it calls add_bench_subparsers(subparsers) and then `args.func(args)`.
Exit codes: 0 the benchmark ran, 1 every request failed, 2 a bad argument or no model found.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import format_summary, format_sweep_summary, parse_rate
from pdserve.bench.plots import plot_benchmark, plot_sweep, require_matplotlib
from pdserve.bench.runner import BenchConfig, run_benchmark, run_sweep
from pdserve.help_format import HelpFormatter

SERVE_HELP = """\
Benchmark an OpenAI-compatible endpoint (a pdserve instance, the P/D proxy, or vLLM).

Every request streams; each chunk is timestamped on arrival. Reported per request and in aggregate:
TTFT (to the first output chunk), TPOT ((e2e - ttft) / (output_tokens - 1)), ITL (gaps between output
chunks), E2E (mean, p50, p90, p99), request and token throughput, goodput (requests meeting both SLOs
per second) and SLO attainment (fraction of all requests meeting both). Token counts come from the
server's usage. Failed requests (HTTP or connection error, error event, no [DONE]) are counted as
failed with their error kept, and never meet the SLO.

Datasets (--dataset):
  random         completions: prompts as token id lists from --vocab-range; chat: random common words
  prefix-shared  --prefix-len shared tokens + a unique random suffix of --input-len
  mixed          independent requests, --short-fraction of them short (--short-len) and the rest long
                 (--long-len); built as random's
  multi-turn     --num-users conversations of --num-turns turns (--num-prompts is not used). Users share
                 --num-groups system prompts of --prefix-len words (user u has system prompt u mod
                 --num-groups); each turn resends the whole history (system prompt, earlier user messages
                 and the answers streamed back, of up to --output-len tokens) plus a new user message of
                 --turn-len words, and is sent when the turn before it has finished. New conversations
                 arrive at the request rate. Text on both endpoints (completions: a "User:"/"Assistant:"
                 transcript). Also reports TTFT p50 and mean prompt tokens per turn.
  FILE.jsonl     {"prompt": str} or {"messages": [...]} per line, with optional "output_len"
Text prompts are common English words, about one token each for the default model's tokenizer.

example: pdserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4 \\
             --input-len 512 --output-len 128 --slo-ttft-ms 500 --slo-tpot-ms 50 --out r.json --plot r.png
"""

SWEEP_HELP = """\
Run the same workload (same prompts, same seed) at each of --request-rates in turn and report one
entry per rate, plus the highest rate at which every rate up to it reached --target-attainment.
The plot shows SLO attainment, TTFT p90 and TPOT p90 against the rate.

example: pdserve bench sweep --request-rates 1,2,4,8,inf --num-prompts 100 \\
             --slo-ttft-ms 500 --slo-tpot-ms 50 --out sweep.json --plot sweep.png
"""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _rate(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rates(text: str) -> list[float]:
    return [_rate(part.strip()) for part in text.split(",") if part.strip()]


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _add_workload_args(p: argparse.ArgumentParser, *, is_sweep: bool, starts_servers: bool = False) -> None:
    """starts_servers (bench compare): no --base-url, --model, --api-key, --out, --plot; it starts
    the servers it measures and has its own --model and --out-dir."""
    target = p.add_argument_group("target")
    if not starts_servers:
        target.add_argument("--base-url", default="http://127.0.0.1:8000",
                            help="server root; a trailing /v1 is accepted")
        target.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="/v1/completions or /v1/chat/completions")
    if not starts_servers:
        target.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    target.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")

    work = p.add_argument_group("workload")
    work.add_argument("--dataset", default="random",
                      help="random | prefix-shared | mixed | multi-turn | FILE.jsonl (see the description)")
    work.add_argument("--num-prompts", type=_positive_int, default=100, help="requests per run")
    work.add_argument("--input-len", type=_positive_int, default=512,
                      help="prompt tokens (random part, after the shared prefix for prefix-shared)")
    work.add_argument("--output-len", type=_positive_int, default=128,
                      help="max_tokens (a jsonl 'output_len' wins)")
    work.add_argument("--range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)]")
    work.add_argument("--output-range-ratio", type=float, default=None,
                      help="the output lengths' r, when it differs from --range-ratio")
    work.add_argument("--prefix-len", type=_positive_int, default=256,
                      help="shared prefix tokens (prefix-shared), or words of each group's system prompt (multi-turn)")
    work.add_argument("--vocab-range", type=int, nargs=2, default=[1000, 20000], metavar=("LOW", "HIGH"),
                      help="random token ids are drawn from [LOW, HIGH)")
    work.add_argument("--ignore-eos", action="store_true", help="ask the server to generate all max_tokens")
    work.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    work.add_argument("--extra-body", type=_json_object, default=None,
                      help="JSON object merged into every request body")
    work.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")

    turns = p.add_argument_group("multi-turn dataset")
    turns.add_argument("--num-users", type=_positive_int, default=16, help="conversations, one per user")
    turns.add_argument("--num-turns", type=_positive_int, default=4, help="requests per conversation")
    turns.add_argument("--num-groups", type=_positive_int, default=4,
                       help="distinct system prompts (--prefix-len words each) shared by the users")
    turns.add_argument("--turn-len", type=_positive_int, default=64,
                       help="words of each new user message (varied by --range-ratio)")

    mixed = p.add_argument_group("mixed dataset")
    mixed.add_argument("--short-fraction", type=float, default=0.8, help="share of short prompts, in [0, 1]")
    mixed.add_argument("--short-len", type=int, nargs=2, default=[32, 128], metavar=("LOW", "HIGH"),
                       help="short prompt tokens, uniform in [LOW, HIGH]")
    mixed.add_argument("--long-len", type=int, nargs=2, default=[1024, 2048], metavar=("LOW", "HIGH"),
                       help="long prompt tokens, uniform in [LOW, HIGH]")

    load = p.add_argument_group("load")
    if is_sweep:
        load.add_argument("--request-rates", type=_rates, default=[1.0, 2.0, 4.0, float("inf")],
                          metavar="R1,R2,...", help="comma-separated rates, inf allowed (default: 1,2,4,inf)")
    else:
        load.add_argument("--request-rate", type=_rate, default=float("inf"),
                          help="requests per second (Poisson or gamma arrivals), or inf for all at once")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps between arrivals: 1.0 Poisson, <1 burstier, >1 steadier")
    load.add_argument("--max-concurrency", type=_positive_int, default=None,
                      help="at most this many requests in flight (default: no limit)")

    slo = p.add_argument_group("SLO")
    slo.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT objective (default: none)")
    slo.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT objective (default: none)")
    if is_sweep:
        slo.add_argument("--target-attainment", type=float, default=0.9,
                         help="SLO attainment a rate must reach to count as sustained")

    out = p.add_argument_group("output")
    if not starts_servers:
        out.add_argument("--out", default=None, metavar="FILE.json", help="write config, metrics and every request")
        out.add_argument("--plot", default=None, metavar="FILE.png", help="draw a plot (needs matplotlib)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_bench_subparsers(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench serve`, `bench sweep` and `bench compare` on the top-level CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible endpoint",
                                  description="Measure a serving endpoint over HTTP: serve (one rate), "
                                              "sweep (several rates) or compare (start colocated, chunked "
                                              "and disaggregated deployments in turn and sweep each).")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="{serve,sweep,compare}", required=True)

    serve = bench_sub.add_parser("serve", help="one workload at one request rate", description=SERVE_HELP,
                                 formatter_class=HelpFormatter)
    _add_workload_args(serve, is_sweep=False)
    serve.set_defaults(func=serve_main)

    sweep = bench_sub.add_parser("sweep", help="one workload at several request rates", description=SWEEP_HELP,
                                 formatter_class=HelpFormatter)
    _add_workload_args(sweep, is_sweep=True)
    sweep.set_defaults(func=sweep_main)

    from pdserve.bench.compare import add_compare_parser  # here: compare imports this module
    add_compare_parser(bench_sub)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if args.plot:
        require_matplotlib()
    config = BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, dataset=args.dataset,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, output_range_ratio=args.output_range_ratio, prefix_len=args.prefix_len, vocab_range=tuple(args.vocab_range),
        request_rate=getattr(args, "request_rate", float("inf")), burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, temperature=args.temperature,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, seed=args.seed, api_key=args.api_key,
        extra_body=args.extra_body, request_timeout_s=args.request_timeout, num_users=args.num_users,
        num_turns=args.num_turns, num_groups=args.num_groups, turn_len=args.turn_len,
        short_fraction=args.short_fraction, short_len=tuple(args.short_len), long_len=tuple(args.long_len))
    config.validate()
    return config


def _write_json(path: str, data: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def serve_main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        result = asyncio.run(run_benchmark(config, progress=not args.no_progress))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: no results written", file=sys.stderr)
        return 130
    title = f"{result.config.model} @ {args.request_rate:g} req/s"
    print(format_summary(result.metrics, title=title))
    data = result.to_dict()
    if args.out:
        _write_json(args.out, data)
        print(f"wrote {args.out}")
    if args.plot:
        plot_benchmark(data, args.plot)
        print(f"wrote {args.plot}")
    return 0 if result.metrics["num_completed"] else 1


def sweep_main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        if not args.request_rates:
            raise ValueError("request_rates: give at least one rate")
        if not 0.0 < args.target_attainment <= 1.0:
            raise ValueError(f"target_attainment: must be in (0, 1], got {args.target_attainment}")
        sweep = asyncio.run(run_sweep(config, args.request_rates, progress=not args.no_progress,
                                      target_attainment=args.target_attainment))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: no results written", file=sys.stderr)
        return 130
    data = sweep.to_dict()
    print(format_sweep_summary(data["results"]))
    best = data["max_rate_meeting_slo"]
    print(f"max rate with SLO attainment >= {args.target_attainment:.0%}: "
          f"{'none of the rates' if best is None else f'{parse_rate(best):g} req/s'}")
    if args.out:
        _write_json(args.out, data)
        print(f"wrote {args.out}")
    if args.plot:
        plot_sweep(data, args.plot)
        print(f"wrote {args.plot}")
    return 0 if any(r.metrics["num_completed"] for r in sweep.results) else 1
