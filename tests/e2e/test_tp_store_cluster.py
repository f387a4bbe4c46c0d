"""The store handoff between tensor-parallel instances (`--kv-connector store`, every instance on the store's
host: each rank maps the pool and copies its heads), on a tiny llama (2 KV heads): P of 2 ranks to D of 1
and P of 1 to D of 2, each pair behind a proxy, against a colocated instance of one rank: the same tokens,
KV that D really loaded from the store, nothing held afterwards. NIXL between ranks and the store (and the
store's regroup of a grouped WRITE): tests/kv_store/test_store_tp.py."""
from __future__ import annotations

import signal

import pytest

from tests.e2e.cluster import wait_until
from tests.e2e.test_store_cluster import start_store
from tests.e2e.test_tp_pd_cluster import complete, pair_proxies, tiny_llama_servers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model, serve, started = tiny_llama_servers(tmp_path_factory, "tp_store")
    store = start_store()
    state = {}

    def instance(name, kv_role, *tp):
        return serve(name, *tp, "--kv-connector", "store", "--kv-role", kv_role, "--engine-id", name,
                     "--kv-store", f"127.0.0.1:{store.port}")
    try:
        wide_prefill = instance("tp2-store-prefill", "producer", "-tp", "2")
        wide_decode = instance("tp2-store-decode", "consumer", "-tp", "2")
        narrow_prefill, narrow_decode = instance("tp1-store-prefill", "producer"), instance("tp1-store-decode",
                                                                                            "consumer")
        colocated = serve("tp-store-colocated")
        for p in started:
            p.wait_healthy()
        for p in (wide_prefill, wide_decode, narrow_prefill, narrow_decode):   # (the handshake is asynchronous)
            assert wait_until(lambda: p.metrics().get("kv_store_connected") == 1, timeout=30), p.name
        pairs = {"2-1": (wide_prefill, narrow_decode), "1-2": (narrow_prefill, wide_decode)}
        proxies = pair_proxies(pairs, "tp-store-proxy", started)
        state.update(colocated=colocated, proxies=proxies, pairs=pairs, model=model, store=store)
        yield state
    finally:
        for p in reversed(started):
            p.stop()
        state.get("store", store).stop()


@pytest.mark.parametrize("pair", ["2-1", "1-2"])
def test_prefill_and_decode_of_these_sizes_hand_over_through_the_store_as_one_colocated_rank(cluster, pair):
    colocated, model = cluster["colocated"], cluster["model"]
    proxy, (prefill, decode) = cluster["proxies"][pair], cluster["pairs"][pair]
    before = decode.metrics().get("kv_store_loaded_blocks_total", 0)
    for n in (1, 16, 17, 33, 100):
        prompt = [(11 * i + n + ord(pair[0])) % 250 + 1 for i in range(n)]   # new to the store for each pair
        for extra in ({}, {"temperature": 0.9, "seed": n}):
            status, got = complete(proxy, model, prompt, **extra)
            assert status == 200, got
            status, want = complete(colocated, model, prompt, **extra)
            assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"], (n, extra)
    # D loaded at least the full blocks of the 16-, 17-, 33- and 100-token prompts from the store, each rank
    # its heads (mapped: the pool is on this host)
    assert decode.metrics()["kv_store_loaded_blocks_total"] - before >= 1 + 1 + 2 + 6
    assert decode.metrics()["kv_store_shared_memory"] == prefill.metrics()["kv_store_shared_memory"] == 1
    assert wait_until(lambda: all(p.metrics().get("kv_cache_usage_perc") == 0
                                  and p.metrics().get("num_blocks_held_for_transfer", 0) == 0
                                  for p in (prefill, decode)), timeout=15)
    assert decode.metrics().get("kv_transfer_failures_total", 0) == 0


def test_a_store_that_dies_and_comes_back_costs_the_ranks_nothing_but_recomputes(cluster):
    """Every rank lets the dead store's pool go and maps the new one (the ranks' own mappings, not only rank 0's)."""
    colocated, model, store = cluster["colocated"], cluster["model"], cluster["store"]
    proxy, (prefill, decode) = cluster["proxies"]["2-1"], cluster["pairs"]["2-1"]
    wide_decode = cluster["pairs"]["1-2"][1]
    store.signal(signal.SIGKILL)
    for inst in (prefill, wide_decode):   # idle instances notice, and let the old pool go on every rank
        assert wait_until(lambda: inst.metrics().get("kv_store_connected") == 0
                          and inst.metrics().get("kv_store_shared_memory") == 0, timeout=15), inst.name
    for inst in (prefill, wide_decode):   # rank 0 and rank 1 alike: no process maps the dead pool any more
        assert [pid for pid in inst.pids() if "memfd:pdserve-kv-store" in open(f"/proc/{pid}/maps").read()] == []
    prompt = [(13 * i + 5) % 250 + 1 for i in range(70)]
    status, got = complete(proxy, model, prompt)
    assert status == 200, got
    assert got["choices"][0]["token_ids"] == complete(colocated, model, prompt)[1]["choices"][0]["token_ids"]
    store.stop()
    cluster["store"] = start_store(port=store.port)
    for inst in (prefill, decode, wide_decode):
        assert wait_until(lambda: inst.metrics().get("kv_store_connected") == 1
                          and inst.metrics().get("kv_store_shared_memory") == 1, timeout=30), inst.name
    before = decode.metrics().get("kv_store_loaded_blocks_total", 0)
    prompt = [(17 * i + 3) % 250 + 1 for i in range(70)]
    status, got = complete(proxy, model, prompt)
    assert status == 200 and got["choices"][0]["token_ids"] == \
        complete(colocated, model, prompt)[1]["choices"][0]["token_ids"]
    assert decode.metrics()["kv_store_loaded_blocks_total"] - before >= 4   # the new pool, loaded again
