"""The push handoff between tensor-parallel instances (`--kv-connector nixl-push`, NIXL over DRAM), on a tiny
llama (2 KV heads): P and D of 2 ranks each, P of 2 into D of 1 and P of 1 into D of 2, each pair behind a
proxy, against a colocated instance of one rank: the same tokens, KV that every P rank really wrote, nothing
held afterwards."""
from __future__ import annotations

import pytest

from tests.e2e.cluster import wait_until
from tests.e2e.test_tp_pd_cluster import complete, pair_proxies, tiny_llama_servers

# staging_bytes: two blocks' staging (8 KiB a block of this model, whichever side regroups), so that the
# mixed pairs' transfers of more than two blocks move in rounds through every rank's pool
KV = '{"lease_seconds": 4, "heartbeat_seconds": 1, "staging_bytes": 16384}'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model, serve, started = tiny_llama_servers(tmp_path_factory, "tp_push")

    def instance(name, kv_role, *tp):
        return serve(name, *tp, "--kv-connector", "nixl-push", "--kv-role", kv_role, "--engine-id", name,
                     "--kv-transfer-config", KV)
    try:
        prefill, decode = instance("tp-push-prefill", "producer", "-tp", "2"), instance("tp-push-decode",
                                                                                        "consumer", "-tp", "2")
        narrow_prefill, narrow_decode = instance("tp1-push-prefill", "producer"), instance("tp1-push-decode",
                                                                                           "consumer")
        colocated = serve("tp-push-colocated")
        for p in started:
            p.wait_healthy()
        pairs = {"2-2": (prefill, decode), "2-1": (prefill, narrow_decode), "1-2": (narrow_prefill, decode)}
        proxies = pair_proxies(pairs, "tp-push-proxy", started)
        yield {"colocated": colocated, "proxies": proxies, "pairs": pairs, "model": model}
    finally:
        for p in reversed(started):
            p.stop()


@pytest.mark.parametrize("pair", ["2-2", "2-1", "1-2"])
def test_prefill_and_decode_of_these_sizes_push_and_answer_as_one_colocated_rank(cluster, pair):
    colocated, model = cluster["colocated"], cluster["model"]
    proxy, (prefill, decode) = cluster["proxies"][pair], cluster["pairs"][pair]
    before = prefill.metrics().get("kv_transfer_bytes_total", 0)
    for n in (1, 15, 16, 17, 33, 100):
        prompt = [(5 * i + n) % 250 + 1 for i in range(n)]
        for extra in ({}, {"temperature": 0.9, "seed": n}):
            status, got = complete(proxy, model, prompt, **extra)
            assert status == 200, got
            status, want = complete(colocated, model, prompt, **extra)
            assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"], (n, extra)
    # P wrote (it alone counts a push) at least the 100-token prompt's 6 full blocks of 2 layers x K,V x 16
    # slots x 2 heads x 16 dims x 4 bytes, over all its ranks
    assert prefill.metrics()["kv_transfer_bytes_total"] - before >= 6 * (2 * 2 * 16 * 2 * 16 * 4)
    assert wait_until(lambda: all(p.metrics().get("kv_cache_usage_perc") == 0
                                  and p.metrics().get("num_blocks_held_for_transfer", 0) == 0
                                  for p in (prefill, decode)), timeout=15)
    assert prefill.metrics().get("kv_lease_expirations_total", 0) == 0
    assert decode.metrics().get("kv_transfer_failures_total", 0) == 0
