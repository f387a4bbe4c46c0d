"""A real 2P2D cluster plus a colocated instance behind the router (cost policy, conditional PD): identical
greedy output, the direct path for short prompts and follow-up turns, ejection and re-admission of a
frozen instance and of a killed one restarted, 503s under overload with nothing left held, and the router's view of it all."""
from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.cluster import ROUTER_KEY, Process, serve, wait_until

KV = '{"lease_seconds": 4, "heartbeat_seconds": 1}'
PD_MIN_PROMPT_TOKENS = 24
CHATS = ["What is the capital of France? Answer in one word and then explain the history of the city "
         "in a few sentences, mentioning its river and two famous buildings.",
         "Write a haiku about autumn leaves falling on a quiet lake at dusk, then explain its imagery.",
         "Explain in two sentences how TCP differs from UDP, and when you would choose each of them."]


@pytest.fixture(scope="module")
def cluster():
    started: list[Process] = []
    try:
        pools = {"prefill": [], "decode": []}
        for role, kv_role in (("prefill", "producer"), ("decode", "consumer")):
            for i in range(2):
                inst = serve(f"router-{role}-{i}", "--kv-connector", "nixl", "--kv-role", kv_role,
                             "--engine-id", f"router-{role}-{i}", "--kv-transfer-config", KV)
                pools[role].append(inst)
                started.append(inst)
        colocated = serve("router-colocated")
        started.append(colocated)
        for inst in started:
            inst.wait_healthy()
        router = Process(["proxy", "--model", "default", "--policy", "cost",
                          "--pd-min-prompt-tokens", str(PD_MIN_PROMPT_TOKENS), "--poll-interval", "0.1",
                          "--prefill", *(p.url for p in pools["prefill"]),
                          "--decode", *(d.url for d in pools["decode"])], "router",
                         env={"PDSERVE_ROUTER_KEY": ROUTER_KEY})
        started.append(router)
        router.wait_healthy(120)
        yield {**pools, "colocated": colocated, "router": router}
    finally:   # (a test may have restarted an instance: the pools hold the new process)
        for p in reversed(started + [p for pool in pools.values() for p in pool if p not in started]):
            p.stop()


