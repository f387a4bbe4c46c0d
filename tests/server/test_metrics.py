"""/metrics through prometheus_client: the server's own metrics, the engine's stats, the proxy's metrics."""
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import ProxyMetrics
from pdserve.server.metrics import ENGINE_STAT_DEFAULTS, TTFT_BUCKETS, ServerMetrics

SERVER_NAMES = {  # exposed name → type, as the hand-written renderer had them
    "pdserve:prompt_tokens_total": "counter", "pdserve:generation_tokens_total": "counter",
    "pdserve:request_success_total": "counter", "pdserve:request_failure_total": "counter",
    "pdserve:request_abort_total": "counter", "pdserve:time_to_first_token_seconds": "histogram",
    "pdserve:request_rejected_total": "counter",
    "pdserve:inter_token_latency_seconds": "histogram", "pdserve:e2e_request_latency_seconds": "histogram"}
PROXY_NAMES = {
    "pdserve:proxy_requests_total": "counter", "pdserve:proxy_request_errors_total": "counter",
    "pdserve:proxy_client_errors_total": "counter",
    "pdserve:proxy_client_disconnects_total": "counter", "pdserve:proxy_prefill_retries_total": "counter",
    "pdserve:proxy_requests_in_flight": "gauge", "pdserve:proxy_time_to_first_token_seconds": "histogram",
    "pdserve:proxy_requests_queued": "gauge",
    "pdserve:proxy_prefill_seconds": "histogram", "pdserve:proxy_kv_releases_total": "counter",
    "pdserve:proxy_requests_rejected_total": "counter",
    "pdserve:proxy_backend_requests_total": "counter", "pdserve:proxy_backend_errors_total": "counter",
    "pdserve:proxy_recoveries_total": "counter", "pdserve:proxy_recovery_failures_total": "counter"}


def types(text: str) -> dict[str, str]:
    """Exposed name → type, from the # TYPE lines."""
    return {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_server_metrics_keep_their_names_and_buckets():
    m = ServerMetrics()
    m.prompt_tokens.inc(5)
    m.request_success.inc()
    for v in (0.001, 0.05, 700.0):
        m.ttft.observe(v)
    text = m.render(lambda: {}).decode()
    assert types(text) == SERVER_NAMES | {f"pdserve:{k}": "counter" if k.endswith("_total") else "gauge"
                                          for k in ENGINE_STAT_DEFAULTS}
    assert "_created" not in text   # prometheus_client's extra series stay out
    assert "# HELP pdserve:prompt_tokens_total Prompt tokens of requests that produced output.\n" in text
    s = samples(text)
    assert s["pdserve:prompt_tokens_total", ()] == 5 and s["pdserve:request_success_total", ()] == 1
    ttft = {float(dict(labels)["le"]): v for (name, labels), v in s.items()
            if name == "pdserve:time_to_first_token_seconds_bucket"}
    assert sorted(ttft) == [*TTFT_BUCKETS, float("inf")]
    assert (ttft[0.001], ttft[0.04], ttft[0.06], ttft[640.0], ttft[float("inf")]) == (1, 1, 2, 2, 3)  # le: <=
    assert s["pdserve:time_to_first_token_seconds_count", ()] == 3
    assert ServerMetrics().render(lambda: {}).decode().count("\npdserve:prompt_tokens_total 0.0\n") == 1  # its own


def test_engine_stats_types_help_and_bad_values():
    stats = {"num_requests_running": 2, "kv_transfer_bytes_total": 1e9, "num_preemptions_total": 3,
             "kv_transfer_seconds": {"buckets": [0.1, 1.0], "counts": [1, 2], "sum": 0.7, "count": 3},
             "broken_hist": {"buckets": [0.1, 1], "counts": [1]}, "flag": True, "text": "x",
             "request_success_total": 99}   # the server's own name: not the engine's to report
    text = ServerMetrics().render(lambda: stats).decode()
    t, s = types(text), samples(text)
    assert t["pdserve:num_requests_running"] == "gauge" and t["pdserve:kv_transfer_bytes_total"] == "counter"
    assert t["pdserve:kv_transfer_seconds"] == "histogram"
    assert "# HELP pdserve:kv_transfer_seconds Duration of one request's KV transfer.\n" in text
    assert "# HELP pdserve:num_preemptions_total num preemptions total\n" in text   # no help given: the key
    assert s["pdserve:kv_transfer_bytes_total", ()] == 1e9 and s["pdserve:num_preemptions_total", ()] == 3
    assert s["pdserve:kv_transfer_seconds_bucket", (("le", "1.0"),)] == 2
    assert s["pdserve:kv_transfer_seconds_bucket", (("le", "+Inf"),)] == 3   # the count
    assert s["pdserve:kv_transfer_seconds_sum", ()] == 0.7
    assert s["pdserve:prefix_cache_hits_total", ()] == 0   # a default, not reported
    assert s["pdserve:request_success_total", ()] == 0     # the server's counter, once
    for absent in ("broken_hist", "flag", "text"):
        assert f"pdserve:{absent}" not in text


def test_engine_stats_that_raise_leave_the_rest():
    def stats():
        raise RuntimeError("engine gone")

    m = ServerMetrics()
    m.generation_tokens.inc(7)
    s = samples(m.render(stats).decode())
    assert s["pdserve:generation_tokens_total", ()] == 7
    assert all(s[f"pdserve:{k}", ()] == 0 for k in ENGINE_STAT_DEFAULTS)


def test_proxy_metrics_names_and_backend_labels():
    m = ProxyMetrics()
    m.num_requests.inc()
    m.num_in_flight.inc(); m.num_in_flight.inc(); m.num_in_flight.dec()
    m.prefill_seconds.observe(0.3)
    m.backend_request("prefill", "prefill-0"); m.backend_request("prefill", "prefill-0"); m.backend_request("decode", "decode-1")
    m.backend_error("prefill", "prefill-0")
    text = m.render().decode()
    assert types(text) == PROXY_NAMES and "_created" not in text
    s = samples(text)
    assert s["pdserve:proxy_requests_total", ()] == 1 and s["pdserve:proxy_requests_in_flight", ()] == 1
    assert s["pdserve:proxy_prefill_seconds_bucket", (("le", "0.5"),)] == 1
    assert s["pdserve:proxy_backend_requests_total", (("backend", "prefill-0"), ("role", "prefill"))] == 2
    assert s["pdserve:proxy_backend_requests_total", (("backend", "decode-1"), ("role", "decode"))] == 1
    assert s["pdserve:proxy_backend_errors_total", (("backend", "prefill-0"), ("role", "prefill"))] == 1
    assert ProxyMetrics().render().count(b"pdserve:proxy_requests_total 0.0") == 1   # a registry per proxy
