"""`pdserve kv-store --metrics-port`: the pool's state and counters for Prometheus, the same figures as the
`stats` message, read whole under the store's lock."""
from __future__ import annotations

import signal
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import Process, free_port, wait_until
from tests.kv_transfer.helpers import nixl_available

if not nixl_available():
    pytest.skip("needs NIXL (nixl or nixl_cu13)", allow_module_level=True)

from pdserve.kv_store.server import KVStoreServer, StoreMetrics  # noqa: E402


def samples(text: str) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_metrics_follow_the_index():
    server = KVStoreServer("127.0.0.1", 0, 8 * 512)
    try:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StoreMetrics(server))
        assert samples(generate_latest(registry).decode())["kv_store_slots"] == 0   # (sized at the first handshake)
        reply, _ = server._on_handshake({"block_bytes": 512, "compat_hash": "h"}, b"")
        assert reply["ok"]
        server._on_insert({"boot_id": server.boot_id, "insert_id": "i", "hashes": [1, 2, 3]}, b"")
        server._on_end_insert({"type": "commit", "boot_id": server.boot_id, "insert_id": "i"}, b"")
        server._on_lookup({"boot_id": server.boot_id, "lease_id": "l", "hashes": [1, 2, 9]}, b"")
        got = samples(generate_latest(registry).decode())
        assert (got["kv_store_slots"], got["kv_store_slots_stored"], got["kv_store_slots_free"]) == (8, 3, 5)
        assert (got["kv_store_inserted_blocks_total"], got["kv_store_lookups_total"],
                got["kv_store_hit_blocks_total"], got["kv_store_leases"]) == (3, 1, 2, 1)
        assert got["kv_store_block_bytes"] == 512 and got["kv_store_inserts_pending"] == 0
        assert not any(name.endswith("_created") for name in got)
    finally:
        server.close()


def test_kv_store_serves_its_metrics_over_http_and_stops_cleanly():
    port = free_port()
    store = Process(["kv-store", "--capacity", "64MiB", "--metrics-port", str(port)], "kv-store-metrics")
    try:
        url = f"http://127.0.0.1:{port}/metrics"

        def scrape():
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    return response.read().decode()
            except OSError:
                return None
        assert wait_until(lambda: scrape() is not None, timeout=60), f"no metrics; see {store.log.name}"
        got = samples(scrape())
        assert got["kv_store_slots"] == 0 and got["kv_store_evicted_blocks_total"] == 0
        store.proc.send_signal(signal.SIGTERM)
        assert store.proc.wait(timeout=30) == 0
        assert scrape() is None
    finally:
        store.stop()


def test_a_metrics_port_in_use_is_refused_at_start():
    taken = Process(["kv-store", "--capacity", "1MiB"], "kv-store-taken")
    try:
        assert wait_until(lambda: "listening" in open(taken.log.name).read(), timeout=60)
        store = Process(["kv-store", "--capacity", "1MiB", "--metrics-port", str(taken.port)], "kv-store-refused")
        assert store.proc.wait(timeout=60) == 2
        assert f"--metrics-port {taken.port}" in open(store.log.name).read()
    finally:
        taken.stop()


@pytest.mark.parametrize("port", ["70000", "-1", "x"])
def test_a_metrics_port_out_of_range_is_a_usage_error(port, capsys):
    """Before, 70000 reached bind() and ended the store with an OverflowError traceback (review)."""
    from pdserve import cli
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["kv-store", "--metrics-port", port])
    assert e.value.code == 2 and "a port is 0 to 65535" in capsys.readouterr().err
