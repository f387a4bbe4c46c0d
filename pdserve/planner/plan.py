"""`pdserve plan`: how many instances, split how between prefill and decode, for a workload at a rate under
an SLO, predicted by simulating each candidate cluster (planner/simulator.py) on a step profile measured on
the target hardware (planner/profile.py).

Up to 16 instances (or with --search exhaustive) it simulates, for every total N from 1 to
--max-instances, N colocated instances and every P:D split of N, on the same requests, and recommends the
smallest total whose best candidate reaches --target-attainment (ties: the higher attainment, then the higher
goodput). That is N^2/2 simulations, too many for a pool of hundreds, so past it (--search bisection) the
two pools are sized apart, as DistServe does: the fewest D that meet the TPOT SLO behind the largest prefill
pool, the fewest P that meet the TTFT SLO with twice those D (each a galloping bisection, attainment
growing with the pool); then, while the pair misses, the pool whose growth helps more grows by an eighth of
the cluster, and once it meets the SLO each pool shrinks back as far as it still does; colocated by
bisection too. A few dozen simulations at any size, and on the plans tested the exhaustive search's total.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from pdserve.planner.profile import StepModel, load_step_model
from pdserve.planner.simulator import POLICIES, ClusterSpec, EngineSpec, Workload, simulate

PROFILES = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = PROFILES / "h200-llama-3.1-8b.json"
EXHAUSTIVE_UP_TO = 16   # --search auto: every split up to this many instances, bisection past it
# The two workloads of the issue 5 comparison (pdserve bench compare; benchmarks/gpu_compare.py).
NAMED_WORKLOADS = {
    "prefill-heavy": {"input_len": 5120, "range_ratio": 0.6, "output_len": 320, "output_range_ratio": 0.6},
    "decode-heavy": {"input_len": 640, "range_ratio": 0.6, "output_len": 768, "output_range_ratio": 1 / 3},
}

DESCRIPTION = __doc__ + """
Workloads: prefill-heavy (prompts 2,048-8,192 tokens, answers 128-512), decode-heavy (256-1,024 / 512-1,024),
or a file: the JSON of a `pdserve bench serve|sweep` run (its requests' prompt and answer tokens), or a
.jsonl with one {"prompt_len": N, "output_len": M} per line. Arrivals are Poisson at --rate either way.

The default profile is an H200 serving the Llama-3.1-8B shape in bf16 (benchmarks/gpu_step_profile.py);
measure your own hardware and model with that script and pass --profile. What the simulation leaves out
and how far it was from measured runs: docs/planner.md.

example: pdserve plan --workload prefill-heavy --rate 8 --slo-ttft-ms 2000 --slo-tpot-ms 20 --max-instances 4
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="prefill-heavy",
                   help="prefill-heavy | decode-heavy | FILE.json (a bench run) | FILE.jsonl (default: prefill-heavy)")
    p.add_argument("--rate", type=float, required=True, help="requests per second to plan for (Poisson)")
    p.add_argument("--num-requests", type=int, default=2000, help="requests simulated per candidate (default: 2000)")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-tpot-ms", type=float, required=True)
    p.add_argument("--target-attainment", type=float, default=0.9,
                   help="share of requests that must meet both SLOs (default: 0.9)")
    p.add_argument("--max-instances", type=int, default=8, help="largest total to consider (default: 8)")
    p.add_argument("--profile", default=str(DEFAULT_PROFILE),
                   help="step profile JSON (benchmarks/gpu_step_profile.py output, or a bare step model)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--kv-capacity-tokens", type=int, default=800_000,
                   help="KV tokens one instance holds (default: 800,000, an H200 with the 8B shape)")
    p.add_argument("--kv-bytes-per-token", type=int, default=None,
                   help="KV bytes of one token moved from P to D (default: the profile's, else 131,072)")
    p.add_argument("--handoff-gbps", type=float, default=300.0, help="P to D KV rate, GB/s (default: 300)")
    p.add_argument("--handoff-latency-ms", type=float, default=3.0, help="fixed cost of a handoff (default: 3)")
    p.add_argument("--policy", choices=POLICIES, default="least-load")
    p.add_argument("--pd-min-prompt-tokens", type=int, default=0,
                   help="prompts shorter than this go straight to a decode instance (default: 0, never)")
    p.add_argument("--search", choices=("auto", "exhaustive", "bisection"), default="auto",
                   help=f"exhaustive: every split of every total (N^2/2 simulations); bisection: each pool sized "
                        f"apart (a few dozen); auto: exhaustive up to {EXHAUSTIVE_UP_TO} instances (default: auto)")
    p.add_argument("--no-colocated", action="store_true", help="consider P/D splits only")
    p.add_argument("--no-pd", action="store_true", help="consider colocated instances only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the candidates and the choice as JSON")


