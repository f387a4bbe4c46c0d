"""Aggregate metrics from per-request records: latency percentiles, throughput, goodput, SLO attainment.

Definitions (times in the output are milliseconds):
- TTFT: send → first chunk carrying output.   TPOT: (e2e - ttft) / (output_tokens - 1), per request.
- ITL: gaps between consecutive chunks carrying output, pooled over all requests.   E2E: send → end.
- Throughput: completed requests, and output (or prompt + output) tokens from `usage`, per second of
  benchmark duration.
- A request meets the SLO when it succeeded, its TTFT ≤ slo.ttft_ms and its TPOT ≤ slo.tpot_ms (an SLO
  left None always holds; a one-token answer has no TPOT and meets any TPOT SLO). Failed requests
  never meet it. Goodput = requests meeting the SLO / duration; attainment = meeting / all requests.
- Multi-turn runs add `per_turn`: per turn index, the completed requests, their TTFT p50 and mean prompt
  tokens. Turn 0 computes the group's system prompt (or finds it cached); later turns resend the history,
  which a prefix cache on the instance that served the previous turn mostly has.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from pdserve.bench.client import RequestRecord

PERCENTILES = (50, 90, 99)
MAX_ERROR_KINDS = 5


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    if not record.success:
        return False
    if slo.ttft_ms is not None and (record.ttft is None or record.ttft * 1000.0 > slo.ttft_ms):
        return False
    if slo.tpot_ms is not None:
        if record.output_tokens is None:   # no usage: the TPOT cannot be known, so it cannot be met
            return False
        tpot = record.tpot
        if tpot is not None and tpot * 1000.0 > slo.tpot_ms:
            return False
    return True


def latency_stats(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (numpy's linear interpolation); None when empty."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def per_turn_stats(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """One entry per turn index present: {"turn", "num_completed", "ttft_ms_p50", "prompt_tokens_mean"}."""
    stats = []
    for turn in sorted({r.turn for r in records if r.turn is not None}):
        done = [r for r in records if r.turn == turn and r.success]
        prompts = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
        stats.append({"turn": turn, "num_completed": len(done),
                      "ttft_ms_p50": latency_stats([r.ttft for r in done if r.ttft is not None])["p50"],
                      "prompt_tokens_mean": float(np.mean(prompts)) if prompts else None})
    return stats


def compute_metrics(records: Iterable[RequestRecord], duration: float, slo: SLO = SLO()) -> dict[str, Any]:
    records = list(records)
    completed = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    num_meeting = sum(meets_slo(r, slo) for r in records)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in completed)
    output_tokens = sum(r.output_tokens or 0 for r in completed)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    errors = Counter(r.error or "unknown error" for r in failed)
    per_turn = per_turn_stats(records)
    return {
        "num_requests": len(records),
        "num_completed": len(completed),
        "num_failed": len(failed),
        "num_without_usage": sum(r.output_tokens is None for r in completed),
        "duration_s": duration,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(completed)),
        "output_token_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(prompt_tokens + output_tokens),
        "ttft_ms": latency_stats([r.ttft for r in completed if r.ttft is not None]),
        "tpot_ms": latency_stats([t for r in completed if (t := r.tpot) is not None]),
        "itl_ms": latency_stats([gap for r in completed for gap in r.itls]),
        "e2e_ms": latency_stats([r.e2e for r in completed if r.e2e is not None]),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "num_meeting_slo": num_meeting,
        "goodput": per_s(num_meeting),
        "slo_attainment": num_meeting / len(records) if records else 0.0,
        "errors": dict(errors.most_common(MAX_ERROR_KINDS)),
        **({"per_turn": per_turn} if per_turn else {}),   # multi-turn only: other runs' JSON is unchanged
    }


# ---- rates ---------------------------------------------------------------------------------------

def parse_rate(value: str | float) -> float:
    """"inf" or a positive number → float (inf included); ValueError naming the field otherwise."""
    try:
        rate = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"request_rate: expected a positive number or inf, got {value!r}") from None
    if not rate > 0 or math.isnan(rate):
        raise ValueError(f"request_rate: expected a positive number or inf, got {value!r}")
    return rate


def format_rate(rate: float) -> str | float:
    """The JSON form of a rate: "inf" (JSON has no infinity) or the number."""
    return "inf" if math.isinf(rate) else rate


def max_rate_meeting_slo(sweep_results: Sequence[Mapping[str, Any]] | Mapping[str, Any],
                         attainment: float = 0.9) -> float | None:
    """The highest request rate R such that every swept rate ≤ R reached `attainment`.

    Takes the sweep's entries ({"request_rate": R, "metrics": {...}}) or the whole sweep JSON
    ({"results": [...]}). Rates are read with parse_rate, so "inf" works. Requiring every lower rate
    to pass too keeps a lucky high rate after a failing lower one from counting. None: even the
    lowest rate missed.
    """
    entries = sweep_results["results"] if isinstance(sweep_results, Mapping) else sweep_results
    best = None
    for entry in sorted(entries, key=lambda e: parse_rate(e["request_rate"])):
        if entry["metrics"]["slo_attainment"] < attainment:
            break
        best = parse_rate(entry["request_rate"])
    return best


# ---- tables --------------------------------------------------------------------------------------

def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_summary(metrics: Mapping[str, Any], title: str = "Serving benchmark") -> str:
    """A readable table of one run's aggregate metrics."""
    width = 60
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40}{value:>20}")

    row("Requests (completed / failed)", f"{metrics['num_completed']} / {metrics['num_failed']}")
    row("Duration (s)", _fmt(metrics["duration_s"]))
    row("Prompt tokens (usage)", metrics["total_prompt_tokens"])
    row("Output tokens (usage)", metrics["total_output_tokens"])
    row("Request throughput (req/s)", _fmt(metrics["request_throughput"]))
    row("Output token throughput (tok/s)", _fmt(metrics["output_token_throughput"]))
    row("Total token throughput (tok/s)", _fmt(metrics["total_token_throughput"]))
    slo = metrics["slo"]
    row("SLO (TTFT ms / TPOT ms)", f"{_fmt(slo['ttft_ms'], 0)} / {_fmt(slo['tpot_ms'], 0)}")
    row("SLO attainment", f"{metrics['slo_attainment']:.1%}")
    row("Goodput (req/s)", _fmt(metrics["goodput"]))
    lines.append("-" * width)
    lines.append(f"{'latency (ms)':<16}" + "".join(f"{h:>11}" for h in ("mean", "p50", "p90", "p99")))
    for label, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        stats = metrics[key]
        lines.append(f"{label:<16}" + "".join(f"{_fmt(stats[k]):>11}" for k in ("mean", "p50", "p90", "p99")))
    if metrics.get("per_turn"):
        lines.append("-" * width)
        lines.append(f"{'turn':<16}{'completed':>11}{'TTFT p50':>11}{'prompt tok':>11}")
        for t in metrics["per_turn"]:
            lines.append(f"{t['turn']:<16}{t['num_completed']:>11}{_fmt(t['ttft_ms_p50']):>11}"
                         f"{_fmt(t['prompt_tokens_mean'], 0):>11}")
    if metrics["num_without_usage"]:
        lines.append(f"warning: {metrics['num_without_usage']} completed requests had no usage in the "
                     "stream; their tokens are not counted")
    if metrics["errors"]:
        lines.append("-" * width)
        lines.append("errors (count: message)")
        lines += [f"  {n}: {message}" for message, n in metrics["errors"].items()]
    lines.append("=" * width)
    return "\n".join(lines)


def format_sweep_summary(results: Sequence[Mapping[str, Any]]) -> str:
    """One row per swept rate."""
    header = ("rate", "ok/fail", "req/s", "out tok/s", "TTFT p90", "TPOT p90", "attain", "goodput")
    widths = (8, 10, 8, 11, 10, 10, 8, 9)
    lines = ["".join(f"{h:>{w}}" for h, w in zip(header, widths))]
    for entry in results:
        m = entry["metrics"]
        cells = (f"{parse_rate(entry['request_rate']):g}", f"{m['num_completed']}/{m['num_failed']}",
                 _fmt(m["request_throughput"]), _fmt(m["output_token_throughput"], 1),
                 _fmt(m["ttft_ms"]["p90"], 1), _fmt(m["tpot_ms"]["p90"], 1),
                 f"{m['slo_attainment']:.0%}", _fmt(m["goodput"]))
        lines.append("".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    for entry in results:
        lines += [f"errors at rate {entry['request_rate']}: {n} x {message}"
                  for message, n in entry["metrics"]["errors"].items()]
    return "\n".join(lines)
