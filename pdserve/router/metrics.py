"""The proxy's /metrics, named `pdserve:proxy_*`: requests as its clients see them, and hops per backend.

A backend is labelled by its role and its place in its pool (`backend="prefill-0"`), never by its URL: hosts
and ports are internals a dashboard has no business with. One CollectorRegistry per ProxyMetrics, never the
global one: a process may hold several proxies, or a proxy and a server.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.metrics import exposition

METRIC_PREFIX = "pdserve:proxy_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = METRIC_PREFIX
        self.num_requests = Counter(p + "requests_total", "Completion requests received.", registry=r)
        self.num_errors = Counter(p + "request_errors_total", "Requests answered with an error (or a mid-stream one).",
                                  registry=r)
        self.num_client_disconnects = Counter(p + "client_disconnects_total",
                                              "Clients gone before the answer ended.", registry=r)
        self.num_prefill_retries = Counter(p + "prefill_retries_total", "Prefill hops retried on another P.",
                                           registry=r)
        self.num_in_flight = Gauge(p + "requests_in_flight", "Completion requests being served.", registry=r)
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
                                             "not be resumed: no other instance (no_backend), max_recoveries "
                                             "reached (limit), an instance that does not report token ids "
                                             "(untracked), or after the finish (after_finish).",
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
