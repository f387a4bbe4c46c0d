"""What the server's and the proxy's /metrics share: prometheus_client's text format, without `_created`.

prometheus_client adds a `<name>_created` gauge (a creation timestamp) beside every counter and histogram.
Our metric names are an interface and those series are not part of it; the library's own switch
(`disable_created_metrics`) is process-wide, so `exposition` drops them per scrape instead.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _WithoutCreated(Collector):
    def __init__(self, collectors: tuple[Collector, ...]) -> None:
        self.collectors = collectors

    def collect(self) -> Iterator[Metric]:
        for collector in self.collectors:
            for family in collector.collect():   # built anew at each collect: ours to change
                family.samples = [s for s in family.samples if s.name != family.name + "_created"]
                yield family


def exposition(*collectors: Collector) -> bytes:
    """The Prometheus text format (CONTENT_TYPE) of the collectors' metrics, in order; their names must not
    overlap."""
    return generate_latest(_WithoutCreated(collectors))
