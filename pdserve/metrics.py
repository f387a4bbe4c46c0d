"""A tiny Prometheus text-format (0.0.4) renderer: counters, gauges and histograms, no labels.

Used by the API server and the proxy for their own metrics, and by the server to render whatever
`engine.stats()` reports. Pure Python and no dependencies, so any layer may import it.

Histogram data crosses boundaries as a plain dict (what `Histogram.snapshot()` returns):
    {"buckets": [upper bounds, ascending], "counts": [observations <= bound, CUMULATIVE, one per bucket],
     "sum": total of observed values, "count": number of observations}
The +Inf bucket is implicit: it equals "count".
"""
from __future__ import annotations

import bisect
import math
import re
from typing import Any, Iterable, Mapping

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_INVALID_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_:]")


def metric_name(name: str) -> str:
    """A valid Prometheus metric name: invalid characters become '_', a leading digit gets '_'."""
    name = _INVALID_NAME_CHARS.sub("_", name)
    return f"_{name}" if not name or name[0].isdigit() else name


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _header(name: str, kind: str, help: str) -> list[str]:
    help = help.replace("\\", "\\\\").replace("\n", "\\n")
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]


def render_counter(name: str, value: float, help: str = "") -> str:
    return "\n".join(_header(name, "counter", help) + [f"{name} {format_value(value)}"]) + "\n"


def render_gauge(name: str, value: float, help: str = "") -> str:
    return "\n".join(_header(name, "gauge", help) + [f"{name} {format_value(value)}"]) + "\n"


def render_histogram(name: str, snapshot: Mapping[str, Any], help: str = "") -> str:
    """`snapshot` as described in the module docstring."""
    buckets = [float(b) for b in snapshot.get("buckets", [])]
    counts = [float(c) for c in snapshot.get("counts", [])]
    if len(counts) != len(buckets):
        raise ValueError(f"{name}: {len(buckets)} buckets but {len(counts)} counts")
    count = float(snapshot.get("count", counts[-1] if counts else 0))
    lines = _header(name, "histogram", help)
    lines += [f'{name}_bucket{{le="{format_value(b)}"}} {format_value(c)}'
              for b, c in zip(buckets, counts) if not math.isinf(b)]
    lines.append(f'{name}_bucket{{le="+Inf"}} {format_value(count)}')
    lines.append(f"{name}_sum {format_value(float(snapshot.get('sum', 0.0)))}")
    lines.append(f"{name}_count {format_value(count)}")
    return "\n".join(lines) + "\n"


def is_histogram_snapshot(value: Any) -> bool:
    return isinstance(value, Mapping) and "buckets" in value and "counts" in value


def render_stats(stats: Mapping[str, Any], *, prefix: str = "", skip: Iterable[str] = (),
                 helps: Mapping[str, str] | None = None) -> str:
    """Render a flat stats dict: numbers as counters (names ending in _total) or gauges, histogram
    snapshots as histograms. Names in `skip` (after prefixing) and values of other types are left out,
    and so is a key whose value cannot be rendered: one bad key must not hide the rest."""
    skip, helps = set(skip), helps or {}
    parts = []
    for key in sorted(stats):
        value, name = stats[key], metric_name(prefix + key)
        if name in skip:
            continue
        help = helps.get(key, key.replace("_", " "))
        try:
            if is_histogram_snapshot(value):
                parts.append(render_histogram(name, value, help))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                render = render_counter if name.endswith("_total") else render_gauge
                parts.append(render(name, float(value), help))
        except (TypeError, ValueError):
            continue
    return "".join(parts)


class Counter:
    def __init__(self, name: str, help: str = "") -> None:
        self.name, self.help, self.value = name, help, 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up, got {amount}")
        self.value += amount

    def render(self) -> str:
        return render_counter(self.name, self.value, self.help)


class Gauge:
    def __init__(self, name: str, help: str = "") -> None:
        self.name, self.help, self.value = name, help, 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def render(self) -> str:
        return render_gauge(self.name, self.value, self.help)


class Histogram:
    def __init__(self, name: str, buckets: Iterable[float], help: str = "") -> None:
        self.name, self.help = name, help
        self.buckets = sorted(float(b) for b in buckets if not math.isinf(b))
        self._bucket_counts = [0] * (len(self.buckets) + 1)   # per bucket, last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self._bucket_counts[bisect.bisect_left(self.buckets, value)] += 1   # le: value <= bound
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        cumulative, running = [], 0
        for c in self._bucket_counts[:-1]:
            running += c
            cumulative.append(running)
        return {"buckets": list(self.buckets), "counts": cumulative, "sum": self.sum, "count": self.count}

    def render(self) -> str:
        return render_histogram(self.name, self.snapshot(), self.help)


class Registry:
    """Metrics of one process, rendered in the order they were created."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}

    def _add(self, metric):
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} already registered")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str = "") -> Counter:
        return self._add(Counter(metric_name(self.prefix + name), help))

    def gauge(self, name: str, help: str = "") -> Gauge:
        return self._add(Gauge(metric_name(self.prefix + name), help))

    def histogram(self, name: str, buckets: Iterable[float], help: str = "") -> Histogram:
        return self._add(Histogram(metric_name(self.prefix + name), buckets, help))

    @property
    def names(self) -> list[str]:
        return list(self._metrics)

    def render(self) -> str:
        return "".join(m.render() for m in self._metrics.values())
