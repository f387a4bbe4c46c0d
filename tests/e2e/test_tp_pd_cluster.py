"""P/D between tensor-parallel instances (NIXL over DRAM), on a tiny llama (2 KV heads): P and D of 2 ranks
each, and the mixed pairs (P of 2 to D of 1, P of 1 to D of 2: D's ranks regroup the heads through their
staging pools, in rounds: see KV), behind the proxy, against a colocated instance of one rank: the same
tokens, KV that really moved from every rank, nothing held afterwards; a P rank killed: P's engine breaks,
and the router serves the request on the D alone."""
from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.cluster import ROUTER_KEY, Process, wait_until
from tests.helpers_models import make_tiny_hf_model

# staging_bytes: two blocks' staging (8 KiB a block of this model, whichever side regroups), so that the
# mixed pairs' transfers of more than two blocks move in rounds through every rank's pool
KV = '{"lease_seconds": 4, "heartbeat_seconds": 1, "staging_bytes": 16384}'
ENV = {"PDSERVE_ROUTER_KEY": ROUTER_KEY}


def tiny_llama_servers(tmp_path_factory, name: str):
    """(model path, serve(name, *args) starting a `pdserve serve` of it, the processes started so far)."""
    model = make_tiny_hf_model(tmp_path_factory.mktemp(name), "llama")
    common = ["--model", model, "--kv-cache-memory", str(16 << 20), "--num-threads", "1"]
    started: list[Process] = []

    def serve(name, *args):
        proc = Process(["serve", *common, *args], name, env=ENV)
        started.append(proc)
        return proc
    return model, serve, started


def pair_proxies(pairs: dict, name: str, started: list) -> dict:
    """A healthy `pdserve proxy` in front of each (P, D) pair, by the pair's name."""
    proxies = {pair: Process(["proxy", "--prefill", p.url, "--decode", d.url], f"{name}-{pair}", env=ENV)
               for pair, (p, d) in pairs.items()}
    started += proxies.values()
    for proxy in proxies.values():
        proxy.wait_healthy(60)
    return proxies


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model, serve, started = tiny_llama_servers(tmp_path_factory, "tp_pd")
    try:
        prefill = serve("tp-prefill", "-tp", "2", "--kv-connector", "nixl", "--kv-role", "producer",
                        "--engine-id", "tp-prefill", "--kv-transfer-config", KV)
        decode = serve("tp-decode", "-tp", "2", "--kv-connector", "nixl", "--kv-role", "consumer",
                       "--engine-id", "tp-decode", "--kv-transfer-config", KV)
        narrow_decode = serve("tp1-decode", "--kv-connector", "nixl", "--kv-role", "consumer",
                              "--engine-id", "tp1-decode", "--kv-transfer-config", KV)
        narrow_prefill = serve("tp1-prefill", "--kv-connector", "nixl", "--kv-role", "producer",
                               "--engine-id", "tp1-prefill", "--kv-transfer-config", KV)
        colocated = serve("tp1-colocated")
        for p in started:
            p.wait_healthy()
        pairs = {"2-2": (prefill, decode), "2-1": (prefill, narrow_decode), "1-2": (narrow_prefill, decode)}
        proxies = pair_proxies(pairs, "tp-proxy", started)
        yield {"prefill": prefill, "decode": decode, "colocated": colocated, "proxies": proxies, "pairs": pairs,
               "proxy": proxies["2-2"], "model": model}
    finally:
        for p in reversed(started):
            p.stop()


def complete(server: Process, model: str, prompt, **extra) -> tuple[int, dict]:
    return server.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                           "ignore_eos": True, "return_token_ids": True, **extra})


@pytest.mark.parametrize("pair", ["2-2", "2-1", "1-2"])
def test_prefill_and_decode_of_two_and_one_ranks_answer_as_one_colocated_rank(cluster, pair):
    proxy, colocated, model = cluster["proxies"][pair], cluster["colocated"], cluster["model"]
    prefill, decode = cluster["pairs"][pair]
    before = decode.metrics().get("kv_transfer_bytes_total", 0)
    for n in (1, 15, 16, 17, 33, 100):
        prompt = [(7 * i + n + 3 * len(pair) * ord(pair[0])) % 250 + 1 for i in range(n)]   # new to every D
        for extra in ({}, {"temperature": 0.9, "seed": n}):
            status, got = complete(proxy, model, prompt, **extra)
            assert status == 200, got
            status, want = complete(colocated, model, prompt, **extra)
            assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"], (n, extra)
            # cached: P's prefix hits, as colocated counts its own (it was n, the KV from P; session 40)
            assert got["usage"]["prompt_tokens_details"] == want["usage"]["prompt_tokens_details"], (pair, n)
    chat = {"model": model, "messages": [{"role": "user", "content": f"Hello there ({pair}), how are you?"}],
            "max_tokens": 10, "temperature": 0}
    assert proxy.post("/v1/chat/completions", chat)[1]["choices"] == colocated.post("/v1/chat/completions",
                                                                                     chat)[1]["choices"]
    # all the KV moved: at least the 100-token prompt's 6 full blocks of 2 layers x K,V x 16 slots x 2 heads
    # x 16 dims x 4 bytes (over the ranks)
    assert decode.metrics()["kv_transfer_bytes_total"] - before >= 6 * (2 * 2 * 16 * 2 * 16 * 4)
    # P freed every block once D was done (a NIXL notification per rank, or D's "done"), no lease ran out
    assert wait_until(lambda: all(p.metrics().get("kv_cache_usage_perc") == 0
                                  and p.metrics().get("num_blocks_held_for_transfer", 0) == 0
                                  for p in (prefill, decode)), timeout=15)
    assert prefill.metrics().get("kv_lease_expirations_total", 0) == 0


def test_a_killed_prefill_rank_breaks_p_and_the_router_serves_on_without_it(cluster):
    prefill, decode, model = cluster["prefill"], cluster["decode"], cluster["model"]
    ranks = [p for p in prefill.pids() if "pdserve.worker.tp_executor" in open(f"/proc/{p}/cmdline").read()]
    assert len(ranks) == 1
    os.kill(ranks[0], signal.SIGKILL)
    # P's step fails (its engine is broken: a 500 naming no internals) and the router routes the request
    # again without it: the decode instance prefills it itself, with the colocated tokens
    prompt = list(range(1, 40))
    status, body = complete(cluster["proxy"], model, prompt)
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == complete(cluster["colocated"], model, prompt)[1]["choices"][0]["token_ids"]
    assert wait_until(lambda: prefill.proc.poll() is not None or prefill.health() != 200, timeout=30)
    assert wait_until(lambda: decode.metrics().get("kv_cache_usage_perc") == 0, timeout=15)

