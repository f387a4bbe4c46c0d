"""A real 1P1D cluster (NIXL over DRAM) behind the proxy against a colocated instance: identical
greedy output, KV that really moved, nothing left held, leases, failures, disconnects."""
from __future__ import annotations

import json
import random
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.cluster import ROUTER_KEY, Process, serve, wait_until

BLOCK = 16
KV = '{"lease_seconds": 4, "heartbeat_seconds": 1}'


@pytest.fixture(scope="module")
def cluster():
    started: list[Process] = []
    try:
        prefill = serve("prefill", "--kv-connector", "nixl", "--kv-role", "producer",
                        "--engine-id", "test-prefill", "--kv-transfer-config", KV)
        decode = serve("decode", "--kv-connector", "nixl", "--kv-role", "consumer",
                       "--engine-id", "test-decode", "--kv-transfer-config", KV)
        colocated = serve("colocated")
        started += [prefill, decode, colocated]
        for p in started:
            p.wait_healthy()
        proxy = Process(["proxy", "--prefill", prefill.url, "--decode", decode.url], "proxy",
                        env={"PDSERVE_ROUTER_KEY": ROUTER_KEY})
        started.append(proxy)
        proxy.wait_healthy(60)
        yield {"prefill": prefill, "decode": decode, "colocated": colocated, "proxy": proxy}
    finally:
        for p in reversed(started):
            p.stop()


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


def complete(server: Process, prompt, max_tokens=12, **extra) -> dict:
    status, body = server.post("/v1/completions", {"model": "default", "prompt": prompt,
                                                   "max_tokens": max_tokens, "temperature": 0, **extra})
    assert status == 200, body
    return body


PROMPT_LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 48, 64, 100, 127, 128, 1100]
CHATS = ["What is the capital of France?", "Write a haiku about autumn.",
         "Explain TCP in one sentence.", "Name three colours.", "What is 2 + 2?", "Say hello in French."]


def test_disaggregated_output_identical_to_colocated(cluster):
    proxy, colocated, decode = cluster["proxy"], cluster["colocated"], cluster["decode"]
    before = decode.metrics()
    # One request at a time on each side, the two sides at once (their instances share the machine's
    # cores, so this halves the wall time without batching any request with another).
    with ThreadPoolExecutor(2) as pool:
        prompts = [token_prompt(n, seed=n) for n in PROMPT_LENGTHS]
        got_all = pool.submit(lambda: [complete(proxy, prompt) for prompt in prompts])
        want_all = pool.submit(lambda: [complete(colocated, prompt) for prompt in prompts])
        for n, got, want in zip(PROMPT_LENGTHS, got_all.result(), want_all.result()):
            assert got["choices"][0]["text"] == want["choices"][0]["text"], n
            assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
            assert got["usage"]["prompt_tokens"] == n
            # cached: P's prefix hits, as colocated counts its own; not the KV D read (it was n, session 40)
            assert got["usage"]["prompt_tokens_details"] == want["usage"]["prompt_tokens_details"], n
        bodies = [{"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": 24,
                   "temperature": 0} for text in CHATS]
        got_all = pool.submit(lambda: [proxy.post("/v1/chat/completions", body) for body in bodies])
        want_all = pool.submit(lambda: [colocated.post("/v1/chat/completions", body) for body in bodies])
        for (s1, got), (s2, want) in zip(got_all.result(), want_all.result()):
            assert s1 == s2 == 200
            assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    # The KV moved over NIXL: one transfer per request, coalesced into few descriptors. (/metrics shows
    # the engine's stats snapshot, sent at most every 100 ms: it may lag the last answer.)
    num_requests = len(PROMPT_LENGTHS) + len(CHATS)
    count = lambda: decode.metrics()["kv_transfer_seconds_count"] - before.get("kv_transfer_seconds_count", 0)  # noqa: E731
    assert wait_until(lambda: count() == num_requests, timeout=5), count()
    after = decode.metrics()
    assert after["kv_transfer_bytes_total"] > before.get("kv_transfer_bytes_total", 0)
    descriptors = after["kv_transfer_descriptors_total"] - before.get("kv_transfer_descriptors_total", 0)
    assert num_requests <= descriptors <= 3 * num_requests


def test_seeded_sampling_disaggregated_identical_to_colocated(cluster):
    """P samples the first token, D the rest: D's generator must skip P's draw, as a colocated one moves on."""
    proxy, colocated = cluster["proxy"], cluster["colocated"]
    for n, seed in ((5, 1), (40, 2), (130, 3)):
        prompt = token_prompt(n, seed=n)
        extra = {"temperature": 0.9, "top_p": 0.95, "seed": seed}
        got, want = complete(proxy, prompt, max_tokens=16, **extra), complete(colocated, prompt, max_tokens=16, **extra)
        assert got["choices"][0]["text"] == want["choices"][0]["text"], n


