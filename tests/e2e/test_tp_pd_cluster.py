"""P/D between tensor-parallel instances (NIXL over DRAM): a P and a D of 2 ranks each behind the proxy,
on a tiny llama (2 KV heads, one per rank), against a colocated instance of one rank: the same tokens, KV
that really moved from every rank, nothing held afterwards; a D of another size refused at the handshake,
naming both; a P rank killed: P's engine breaks, and the router serves the request on the D alone."""
from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.cluster import ROUTER_KEY, Process, wait_until
from tests.helpers_models import make_tiny_hf_model

KV = '{"lease_seconds": 4, "heartbeat_seconds": 1}'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_hf_model(tmp_path_factory.mktemp("tp_pd"), "llama")
    common = ["--model", model, "--kv-cache-memory", str(16 << 20), "--num-threads", "1"]
    env = {"PDSERVE_ROUTER_KEY": ROUTER_KEY}
    started: list[Process] = []

    def serve(name, *args):
        proc = Process(["serve", *common, *args], name, env=env)
        started.append(proc)
        return proc

    try:
        prefill = serve("tp-prefill", "-tp", "2", "--kv-connector", "nixl", "--kv-role", "producer",
                        "--engine-id", "tp-prefill", "--kv-transfer-config", KV)
        decode = serve("tp-decode", "-tp", "2", "--kv-connector", "nixl", "--kv-role", "consumer",
                       "--engine-id", "tp-decode", "--kv-transfer-config", KV)
        narrow = serve("tp1-decode", "--kv-connector", "nixl", "--kv-role", "consumer",
                       "--engine-id", "tp1-decode", "--kv-transfer-config", KV)
        colocated = serve("tp1-colocated")
        for p in started:
            p.wait_healthy()
        proxies = [Process(["proxy", "--prefill", prefill.url, "--decode", d.url], name, env=env)
                   for name, d in (("tp-proxy", decode), ("tp-mixed-proxy", narrow))]
        started += proxies
        for p in proxies:
            p.wait_healthy(60)
        yield {"prefill": prefill, "decode": decode, "colocated": colocated, "proxy": proxies[0],
               "mixed_proxy": proxies[1], "model": model}
    finally:
        for p in reversed(started):
            p.stop()


def complete(server: Process, model: str, prompt, **extra) -> tuple[int, dict]:
    return server.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                           "ignore_eos": True, "return_token_ids": True, **extra})


def test_two_rank_prefill_and_decode_answer_as_one_colocated_rank(cluster):
    proxy, colocated, decode, model = cluster["proxy"], cluster["colocated"], cluster["decode"], cluster["model"]
    before = decode.metrics().get("kv_transfer_bytes_total", 0)
    for n in (1, 15, 16, 17, 33, 100):
        prompt = [(7 * i + n) % 250 + 1 for i in range(n)]
        for extra in ({}, {"temperature": 0.9, "seed": n}):
            status, got = complete(proxy, model, prompt, **extra)
            assert status == 200, got
            status, want = complete(colocated, model, prompt, **extra)
            assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"], (n, extra)
            if n > 16 and not extra:   # the whole prompt's blocks but the last token came from P
                assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello there, how are you?"}],
            "max_tokens": 10, "temperature": 0}
    assert proxy.post("/v1/chat/completions", chat)[1]["choices"] == colocated.post("/v1/chat/completions",
                                                                                     chat)[1]["choices"]
    # both ranks' KV moved: at least the 100-token prompt's 6 full blocks of 2 layers x K,V x 16 slots x 1 head
    # x 16 dims x 4 bytes, on each of the 2 ranks
    assert decode.metrics()["kv_transfer_bytes_total"] - before >= 2 * 6 * (2 * 2 * 16 * 16 * 4)
    assert wait_until(lambda: all(p.metrics().get("kv_cache_usage_perc") == 0
                                  and p.metrics().get("num_blocks_held_for_transfer", 0) == 0
                                  for p in (cluster["prefill"], decode)), timeout=15)


def test_a_decode_of_another_size_is_refused_at_the_handshake_naming_both(cluster):
    status, body = complete(cluster["mixed_proxy"], cluster["model"], list(range(1, 40)))
    assert status >= 500
    assert "tp_size local=1 remote=2" in body["error"]["message"]
    assert wait_until(lambda: cluster["prefill"].metrics().get("num_blocks_held_for_transfer", 0) == 0, timeout=15)


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

