"""The API server's /metrics: what the server measures per request, and the engine's stats read at scrape time.

The server's own counters and histograms live in a CollectorRegistry per ServerMetrics (never the global
one: a process may hold several apps). The engine runs in another process and reports a flat stats dict
(`engine.stats()`); EngineStats turns it into metric families when /metrics is read. A histogram crosses
that boundary as a plain dict:
    {"buckets": [upper bounds, ascending], "counts": [observations <= bound, CUMULATIVE, one per bucket],
     "sum": total of observed values, "count": number of observations}
The +Inf bucket is implicit: it equals "count".
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pdserve.metrics import exposition

logger = logging.getLogger(__name__)

METRIC_PREFIX = "pdserve:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)

# Engine gauges and counters /metrics always shows, 0 until the engine reports them.
ENGINE_STAT_DEFAULTS = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
                        "prefix_cache_queries_total": 0, "prefix_cache_hits_total": 0}
ENGINE_STAT_HELP = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (0..1).",
    "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits_total": "Prompt tokens found in the prefix cache.",
    "num_requests_waiting_for_remote_kvs": "Requests waiting for KV from a remote prefill instance.",
    "num_blocks_held_for_transfer": "Blocks held after finishing until a remote decode instance reads them.",
    "kv_transfer_bytes_total": "Bytes of KV moved between instances.",
    "kv_transfer_descriptors_total": "Transfer descriptors posted.",
    "kv_transfer_failures_total": "KV transfers that failed.",
    "kv_lease_expirations_total": "Held blocks freed because their lease expired.",
    "kv_transfer_seconds": "Duration of one request's KV transfer.",
    "kv_transfer_seconds_total": "Seconds spent in KV transfers (the sum of kv_transfer_seconds).",
    "kv_staging_bytes_in_use": "Bytes of rank 0's staging pool that transfers between tensor-parallel sizes hold.",
    "kv_staging_transfers_waiting": "Transfers between tensor-parallel sizes waiting for room in rank 0's staging pool.",
    "kv_store_loaded_blocks_total": "Blocks read from the KV store (--kv-connector store).",
    "kv_store_inserted_blocks_total": "Blocks written into the KV store (--kv-connector store).",
    "kv_store_errors_total": "Exchanges with the KV store that failed or were refused.",
    "kv_store_connected": "1 while this instance is connected to its KV store.",
    "kv_store_shared_memory": "1 while this instance maps its KV store's pool (same host): copies, not NIXL.",
    "kv_store_lookups_total": "Prompts looked up in the KV store.",
    "kv_store_hits_total": "Lookups in the KV store that found at least one block.",
    "num_prefill_tokens_waiting": "Context tokens still to compute before the requests can decode.",
    "num_blocks": "KV-cache blocks.",
    "num_free_blocks": "KV-cache blocks no request holds (they may still hold cached prefixes).",
    "kv_bytes_per_token": "KV-cache bytes one token occupies, all layers, K and V.",
    "num_prompt_tokens_computed_total": "Prompt tokens computed (prefix-cache hits and remote KV excluded).",
    "num_output_tokens_total": "Tokens sampled.",
    "busy_seconds_total": "Seconds the engine spent in steps.",
}


class ServerMetrics:
    """What the server measures itself, per request, as the client sees it."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = METRIC_PREFIX
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of requests that produced output.",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens_total", "Tokens generated.", registry=r)
        self.request_success = Counter(p + "request_success_total", "Requests finished with stop or length.",
                                       registry=r)
        self.request_failure = Counter(p + "request_failure_total", "Requests ended by an engine error.", registry=r)
        self.request_abort = Counter(p + "request_abort_total", "Requests aborted because the client went away.",
                                     registry=r)
        self.request_rejected = Counter(p + "request_rejected_total",
                                        "Requests refused with a 503: the server was at capacity.", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival at the server to the first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between generated tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to the last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self._names = {family.name for family in r.collect()}   # the engine may not report these

    def render(self, engine_stats: Callable[[], Mapping[str, Any]]) -> bytes:
        """/metrics: the server's own metrics, then the engine's stats as `engine_stats()` has them now."""
        return exposition(self.registry, EngineStats(engine_stats, skip=self._names))


class EngineStats(Collector):
    """The engine's flat stats dict as metric families, read at each collect: numbers are counters (names
    ending in _total) or gauges, histogram snapshots (see the module docstring) histograms, other values are
    left out. ENGINE_STAT_DEFAULTS are always there; families named in `skip` are not."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], skip: Collection[str] = ()) -> None:
        self.stats, self.skip = stats, skip

    def collect(self) -> Iterator[Metric]:
        try:
            stats = {**ENGINE_STAT_DEFAULTS, **self.stats()}
        except Exception:   # noqa: BLE001 - the server's own metrics still render
            logger.exception("engine.stats failed")
            stats = dict(ENGINE_STAT_DEFAULTS)
        for key in sorted(stats):
            help = ENGINE_STAT_HELP.get(key, key.replace("_", " "))
            try:
                family = _family(METRIC_PREFIX + key, stats[key], help)
            except (TypeError, ValueError):   # one bad key must not hide the rest
                continue
            if family is not None and family.name not in self.skip:
                yield family


def _family(name: str, value: Any, help: str) -> Metric | None:
    if isinstance(value, Mapping) and "buckets" in value and "counts" in value:
        return _histogram(name, value, help)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    kind = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
    return kind(name, help, value=float(value))


def _histogram(name: str, snapshot: Mapping[str, Any], help: str) -> HistogramMetricFamily:
    bounds = [float(b) for b in snapshot["buckets"]]
    counts = [float(c) for c in snapshot["counts"]]
    if len(counts) != len(bounds):
        raise ValueError(f"{name}: {len(bounds)} buckets but {len(counts)} counts")
    count = float(snapshot.get("count", counts[-1] if counts else 0))
    buckets = [(floatToGoString(b), c) for b, c in zip(bounds, counts) if not math.isinf(b)]
    return HistogramMetricFamily(name, help, buckets=[*buckets, ("+Inf", count)],
                                 sum_value=float(snapshot.get("sum", 0.0)))