def load_lengths(workload: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if workload in NAMED_WORKLOADS:
        w = NAMED_WORKLOADS[workload]

        def uniform(length: int, ratio: float) -> np.ndarray:
            low, high = max(1, int(np.ceil(length * (1 - ratio)))), int(np.floor(length * (1 + ratio)))
            return rng.integers(low, high + 1, size=n)
        return uniform(w["input_len"], w["range_ratio"]), uniform(w["output_len"], w["output_range_ratio"])
    path = Path(workload)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"--workload {workload!r}: not {' or '.join(NAMED_WORKLOADS)}, and not a readable "
                         f"file ({exc.strerror})") from None
    try:
        if path.suffix == ".jsonl":
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            pairs = [(int(r["prompt_len"]), int(r["output_len"])) for r in rows]
        else:
            data = json.loads(text)
            results = data.get("results") or [data]
            pairs = [(int(r["prompt_tokens"]), int(r["output_tokens"])) for res in results
                     for r in res.get("requests", []) if r.get("success", True) and r.get("prompt_tokens")]
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
        raise ValueError(f"--workload {workload}: not a bench run JSON or a prompt_len/output_len .jsonl ({exc})") from None
    if any(p > 10_000_000 or o > 10_000_000 for p, o in pairs):
        raise ValueError(f"--workload {workload}: a request of more than 10,000,000 tokens")
    if not pairs or any(p < 1 or o < 0 for p, o in pairs):
        raise ValueError(f"--workload {workload}: no requests with positive lengths in it")
    picks = rng.integers(0, len(pairs), size=n)
    lengths = np.array(pairs)[picks]
    return lengths[:, 0], np.maximum(lengths[:, 1], 1)


def candidates(max_instances: int, colocated: bool, pd: bool):
    for total in range(1, max_instances + 1):
        if colocated:
            yield total, (0, 0, total)
        if pd:
            for p in range(1, total):
                yield total, (p, total - p, 0)


class Trials:
    """Each cluster simulated once on the plan's requests; its row kept in the order simulated."""

    def __init__(self, base: ClusterSpec, model: StepModel, workload: Workload, slo_ttft_s: float,
                 slo_tpot_s: float, target: float, max_instances: int, seed: int) -> None:
        self.base, self.model, self.workload, self.seed = base, model, workload, seed
        self.slo, self.target, self.max_instances = (slo_ttft_s, slo_tpot_s), target, max_instances
        self.rows: list[dict] = []
        self._rows: dict[tuple[int, int, int], dict] = {}

    def row(self, p: int, d: int, c: int) -> dict:
        if (p, d, c) not in self._rows:
            cluster = replace(self.base, num_prefill=p, num_decode=d, num_colocated=c)
            summary = simulate(cluster, self.model, self.workload, seed=self.seed).summary(*self.slo)
            goodput = summary["slo_attainment"] * len(self.workload) / max(summary["duration_s"], 1e-9)
            # a probe sizes one pool with the other as large as allowed: more than --max-instances in all
            row = {"cluster": cluster.describe(), "instances": p + d + c, "prefill": p, "decode": d, "colocated": c,
                   **summary, "goodput_req_s": goodput, "probe": p + d + c > self.max_instances}
            self.rows.append(row)
            self._rows[p, d, c] = row
        return self._rows[p, d, c]

    def meets(self, row: dict, attainment: str = "slo_attainment") -> bool:
        return row[attainment] >= self.target and not row["rejected"]


