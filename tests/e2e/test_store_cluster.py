"""A real 1P1D cluster with the store handoff (`--kv-connector store`: P inserts into a `pdserve kv-store`
pool, D looks the prompt up and READs it, NIXL over DRAM) behind the router, against a colocated instance:
identical greedy output, KV D really loaded from the store, a conversation's history reused by another
instance, and a store that dies and comes back costing recomputes, never an error."""
from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.cluster import ROUTER_KEY, Process, serve, wait_until
from tests.e2e.test_pd_cluster import CHATS, _listening, complete, token_prompt
from tests.e2e.test_push_cluster import _idle

STORE_LENGTHS = [1, 17, 100, 600]
BLOCK = 16


def start_store(port: int | None = None) -> Process:
    store = Process(["kv-store", "--capacity", "256MiB"], "kv-store", env={"PDSERVE_ROUTER_KEY": ROUTER_KEY},
                    port=port)
    assert wait_until(lambda: _listening(store.port), timeout=60), f"the store never listened; see {store.log.name}"
    return store


def store_instance(name: str, role: str, store: Process) -> Process:
    return serve(name, "--kv-connector", "store", "--kv-role", role, "--kv-store", f"127.0.0.1:{store.port}",
                 "--engine-id", f"store-{name}")


@pytest.fixture(scope="module")
def cluster():
    nodes: dict[str, Process] = {}
    try:
        nodes["store"] = start_store()
        nodes["prefill"] = store_instance("prefill", "producer", nodes["store"])
        nodes["decode"] = store_instance("decode", "consumer", nodes["store"])
        nodes["colocated"] = serve("colocated")
        for name in ("prefill", "decode", "colocated"):
            nodes[name].wait_healthy()
        for name in ("prefill", "decode"):   # the store handshake is asynchronous
            assert wait_until(lambda: nodes[name].metrics().get("kv_store_connected") == 1, timeout=30), name
        nodes["proxy"] = Process(["proxy", "--prefill", nodes["prefill"].url, "--decode", nodes["decode"].url],
                                 "store-proxy", env={"PDSERVE_ROUTER_KEY": ROUTER_KEY})
        nodes["proxy"].wait_healthy(60)
        yield nodes
    finally:
        for p in reversed(list(nodes.values())):
            p.stop()


def test_store_handoff_output_identical_to_colocated(cluster):
    proxy, colocated, decode = cluster["proxy"], cluster["colocated"], cluster["decode"]
    before = decode.metrics()
    with ThreadPoolExecutor(2) as pool:
        prompts = [token_prompt(n, seed=500 + n) for n in STORE_LENGTHS]
        got_all = pool.submit(lambda: [complete(proxy, prompt) for prompt in prompts])
        want_all = pool.submit(lambda: [complete(colocated, prompt) for prompt in prompts])
        for n, got, want in zip(STORE_LENGTHS, got_all.result(), want_all.result()):
            assert got["choices"][0]["text"] == want["choices"][0]["text"], n
            # P computed the prompt for this request (D then loaded its stored blocks): cached is P's prefix
            # hits, as colocated counts its own (it was the blocks D loaded; session 40)
            assert got["usage"]["prompt_tokens_details"] == want["usage"]["prompt_tokens_details"], n
        bodies = [{"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": 24,
                   "temperature": 0} for text in CHATS[2:4]]
        got_all = pool.submit(lambda: [proxy.post("/v1/chat/completions", body) for body in bodies])
        want_all = pool.submit(lambda: [colocated.post("/v1/chat/completions", body) for body in bodies])
        for (s1, got), (s2, want) in zip(got_all.result(), want_all.result()):
            assert s1 == s2 == 200
            assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    after = decode.metrics()
    expected_blocks = sum(n // BLOCK for n in STORE_LENGTHS)
    assert after["kv_store_loaded_blocks_total"] - before.get("kv_store_loaded_blocks_total", 0) >= expected_blocks
    assert after["kv_transfer_failures_total"] == before.get("kv_transfer_failures_total", 0)
    # Both on the store's host: they map its pool and copy, not NIXL (--no-shared-memory: the unit tests)
    assert after["kv_store_shared_memory"] == cluster["prefill"].metrics()["kv_store_shared_memory"] == 1
    assert wait_until(lambda: _idle(cluster["prefill"]) and _idle(decode), timeout=10)


def test_a_conversation_continues_on_another_instance_with_its_history_from_the_store(cluster):
    """Turn 1 on P (which stores every prompt it computes), turn 2 on D: D has never seen the
    conversation, and loads turn 1's prompt from the store instead of computing it."""
    prefill, decode, colocated = cluster["prefill"], cluster["decode"], cluster["colocated"]
    history = [{"role": "system", "content": "You are a terse assistant. " * 12},
               {"role": "user", "content": "Name a prime number between 10 and 20."}]
    turn1 = {"model": "default", "messages": history, "max_tokens": 16, "temperature": 0}
    status, first = prefill.post("/v1/chat/completions", turn1, as_router=False)
    assert status == 200
    num_turn1 = first["usage"]["prompt_tokens"]
    assert wait_until(lambda: _idle(prefill), timeout=10)   # its insert has landed
    history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And one between 20 and 30?"}]
    turn2 = {"model": "default", "messages": history, "max_tokens": 16, "temperature": 0}
    status, got = decode.post("/v1/chat/completions", turn2, as_router=False)
    assert status == 200
    status, want = colocated.post("/v1/chat/completions", turn2, as_router=False)
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= num_turn1 // BLOCK * BLOCK - BLOCK
    assert wait_until(lambda: _idle(decode), timeout=10)


def test_a_store_that_dies_costs_recomputes_and_is_used_again_once_back(cluster):
    proxy, colocated, decode, store = cluster["proxy"], cluster["colocated"], cluster["decode"], cluster["store"]
    store.signal(signal.SIGKILL)
    # Idle instances notice too, and let the dead store's pool go (before, they mapped it and reported
    # themselves connected until a request came).
    for name in ("prefill", "decode"):
        assert wait_until(lambda: cluster[name].metrics().get("kv_store_shared_memory") == 0
                          and cluster[name].metrics().get("kv_store_connected") == 0, timeout=10), name
    prompt = token_prompt(200, seed=901)
    got = complete(proxy, prompt)
    assert got["choices"][0]["text"] == complete(colocated, prompt)["choices"][0]["text"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0   # D computed it all
    store.stop()
    cluster["store"] = start_store(port=store.port)
    # The instances find the new boot (their next exchange is refused or fails, then they handshake again).
    prompt = token_prompt(300, seed=902)

    def reused() -> bool:
        answer = complete(proxy, prompt)
        assert answer["choices"][0]["text"] == want
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    want = complete(colocated, prompt)["choices"][0]["text"]
    assert wait_until(reused, timeout=60, interval=1.0)
    assert wait_until(lambda: _idle(cluster["prefill"]) and _idle(decode), timeout=10)
