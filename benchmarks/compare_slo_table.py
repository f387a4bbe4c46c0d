"""Max rate at >= 90 % SLO attainment of each configuration of a `pdserve bench compare` run, under
other SLOs than the run's own, read from the per-request TTFT and TPOT in its sweep JSONs.

  python3 benchmarks/compare_slo_table.py DIR [--slo 2000:30 --slo 2000:20 ...]   (TTFT_ms:TPOT_ms)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

CONFIGS = ("colocated", "colocated-chunked", "disaggregated")


def run_names(directory: Path) -> list[str]:
    """The runs in the summary's order (colocated-chunked-<B> per chunk budget), else CONFIGS."""
    summary = directory / "summary.json"
    if summary.exists():
        return [c["config"] for c in json.loads(summary.read_text())["configs"]]
    return list(CONFIGS)


def attainment(requests: list[dict], ttft_s: float, tpot_s: float) -> float:
    ok = sum(1 for r in requests if r["success"] and r["ttft"] is not None and r["ttft"] <= ttft_s
             and (r["tpot"] is None or r["tpot"] <= tpot_s))
    return ok / len(requests)


def max_rate(sweep: dict, ttft_s: float, tpot_s: float, target: float = 0.9) -> str:
    """The highest rate at which this and every lower rate met the target ("<lowest" if none)."""
    best = None
    for entry in sorted(sweep["results"], key=lambda e: float(e["request_rate"])):
        if attainment(entry["requests"], ttft_s, tpot_s) < target:
            break
        best = entry["request_rate"]
    lowest = min((e["request_rate"] for e in sweep["results"]), key=float)
    return f"<{_rate(lowest)}" if best is None else _rate(best)


def _rate(rate: float | str) -> str:
    return rate if isinstance(rate, str) else f"{rate:g}"  # "inf" is stored as a string


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--slo", action="append", default=None, help="TTFT_ms:TPOT_ms (repeatable)")
    args = p.parse_args()
    slos = [tuple(float(x) for x in s.split(":")) for s in args.slo or ["2000:30", "2000:20", "2000:15", "1000:20"]]
    directory = Path(args.dir)
    sweeps = {c: json.loads((directory / f"{c}.json").read_text()) for c in run_names(directory)
              if (directory / f"{c}.json").exists()}
    print("| SLO (TTFT / TPOT) | " + " | ".join(sweeps) + " |")
    print("| --- |" + " ---: |" * len(sweeps))
    for ttft_ms, tpot_ms in slos:
        cells = [max_rate(s, ttft_ms / 1e3, tpot_ms / 1e3) for s in sweeps.values()]
        print(f"| {ttft_ms / 1e3:g} s / {tpot_ms:g} ms | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
