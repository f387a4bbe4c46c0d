"""The Prometheus text renderer."""
from pdserve.metrics import Histogram, Registry, metric_name, render_stats


def test_registry_renders_counters_gauges_histograms():
    r = Registry(prefix="pdserve:")
    c, g, h = r.counter("requests_total", "Requests."), r.gauge("running"), r.histogram("lat_seconds", [0.1, 1.0])
    c.inc(); c.inc(2)
    g.set(1.5)
    for v in (0.05, 0.1, 0.5, 7.0):
        h.observe(v)
    text = r.render()
    assert "# HELP pdserve:requests_total Requests.\n# TYPE pdserve:requests_total counter\n" in text
    assert "pdserve:requests_total 3\n" in text and "pdserve:running 1.5\n" in text
    assert '# TYPE pdserve:lat_seconds histogram\n' in text
    assert 'pdserve:lat_seconds_bucket{le="0.1"} 2\n' in text    # le is inclusive
    assert 'pdserve:lat_seconds_bucket{le="1"} 3\n' in text
    assert 'pdserve:lat_seconds_bucket{le="+Inf"} 4\n' in text
    assert "pdserve:lat_seconds_sum 7.65\n" in text and "pdserve:lat_seconds_count 4\n" in text
    assert r.names == ["pdserve:requests_total", "pdserve:running", "pdserve:lat_seconds"]


def test_histogram_snapshot_is_cumulative():
    h = Histogram("x", [1, 2, 3])
    for v in (0.5, 2.5, 2.5, 9):
        h.observe(v)
    assert h.snapshot() == {"buckets": [1.0, 2.0, 3.0], "counts": [1, 1, 3], "sum": 14.5, "count": 4}


def test_render_stats_types_skip_and_bad_values():
    stats = {"num_requests_running": 2, "kv_transfer_bytes_total": 1e9, "weird-name": 1, "flag": True,
             "kv_transfer_seconds": {"buckets": [0.1], "counts": [1], "sum": 0.05, "count": 2},
             "broken_hist": {"buckets": [0.1, 1], "counts": [1]}, "text": "x", "skipped": 1}
    text = render_stats(stats, prefix="pdserve:", skip=["pdserve:skipped"])
    assert "# TYPE pdserve:num_requests_running gauge\npdserve:num_requests_running 2\n" in text
    assert "# TYPE pdserve:kv_transfer_bytes_total counter\npdserve:kv_transfer_bytes_total 1000000000\n" in text
    assert "pdserve:weird_name 1\n" in text
    assert 'pdserve:kv_transfer_seconds_bucket{le="+Inf"} 2\n' in text
    for absent in ("flag", "broken_hist", "text", "skipped"):
        assert f"pdserve:{absent}" not in text
    assert metric_name("9lives") == "_9lives"
