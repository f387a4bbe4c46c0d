"""Plots of saved results (the dicts that --out writes), so they can be drawn again from a file.

matplotlib is imported only here and only when a plot is asked for, with the file-only Agg backend.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from pdserve.bench.metrics import parse_rate


def require_matplotlib() -> None:
    """ValueError before a long run rather than after it, when --plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("plot: matplotlib is not installed (pip install matplotlib)") from None


def _pyplot():
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax, values_ms: Sequence[float], title: str, of: str = "requests") -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel(f"fraction of {of}")
    if not values_ms:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    xs = sorted(values_ms)
    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
    ax.grid(alpha=0.3)


def plot_benchmark(result: Mapping[str, Any], path: str | Path) -> None:
    """One run: CDFs of TTFT, TPOT and ITL, and E2E latency against send time (failures marked)."""
    plt = _pyplot()
    requests = result["requests"]
    ok = [r for r in requests if r["success"]]
    failed = [r for r in requests if not r["success"]]
    slo = result["metrics"]["slo"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    _cdf(axes[0][0], [r["ttft"] * 1000 for r in ok if r["ttft"] is not None], "TTFT")
    _cdf(axes[0][1], [r["tpot"] * 1000 for r in ok if r["tpot"] is not None], "TPOT")
    _cdf(axes[1][0], [gap * 1000 for r in ok for gap in r["itls"]], "ITL", of="gaps")
    for ax, key in ((axes[0][0], "ttft_ms"), (axes[0][1], "tpot_ms")):
        if slo[key] is not None:
            ax.axvline(slo[key], color="red", linestyle="--", label="SLO")
            ax.legend()
    ax = axes[1][1]
    ax.set_title("E2E latency by send time")
    ax.scatter([r["start_time"] for r in ok], [r["e2e"] * 1000 for r in ok], s=8, label="completed")
    if failed:
        ax.scatter([r["start_time"] for r in failed], [(r["e2e"] or 0) * 1000 for r in failed],
                   s=16, marker="x", color="red", label="failed")
    ax.set_xlabel("send time (s)")
    ax.set_ylabel("E2E (ms)")
    ax.legend()
    ax.grid(alpha=0.3)
    config = result["config"]
    fig.suptitle(f"{config['model']} {config['endpoint']} rate {config['request_rate']} "
                 f"({len(ok)} ok, {len(failed)} failed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweeps(sweeps: Sequence[tuple[str, Mapping[str, Any]]], path: str | Path) -> None:
    """SLO attainment, TTFT p90 and TPOT p90 against request rate, one line per labelled sweep.

    Rates sit at evenly spaced positions labelled with their value, so "inf" has a place.
    """
    plt = _pyplot()
    rates = sorted({parse_rate(e["request_rate"]) for _, s in sweeps for e in s["results"]})
    position = {rate: i for i, rate in enumerate(rates)}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("SLO attainment", lambda m: m["slo_attainment"]),
              ("TTFT p90 (ms)", lambda m: m["ttft_ms"]["p90"]),
              ("TPOT p90 (ms)", lambda m: m["tpot_ms"]["p90"]))
    for ax, (title, value) in zip(axes, panels):
        for label, sweep in sweeps:
            points = sorted((position[parse_rate(e["request_rate"])], value(e["metrics"]))
                            for e in sweep["results"])
            points = [(x, y) for x, y in points if y is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_xticks(range(len(rates)), ["inf" if r == float("inf") else f"{r:g}" for r in rates])
        ax.grid(alpha=0.3)
    first = sweeps[0][1]
    axes[0].set_ylim(-0.02, 1.02)
    axes[0].axhline(first.get("target_attainment", 0.9), color="gray", linestyle=":", label="target")
    slo = first["results"][0]["metrics"]["slo"] if first["results"] else {}
    for ax, key in ((axes[1], "ttft_ms"), (axes[2], "tpot_ms")):
        if slo.get(key) is not None:
            ax.axhline(slo[key], color="red", linestyle="--", label="SLO")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(sweep: Mapping[str, Any], path: str | Path, label: str | None = None) -> None:
    """One sweep's plot; see plot_sweeps."""
    plot_sweeps([(label or sweep["config"].get("model") or "sweep", sweep)], path)