def test_a_first_token_outside_the_vocabulary_is_a_400_and_d_survives(cluster):
    decode = cluster["decode"]
    params = {"do_remote_prefill": True, "remote_engine_id": "test-prefill", "remote_request_id": "r",
              "remote_host": "127.0.0.1", "remote_port": 1, "remote_block_ids": [0], "first_token_ids": [10 ** 9]}
    status, body = decode.post("/v1/completions", {"model": "default", "prompt": [5000, 5001], "max_tokens": 4,
                                                   "kv_transfer_params": params})
    assert status == 400 and "first_token_ids" in body["error"]["message"], body
    assert complete(decode, [5000, 5001], max_tokens=2)["usage"]["completion_tokens"] == 2


def test_prefix_cached_on_decode_loads_only_the_rest(cluster):
    proxy, colocated, decode = cluster["proxy"], cluster["colocated"], cluster["decode"]
    prefix = token_prompt(64, seed=999)
    complete(decode, prefix + [5000], max_tokens=1)  # warms D's prefix cache (64 tokens = 4 blocks)
    prompt = prefix + token_prompt(40, seed=1000)
    before = decode.metrics()
    got = complete(proxy, prompt)
    assert got["choices"][0]["text"] == complete(colocated, prompt)["choices"][0]["text"]
    loaded = lambda: decode.metrics()["kv_transfer_bytes_total"] - before["kv_transfer_bytes_total"]  # noqa: E731
    block_bytes = 30 * 2 * BLOCK * 3 * 64 * 4  # default model, float32
    # blocks 4..6 of 7; blocks 0..3 came from D's own cache (the stats snapshot may lag: wait for it)
    assert wait_until(lambda: loaded() == 3 * block_bytes, timeout=5), loaded()


def test_sixteen_concurrent_requests_identical(cluster):
    proxy, colocated = cluster["proxy"], cluster["colocated"]
    prompts = [token_prompt(8 + 37 * i, seed=100 + i) for i in range(16)]
    with ThreadPoolExecutor(17) as pool:   # the reference one at a time, beside the 16 at once
        want = pool.submit(lambda: [complete(colocated, p, max_tokens=10)["choices"][0]["text"] for p in prompts])
        got = list(pool.map(lambda p: complete(proxy, p, max_tokens=10)["choices"][0]["text"], prompts))
    assert got == want.result()


def test_streaming_through_the_proxy(cluster):
    import openai
    client = openai.OpenAI(base_url=f"{cluster['proxy'].url}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Count to five."}], max_tokens=20,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 20 or chunks[-2].choices[0].finish_reason == "stop"
    want = cluster["colocated"].post("/v1/chat/completions", {
        "model": "default", "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": 20, "temperature": 0})[1]["choices"][0]["message"]["content"]
    assert text == want


def _idle(server: Process) -> bool:
    m = server.metrics()
    return (m.get("kv_cache_usage_perc") == 0 and m.get("num_blocks_held_for_transfer") == 0
            and m.get("num_requests_running") == 0 and m.get("num_requests_waiting_for_remote_kvs") == 0)


def test_everything_returns_to_idle(cluster):
    assert wait_until(lambda: _idle(cluster["prefill"]) and _idle(cluster["decode"]), timeout=10)
    assert cluster["prefill"].metrics()["kv_lease_expirations_total"] == 0