def chat(server: Process, messages: list[dict], max_tokens: int = 16) -> dict:
    status, body = server.post("/v1/chat/completions", {"model": "default", "messages": messages,
                                                        "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    return body


def cluster_view(router: Process) -> dict:
    with urllib.request.urlopen(router.url + "/cluster", timeout=10) as resp:
        return json.loads(resp.read())


def load(inst: Process) -> dict:
    req = urllib.request.Request(inst.url + "/v1/load", headers={"X-PDServe-Router-Key": ROUTER_KEY})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def is_idle(inst: Process) -> bool:
    report = load(inst)
    return (report["num_requests_running"], report["num_requests_waiting"],
            report["num_requests_waiting_for_remote_kvs"], report["num_blocks_held_for_transfer"]) == (0, 0, 0, 0)


def test_routed_output_identical_to_colocated_on_every_path(cluster):
    """Long prompts disaggregated, short ones and follow-up turns straight to a D: greedy output equals the
    colocated instance's on each path."""
    router, colocated = cluster["router"], cluster["colocated"]
    before = cluster_view(router)["decisions"]
    for question in CHATS:
        turn1 = [{"role": "user", "content": question}]
        answer = chat(router, turn1)["choices"][0]["message"]["content"]
        assert answer == chat(colocated, turn1)["choices"][0]["message"]["content"]
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Shorter."}]
        assert chat(router, turn2)["choices"][0]["message"]["content"] == \
            chat(colocated, turn2)["choices"][0]["message"]["content"]
    short = {"model": "default", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    assert router.post("/v1/completions", short)[1]["choices"][0]["text"] == \
        colocated.post("/v1/completions", short)[1]["choices"][0]["text"]
    after = cluster_view(router)["decisions"]
    gained = {reason: after[reason] - before.get(reason, 0) for reason in after}
    assert gained["disaggregated"] >= 1, gained           # a first turn is long
    assert gained["short_prompt"] >= 1, gained            # six tokens
    assert gained["decode_has_prefix"] >= 1, gained       # a follow-up found its history on a D


def test_the_router_sees_each_instances_cache_and_load(cluster):
    router = cluster["router"]
    chat(router, [{"role": "user", "content": CHATS[0]}])
    view = wait_until(lambda: (v := cluster_view(router)) and
                      sum(i["cached_blocks"] for i in v["instances"]) > 0 and v, timeout=10)
    assert view, "no instance reported a cached block"
    by_name = {inst["name"]: inst for inst in view["instances"]}
    assert set(by_name) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert all(inst["state"] == "healthy" for inst in by_name.values())
    assert view["policy"] == "cost" and "127.0.0.1" not in json.dumps(view)


def test_a_frozen_decode_is_ejected_then_readmitted(cluster):
    router, frozen = cluster["router"], cluster["decode"][1]
    frozen.signal(signal.SIGSTOP)
    try:
        ejected = wait_until(lambda: {i["name"]: i["state"] for i in cluster_view(router)["instances"]}
                             ["decode-1"] == "ejected", timeout=30)
        assert ejected
        for question in CHATS:   # every request on the live D meanwhile
            assert chat(router, [{"role": "user", "content": question + " Be brief."}])["choices"]
    finally:
        frozen.signal(signal.SIGCONT)
    assert wait_until(lambda: {i["name"]: i["state"] for i in cluster_view(router)["instances"]}
                      ["decode-1"] == "healthy", timeout=30)
    assert router.metrics().get("proxy_requests_total", 0) > 0


def test_a_killed_decode_is_ejected_then_readmitted_once_restarted(cluster):
    """SIGKILL, not a freeze: connections to it are refused, requests go to the live D, and the same
    instance started again on its port is seen as a restart (its cache forgotten) and routed to again."""
    router, killed = cluster["router"], cluster["decode"][1]

    def state() -> dict:
        return {i["name"]: i for i in cluster_view(router)["instances"]}["decode-1"]
    restarts = state()["restarts"]
    killed.signal(signal.SIGKILL)
    try:
        assert wait_until(lambda: state()["state"] == "ejected", timeout=30)
        for question in CHATS:
            assert chat(router, [{"role": "user", "content": question + " Be short."}])["choices"]
    finally:
        cluster["decode"][1] = killed.restart().wait_healthy()
    assert wait_until(lambda: state()["state"] == "healthy" and state()["restarts"] > restarts, timeout=60)
    assert state()["ejections"] >= 1
    assert chat(router, [{"role": "user", "content": CHATS[0]}])["choices"]


def test_overload_gets_503_with_retry_after_and_leaves_nothing_held(cluster):
    """A second router in front of the same instances, capped at one request per instance and no queue:
    a burst gets 200s and 503s with Retry-After, nothing else, and every instance ends idle."""
    pools = cluster["prefill"] + cluster["decode"]
    tight = Process(["proxy", "--model", "default", "--policy", "least-load", "--max-per-instance", "1",
                     "--max-queued", "0", "--prefill", *(p.url for p in cluster["prefill"]),
                     "--decode", *(d.url for d in cluster["decode"])], "router-tight",
                    env={"PDSERVE_ROUTER_KEY": ROUTER_KEY})
    try:
        tight.wait_healthy(120)

        def ask(i: int) -> tuple[int, str | None]:
            req = urllib.request.Request(tight.url + "/v1/completions", data=json.dumps(
                {"model": "default", "prompt": CHATS[i % len(CHATS)], "max_tokens": 24,
                 "temperature": 0}).encode(), headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    return resp.status, None
            except urllib.error.HTTPError as e:
                return e.code, e.headers.get("Retry-After")

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, range(12)))
        statuses = [status for status, _ in answers]
        assert set(statuses) <= {200, 503} and statuses.count(200) >= 2 and statuses.count(503) >= 1
        assert all(retry_after for status, retry_after in answers if status == 503)
        assert wait_until(lambda: all(is_idle(inst) for inst in pools), timeout=20)
    finally:
        tight.stop()

