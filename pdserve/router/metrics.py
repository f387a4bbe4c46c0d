"""The proxy's /metrics, named `pdserve:proxy_*`: requests as its clients see them, and hops per backend.

A backend is labelled by its role and its place in its pool (`backend="prefill-0"`), never by its URL: hosts
and ports are internals a dashboard has no business with. One CollectorRegistry per ProxyMetrics, never the
global one: a process may hold several proxies, or a proxy and a server.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.metrics import exposition

METRIC_PREFIX = "pdserve:proxy_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterCollector:
    """The router's own counters and every instance's state, read at scrape time (the router keeps them
    as plain numbers on its hot path)."""

    def __init__(self, router) -> None:
        self.router = router

    def collect(self):
        p = METRIC_PREFIX
        decisions = CounterMetricFamily(p + "routing_decisions", "Requests routed, by the decision: disaggregated, "
                                        "or straight to a decode/colocated instance because of a short_prompt, "
                                        "decode_has_prefix, prefill_saturated, prefill_backlog, or colocated (no P/D).",
                                        labels=["reason"])
        for reason, count in self.router.decisions.items():
            decisions.add_metric([reason], count)
        yield decisions
        yield CounterMetricFamily(p + "routing_no_instance", "Routing attempts that found no instance under its "
                                  "caps (the request then waits, or gets a 503).", value=self.router.num_no_candidate)
        available = GaugeMetricFamily(p + "instance_available", "1 while the instance is routed to, 0 while "
                                      "ejected.", labels=["role", "backend"])
        in_flight = GaugeMetricFamily(p + "instance_requests_in_flight", "Hops the router has open on the instance.",
                                      labels=["role", "backend"])
        ejections = CounterMetricFamily(p + "instance_ejections", "Times the instance was taken out of routing.",
                                        labels=["role", "backend"])
        for inst in self.router.instances:
            labels = [inst.role, inst.name]
            available.add_metric(labels, 1.0 if inst.is_available else 0.0)
            in_flight.add_metric(labels, inst.own_in_flight)
            ejections.add_metric(labels, inst.num_ejections)
        yield from (available, in_flight, ejections)


class ProxyMetrics:
    def __init__(self, router=None) -> None:
        self.registry = r = CollectorRegistry()
        if router is not None:
            r.register(RouterCollector(router))
        p = METRIC_PREFIX
        self.num_requests = Counter(p + "requests_total", "Completion requests received.", registry=r)
        self.num_errors = Counter(p + "request_errors_total", "Requests answered with an error (or a mid-stream one), "
                                  "client errors included.", registry=r)
        self.num_client_errors = Counter(p + "client_errors_total", "Requests the router or an instance refused as "
                                         "the client's error (HTTP 4xx but 429: a bad field or key, a prompt too "
                                         "long, an unknown model).", registry=r)
        self.num_client_disconnects = Counter(p + "client_disconnects_total",
                                              "Clients gone before the answer ended.", registry=r)
        self.num_prefill_retries = Counter(p + "prefill_retries_total", "Requests routed again after their P failed.",
                                           registry=r)
        self.num_in_flight = Gauge(p + "requests_in_flight", "Completion requests being served.", registry=r)
        self.num_queued = Gauge(p + "requests_queued", "Requests waiting for an instance with room.", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Client request to the first bytes from the decode instance.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_seconds = Histogram(p + "prefill_seconds", "The prefill hop, retries included.",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.num_kv_releases = Counter(p + "kv_releases_total", "Releases sent to a P whose decode hop did not happen.",
                                       registry=r)
        self.num_rejected = Counter(p + "requests_rejected_total", "Requests refused with a 503 at capacity.",
                                    registry=r)
        self.num_recoveries = Counter(p + "recoveries_total", "Requests resumed on another decode (or colocated) "
                                      "instance after the one serving them failed (each resubmission).", registry=r)
        self.num_recovery_failures = Counter(p + "recovery_failures_total", "Decode hops that failed and could "
                                             "not be resumed: no other instance (no_backend), none with room "
                                             "within --queue-timeout after a 503 at capacity (no_room), "
                                             "max_recoveries reached (limit), an instance that does not report "
                                             "token ids (untracked), or after the finish (after_finish).",
                                             ["reason"], registry=r)
        self.num_backend_requests = Counter(p + "backend_requests_total", "Hops sent to a backend, retries included.",
                                            ["role", "backend"], registry=r)
        self.num_backend_errors = Counter(p + "backend_errors_total", "Hops that failed because of the backend: "
                                          "no connection, a timeout, a 5xx, an unusable answer, a mid-stream error.",
                                          ["role", "backend"], registry=r)

    def backend_request(self, role: str, backend: str) -> None:
        """A hop sent to `backend` ("prefill-0": its pool and index) of the `role` pool."""
        self.num_backend_requests.labels(role=role, backend=backend).inc()

    def backend_error(self, role: str, backend: str) -> None:
        """A hop to that backend failed through the backend's fault (not a 4xx passed on to the client)."""
        self.num_backend_errors.labels(role=role, backend=backend).inc()

    def render(self) -> bytes:
        return exposition(self.registry)