def better(row: dict, than: dict | None) -> bool:
    """Fewer instances, then the higher attainment, then the higher goodput."""
    return than is None or (-row["instances"], row["slo_attainment"], row["goodput_req_s"]) > \
        (-than["instances"], than["slo_attainment"], than["goodput_req_s"])


def search_exhaustive(trials: Trials, colocated: bool, pd: bool) -> dict | None:
    chosen = None
    for total, (p, d, c) in candidates(trials.max_instances, colocated, pd):
        if chosen is not None and total > chosen["instances"]:
            break
        row = trials.row(p, d, c)
        if trials.meets(row) and better(row, chosen):
            chosen = row
    return chosen


def smallest(lo: int, hi: int, ok) -> int | None:
    """The smallest n in [lo, hi] with ok(n), for ok False then True as n grows; None when there is none.
    Galloping (lo, 2 lo, 4 lo, ...), then bisecting: a large pool costs more to simulate than a small one
    (every instance steps on its own), so the sizes tried stay within twice the answer."""
    if lo > hi:
        return None
    below, n = lo - 1, lo
    while not ok(n):
        if n >= hi:
            return None
        below, n = n, min(hi, 2 * n)
    while n - below > 1:
        mid = (below + n) // 2
        if ok(mid):
            n = mid
        else:
            below = mid
    return n


MAX_JOINT_STEPS = 64   # the bisection's steps from the two pools sized apart to a pair that meets both SLOs