def test_lease_expiry_frees_blocks_when_no_decode_reads(cluster):
    prefill = cluster["prefill"]
    before = prefill.metrics()["kv_lease_expirations_total"]
    body = complete(prefill, token_prompt(50, seed=7), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = body["kv_transfer_params"]
    assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == 4
    assert wait_until(lambda: prefill.metrics()["num_blocks_held_for_transfer"] == 4, timeout=2)
    # No D ever reads (as if D died first): the 4 s lease runs out and P frees the blocks.
    assert wait_until(lambda: prefill.metrics()["num_blocks_held_for_transfer"] == 0, timeout=10)
    assert prefill.metrics()["kv_lease_expirations_total"] == before + 1
    assert wait_until(lambda: _idle(prefill), timeout=5)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def test_release_frees_p_blocks_before_the_lease_runs_out(cluster):
    """The proxy's decode hop fails (here: no D listening), so the proxy tells P to release; P frees
    the blocks at once instead of holding them for its lease (4 s here, 30 s by default)."""
    prefill = cluster["prefill"]
    before = prefill.metrics()["kv_lease_expirations_total"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    # --startup-timeout 0 and a high --eject-after: the router starts without D and keeps choosing it,
    # so that a request really meets the dead D after its prefill (a router ejects a dead D at once).
    proxy = Process(["proxy", "--prefill", prefill.url, "--decode", dead, "--startup-timeout", "0",
                     "--eject-after", "1000000"], "proxy-dead-decode",
                    env={"PDSERVE_ROUTER_KEY": ROUTER_KEY})
    try:
        assert wait_until(lambda: _listening(proxy.port), timeout=60)  # /health is 503: its D is down
        status, body = proxy.post("/v1/completions", {"model": "default", "prompt": token_prompt(50, 11),
                                                      "max_tokens": 5, "temperature": 0})
        assert status == 502 and body["error"]["message"] == "the decode-0 instance is unreachable", body
        assert wait_until(lambda: prefill.metrics()["num_blocks_held_for_transfer"] == 0, timeout=1.5)
        assert wait_until(lambda: _idle(prefill), timeout=2)
        assert prefill.metrics()["kv_lease_expirations_total"] == before
    finally:
        proxy.stop()

    # The endpoint itself: another engine's blocks, or no params, are refused.
    status, _ = prefill.post("/v1/kv/release", {"kv_transfer_params": {"remote_engine_id": "other",
                                                                      "remote_request_id": "x"}})
    assert status == 404
    status, _ = prefill.post("/v1/kv/release", {"nothing": 1})
    assert status == 400
    params = complete(prefill, token_prompt(20, 5), max_tokens=1,
                      kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    status, body = prefill.post("/v1/kv/release", {"kv_transfer_params": dict(params, remote_port="not a port")})
    assert status == 400 and "remote_port" in body["error"]["message"]
    prefill.wait_healthy(5)  # a malformed release once killed the engine loop
    assert prefill.post("/v1/kv/release", {"kv_transfer_params": params})[0] == 202
    assert wait_until(lambda: _idle(prefill), timeout=2)
    assert prefill.metrics()["kv_lease_expirations_total"] == before


def test_disconnect_while_waiting_for_kv_frees_everything(cluster):
    """A "P" whose side channel accepts and never answers keeps the request in
    WAITING_FOR_REMOTE_KVS; the client then goes away."""
    decode = cluster["decode"]
    black_hole = socket.socket()
    black_hole.bind(("127.0.0.1", 0))
    black_hole.listen(8)
    accepted = []
    threading.Thread(target=lambda: accepted.append(black_hole.accept()), daemon=True).start()
    params = {"do_remote_prefill": True, "remote_engine_id": "silent-prefill", "remote_request_id": "x",
              "remote_block_ids": [0, 1, 2], "remote_host": "127.0.0.1",
              "remote_port": black_hole.getsockname()[1], "num_remote_tokens": 40}
    body = json.dumps({"model": "default", "prompt": token_prompt(40, seed=3), "max_tokens": 5,
                       "stream": True, "kv_transfer_params": params}).encode()
    conn = socket.create_connection(("127.0.0.1", decode.port))
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"X-PDServe-Router-Key: %s\r\nContent-Length: %d\r\n\r\n%s"
                 % (ROUTER_KEY.encode(), len(body), body))
    assert wait_until(lambda: decode.metrics()["num_requests_waiting_for_remote_kvs"] == 1, timeout=5)
    assert decode.metrics()["kv_cache_usage_perc"] > 0
    conn.close()
    assert wait_until(lambda: _idle(decode), timeout=10)
    black_hole.close()


def test_injected_read_failure_fail_policy_gives_clean_error(cluster):
    failing = serve("decode-fail", "--kv-connector", "nixl", "--kv-role", "consumer",
                    "--kv-transfer-config", '{"inject_read_failure": "all", "kv_load_failure_policy": "fail"}')
    proxy = None
    try:
        failing.wait_healthy()
        proxy = Process(["proxy", "--prefill", cluster["prefill"].url, "--decode", failing.url], "proxy-fail",
                        env={"PDSERVE_ROUTER_KEY": ROUTER_KEY})
        proxy.wait_healthy(60)
        status, body = proxy.post("/v1/completions", {"model": "default", "prompt": token_prompt(40, 1),
                                                      "max_tokens": 5, "temperature": 0})
        assert status == 502 and "KV load" in body["error"]["message"] and "failed" in body["error"]["message"], body
        # /metrics shows the engine's stats snapshot, sent at most every 100 ms: it may lag the 502
        assert wait_until(lambda: failing.metrics()["kv_transfer_failures_total"] == 1, timeout=5)
        assert wait_until(lambda: _idle(failing) and _idle(cluster["prefill"]), timeout=10)
    finally:
        if proxy:
            proxy.stop()
        failing.stop()


def test_mismatched_block_size_is_refused_with_a_clear_message(cluster):
    mismatched = serve("decode-bs32", "--kv-connector", "nixl", "--kv-role", "consumer", "--block-size", "32")
    try:
        mismatched.wait_healthy()
        prompt = token_prompt(40, 2)
        params = complete(cluster["prefill"], prompt, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
        status, body = mismatched.post("/v1/completions", {"model": "default", "prompt": prompt,
                                                           "max_tokens": 5, "kv_transfer_params": params})
        message = body["error"]["message"]
        assert status == 500 and "block_size" in message and "32" in message and "16" in message, message
        assert wait_until(lambda: _idle(mismatched) and _idle(cluster["prefill"]), timeout=10)
    finally:
        mismatched.stop()