def search_bisection(trials: Trials, colocated: bool, pd: bool) -> dict | None:
    n, chosen = trials.max_instances, None
    if colocated and (c := smallest(1, n, lambda c: trials.meets(trials.row(0, 0, c)))) is not None:
        chosen = trials.row(0, 0, c)
    if not pd or n < 2:
        return chosen
    # D first, behind the largest prefill pool (a prefill step's cost grows with its tokens, not with the
    # pool's size); then P, with twice those D (a saturated decode pool would hold handoffs back). A P pool
    # that never meets TTFT alone (prompts that D prefills itself: --pd-min-prompt-tokens) starts at 1.
    d = smallest(1, n - 1, lambda d: trials.meets(trials.row(n - 1, d, 0), "tpot_attainment"))
    if d is None:
        return chosen
    p = smallest(1, n - 1, lambda p: trials.meets(trials.row(p, min(n - 1, 2 * d), 0), "ttft_attainment")) or 1
    # Together they may miss: grow the pool whose growth helps more, by an eighth of the cluster at a time
    # (a few dozen steps at any size), then shrink each pool back as far as the pair still meets the SLO.
    for _ in range(MAX_JOINT_STEPS):
        if p + d > n or (chosen is not None and p + d > chosen["instances"]):
            return chosen
        if trials.meets(trials.row(p, d, 0)):
            p = smallest(1, p, lambda x: trials.meets(trials.row(x, d, 0)))
            d = smallest(1, d, lambda x: trials.meets(trials.row(p, x, 0)))
            row = trials.row(p, d, 0)
            return row if better(row, chosen) else chosen
        step = max(1, (p + d) // 8)
        more_p, more_d = trials.row(p + step, d, 0), trials.row(p, d + step, 0)
        if (more_p["slo_attainment"], more_p["goodput_req_s"]) >= (more_d["slo_attainment"], more_d["goodput_req_s"]):
            p += step
        else:
            d += step
    return chosen


def plan(args: argparse.Namespace) -> dict:
    for name in ("rate", "slo_ttft_ms", "slo_tpot_ms", "handoff_gbps"):
        value = getattr(args, name)
        if not 0 < value < math.inf:
            raise ValueError(f"--{name.replace('_', '-')} must be finite and > 0, got {value}")
    if not 0 <= args.handoff_latency_ms < math.inf:
        raise ValueError(f"--handoff-latency-ms must be finite and >= 0, got {args.handoff_latency_ms}")
    if not 1 <= args.num_requests <= 10_000_000 or not 1 <= args.max_instances <= 100_000:
        raise ValueError("--num-requests must be in [1, 10,000,000] and --max-instances in [1, 100,000]")
    if not 0 < args.target_attainment <= 1:
        raise ValueError(f"--target-attainment must be in (0, 1], got {args.target_attainment}")
    if args.no_colocated and args.no_pd:
        raise ValueError("--no-colocated and --no-pd leave nothing to plan")
    model: StepModel = load_step_model(args.profile)
    kv_bytes = args.kv_bytes_per_token
    if kv_bytes is None:
        try:
            kv_bytes = int(json.loads(Path(args.profile).read_text()).get("kv_bytes_per_token", 131_072))
        except (OSError, ValueError, AttributeError):
            kv_bytes = 131_072
    prompt, output = load_lengths(args.workload, args.num_requests, args.seed)
    workload = Workload.poisson(args.rate, prompt, output, seed=args.seed)
    engine = EngineSpec(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_chunked_prefill=not args.no_chunked_prefill, kv_capacity_tokens=args.kv_capacity_tokens)
    base = ClusterSpec(engine=engine, policy=args.policy, pd_min_prompt_tokens=args.pd_min_prompt_tokens,
                       kv_bytes_per_token=kv_bytes, handoff_bytes_per_s=args.handoff_gbps * 1e9,
                       handoff_latency_s=args.handoff_latency_ms / 1e3)
    trials = Trials(base, model, workload, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, args.target_attainment,
                    args.max_instances, args.seed)
    search = args.search if args.search != "auto" else \
        "exhaustive" if args.max_instances <= EXHAUSTIVE_UP_TO else "bisection"
    start = time.perf_counter()
    chosen = (search_exhaustive if search == "exhaustive" else search_bisection)(
        trials, not args.no_colocated, not args.no_pd)
    return {"workload": args.workload, "rate": args.rate, "requests": len(workload), "slo_ttft_ms": args.slo_ttft_ms,
            "slo_tpot_ms": args.slo_tpot_ms, "target_attainment": args.target_attainment, "profile": args.profile,
            "search": search, "max_instances": args.max_instances, "candidates": trials.rows, "recommended": chosen,
            "seconds": time.perf_counter() - start}


def format_plan(report: dict) -> str:
    lines = [f"{report['requests']} requests of {report['workload']} at {report['rate']:g} req/s, SLO TTFT <= "
             f"{report['slo_ttft_ms']:g} ms and TPOT <= {report['slo_tpot_ms']:g} ms for "
             f"{report['target_attainment']:.0%} ({len(report['candidates'])} clusters simulated in "
             f"{report['seconds']:.1f} s, {report['search']} search)",
             f"{'cluster':>16} {'attain':>7} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} {'TPOT p90':>9} "
             f"{'goodput':>8}"]
    for r in report["candidates"]:
        lines.append(f"{r['cluster']:>16} {r['slo_attainment']:>7.1%} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p90_ms']:>7.0f}ms "
                     f"{r['tpot_p50_ms']:>7.1f}ms {r['tpot_p90_ms']:>7.1f}ms {r['goodput_req_s']:>8.2f}"
                     + (f"  ({r['rejected']} never fit)" if r["rejected"] else "")
                     + ("  (a probe: one pool sized with the other at its largest)" if r["probe"] else ""))
    best = report["recommended"]
    never = min(r["rejected"] for r in report["candidates"])
    if best is None and never:
        lines.append(f"{never} of {report['requests']} requests never fit an instance (KV above "
                     f"--kv-capacity-tokens, or without chunked prefill a prompt above --max-num-batched-tokens)")
    elif best is None:
        lines.append(f"no cluster of up to {report['max_instances']} instances meets the SLO at this rate"
                     + (" (as far as the bisection sees)" if report["search"] == "bisection" else "")
                     + ": raise --max-instances, or relax the SLO")
    else:
        lines.append(f"recommended: {best['cluster']} ({best['instances']} instance(s)), predicted attainment "
                     f"{best['slo_attainment']:.1%}, goodput {best['goodput_req_s']:.2f} req/s")
    return "\n".join(lines)


def plan_main(args: argparse.Namespace) -> int:
    try:
        report = plan(args)
    except ValueError as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1, allow_nan=False) if args.json else format_plan(report))
    return 0 if report["recommended"] is not None else 1
