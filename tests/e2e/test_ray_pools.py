"""pdserve's pools on a Ray cluster of two nodes on this machine (a head and a second node with its own
resources): 1P1D placed across the nodes answers token-identical to a colocated instance; an instance actor
killed is dropped by the router and replaced by the controller; pools resized under load fail no request;
stopping leaves no server behind."""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request

import pytest

ray = pytest.importorskip("ray")

from pdserve.cluster.autoscale import AutoscaleConfig  # noqa: E402
from pdserve.cluster.ray import CONTROLLER_NAME, NAMESPACE, Controller, PoolSpec, remote_class  # noqa: E402
from pdserve.router.policy import RouterConfig  # noqa: E402
from tests.e2e.cluster import INSTANCE_ARGS, free_port, serve, wait_until  # noqa: E402

pytestmark = pytest.mark.slow

CHATS = ["What is the capital of France? Answer in one word and then explain the history of the city.",
         "Write a haiku about autumn leaves falling on a quiet lake at dusk, then explain its imagery.",
         "Explain in two sentences how TCP differs from UDP, and when you would choose each of them."]
MAX_TOKENS = 16


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(url: str, text: str) -> tuple[int, dict]:
    return post(url, {"model": "default", "messages": [{"role": "user", "content": text}],
                      "max_tokens": MAX_TOKENS, "temperature": 0})


@pytest.fixture(scope="module")
def pools():
    from ray.cluster_utils import Cluster
    # Logical CPUs: two per node whatever the machine has; the instances each hold one.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 100},
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=2, resources={"node_b": 100})
    controller = None
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, logging_level="WARNING")
        cluster.wait_for_nodes()
        router_port = free_port()
        spec = PoolSpec(model="default", serve_args=INSTANCE_ARGS[:-2],   # less its drain: the spec's
                        role_args={}, kv_transfer_config='{"lease_seconds": 8, "heartbeat_seconds": 1}',
                        cpus_per_instance=1, extra_resources={"prefill": {"node_a": 1}, "decode": {"node_b": 1}},
                        instance_host="127.0.0.1", router_port=router_port, drain_timeout=2.0,
                        router_kwargs={"policy": "round-robin", "poll_interval": 0.1,
                                       "router_config": RouterConfig(pd_min_prompt_tokens=0)})
        spec.router_kwargs["router_key"] = spec.router_key
        controller = remote_class(ray, Controller).options(
            num_cpus=0, max_concurrency=8, name=CONTROLLER_NAME, namespace=NAMESPACE).remote(spec)
        url = ray.get(controller.start.remote(1, 1, 0), timeout=120)
        assert wait_until(lambda: ray.get(controller.ready.remote()), timeout=240), \
            ray.get(controller.status.remote())
        yield {"url": url, "controller": controller}
    finally:
        if controller is not None:
            ray.get(controller.stop.remote(), timeout=60)
        ray.shutdown()
        cluster.shutdown()


def status(pools) -> dict:
    return ray.get(pools["controller"].status.remote(), timeout=30)


def test_pd_across_two_nodes_answers_token_identical_to_colocated(pools):
    instances = {i["role"]: i for i in status(pools)["instances"]}
    assert instances["prefill"]["node"] != instances["decode"]["node"]   # placed on node_a and node_b
    colocated = serve("ray-colocated-reference").wait_healthy()
    try:
        for text in CHATS:
            code, pd = chat(pools["url"], text)
            assert code == 200, pd
            code, ref = chat(colocated.url, text)
            assert code == 200, ref
            assert pd["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    finally:
        colocated.stop()
    with urllib.request.urlopen(pools["url"] + "/cluster", timeout=10) as r:
        cluster = json.loads(r.read())
    assert cluster["decisions"]["disaggregated"] >= len(CHATS)


def stream_chat(url: str, text: str, max_tokens: int, events: list, started: threading.Event) -> None:
    """A streamed chat; every SSE data line into events, `started` set at the first one."""
    body = {"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip().decode())
                    started.set()
    except Exception as e:   # (the test asserts what the client saw)
        events.append(f"client error: {type(e).__name__}: {e}")
    finally:
        started.set()


def test_a_killed_instance_actor_is_dropped_and_replaced_and_its_stream_ends_cleanly(pools):
    before = {i["name"]: i for i in status(pools)["instances"]}
    decode = next(i for i in before.values() if i["role"] == "decode")
    prefill = next(i for i in before.values() if i["role"] == "prefill")
    events: list[str] = []
    started = threading.Event()
    streaming = threading.Thread(target=stream_chat, args=(pools["url"], CHATS[1], 400, events, started))
    streaming.start()
    assert started.wait(60) and events and not events[0].startswith("client error"), events
    ray.kill(ray.get_actor(f"pdserve-{decode['name']}", namespace=NAMESPACE), no_restart=True)
    # Its server dies with it (PR_SET_PDEATHSIG), the router stops sending to it, a new D takes its place.
    assert wait_until(lambda: not os.path.exists(f"/proc/{decode['pid']}"), timeout=15)
    # The stream in flight on it ends cleanly within the router's deadlines: no other D or colocated
    # instance to resume it on, so an error event and [DONE], never a hang or a cut connection.
    streaming.join(timeout=60)
    assert not streaming.is_alive(), "the stream did not end after its D was killed"
    assert events[-1] == "[DONE]", events[-3:]
    assert any('"error"' in e for e in events), events[-3:]
    # P holds nothing for it: D's "done", or its lease (8 s here) if D died mid-READ.
    def p_holds_nothing() -> bool:
        with urllib.request.urlopen(prefill["url"] + "/metrics", timeout=10) as r:
            return "pdserve:num_blocks_held_for_transfer 0.0" in r.read().decode()
    assert wait_until(p_holds_nothing, timeout=20)
    assert wait_until(lambda: ray.get(pools["controller"].ready.remote())
                      and decode["name"] not in {i["name"] for i in status(pools)["instances"]}, timeout=180)
    after = [i for i in status(pools)["instances"] if i["role"] == "decode"]
    assert len(after) == 1 and after[0]["name"] != decode["name"]
    with urllib.request.urlopen(pools["url"] + "/cluster", timeout=10) as r:
        names = {i["name"] for i in json.loads(r.read())["instances"]}
    assert decode["name"] not in names and after[0]["name"] in names
    assert any(f"{decode['name']} lost" in e for e in status(pools)["events"])
    code, body = chat(pools["url"], CHATS[0])
    assert code == 200, body


def test_scaling_up_and_down_under_load_fails_no_request(pools):
    results: list[int] = []
    stop = threading.Event()

    def client():
        i = 0
        while not stop.is_set():
            code, body = chat(pools["url"], f"{CHATS[i % len(CHATS)]} ({i})")
            results.append(code if code == 200 else (code, body))
            i += 1
    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        controller = pools["controller"]
        ray.get(controller.scale.remote(None, 2, None), timeout=30)
        assert wait_until(lambda: ray.get(controller.ready.remote()), timeout=180), status(pools)
        assert len([i for i in status(pools)["instances"] if i["role"] == "decode"]) == 2
        served_before = len(results)
        time.sleep(3)
        ray.get(controller.scale.remote(None, 1, None), timeout=30)
        assert wait_until(lambda: ray.get(controller.ready.remote()), timeout=120), status(pools)
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    assert len(results) > served_before > 0
    assert all(r == 200 for r in results), [r for r in results if r != 200]
    assert len([i for i in status(pools)["instances"] if i["role"] == "decode"]) == 1
    assert any("drained" in e for e in status(pools)["events"])


def router_counter(pools, name: str) -> float:
    with urllib.request.urlopen(pools["url"] + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f"pdserve:proxy_{name} "):
                return float(line.split()[1])
    return 0.0


def test_a_drain_past_its_deadline_hands_its_streams_over_to_another_decode(pools):
    """Scaling down drains the newest D; a stream on it that outlives the drain (2 s here) is ended there
    with an error output, and the router resumes it on the other D from the tokens already sent: the
    client sees one whole stream, no error."""
    controller = pools["controller"]
    ray.get(controller.scale.remote(None, 2, None), timeout=30)
    assert wait_until(lambda: ray.get(controller.ready.remote()), timeout=180), status(pools)
    recovered = router_counter(pools, "recoveries_total")
    streams = []
    for i in range(2):   # round-robin: one on each D
        events: list[str] = []
        started = threading.Event()
        thread = threading.Thread(target=stream_chat, args=(pools["url"], f"{CHATS[i]} ({i})", 300, events, started))
        thread.start()
        streams.append((thread, events, started))
    for _, events, started in streams:
        assert started.wait(60) and not events[0].startswith("client error"), events
    ray.get(controller.scale.remote(None, 1, None), timeout=30)
    for thread, _, _ in streams:
        thread.join(timeout=180)
        assert not thread.is_alive()
    for _, events, _ in streams:
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        finishes = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-1]
                    if json.loads(e).get("choices")]
        assert finishes[-1] == "length", finishes[-3:]
    assert wait_until(lambda: ray.get(controller.ready.remote()), timeout=120), status(pools)
    assert any("drained" in e for e in status(pools)["events"])
    assert router_counter(pools, "recoveries_total") >= recovered + 1


def test_the_autoscaler_shrinks_an_idle_decode_pool_to_its_minimum(pools):
    controller = pools["controller"]
    ray.get(controller.scale.remote(None, 2, None), timeout=30)
    assert wait_until(lambda: ray.get(controller.ready.remote()), timeout=180), status(pools)
    # Idle: every pressure is ~0, under `down`; one decision in a row suffices, no cooldown.
    config = AutoscaleConfig(patience=1, cooldown_s=0.0, max_instances=4)   # default SLOs and thresholds
    ray.get(controller.set_autoscale.remote(config, 0.5), timeout=30)
    try:
        assert wait_until(lambda: status(pools)["wanted"]["decode"] == 1, timeout=60), status(pools)
        assert wait_until(lambda: ray.get(controller.ready.remote()), timeout=60), status(pools)
        report = status(pools)
        assert report["wanted"]["prefill"] == 1   # already at its minimum
        assert report["autoscale"]["decisions"].get("decode_down") == 1
        assert any("autoscale: decode_down" in e for e in report["events"])
    finally:
        ray.get(controller.set_autoscale.remote(None), timeout=30)
    code, body = chat(pools["url"], CHATS[1])
    assert code == 200, body


def test_a_killed_router_actor_is_started_again_with_the_pools(pools):
    ray.kill(ray.get_actor("pdserve-router", namespace=NAMESPACE), no_restart=True)
    assert wait_until(lambda: any("router actor died" in e for e in status(pools)["events"]), timeout=30)

    def answers() -> bool:
        try:
            return chat(pools["url"], CHATS[2])[0] == 200
        except (urllib.error.URLError, ConnectionError):
            return False
    assert wait_until(answers, timeout=60, interval=1.0)
    with urllib.request.urlopen(pools["url"] + "/cluster", timeout=10) as r:
        roles = sorted(i["role"] for i in json.loads(r.read())["instances"])
    assert roles == ["decode", "prefill"]


def test_an_instance_that_cannot_be_placed_waits_says_so_and_can_be_scaled_away(pools):
    controller = pools["controller"]
    before = set(status(pools)["events"])
    ray.get(controller.scale.remote(None, 3, None), timeout=30)   # node_b has 2 CPUs: the third D cannot fit
    assert wait_until(lambda: any("waits for resources" in e for e in status(pools)["events"]), timeout=60)
    decodes = [i for i in status(pools)["instances"] if i["role"] == "decode"]
    assert len(decodes) == 3 and sum(i["state"] == "starting" for i in decodes) >= 1
    assert not ray.get(controller.ready.remote())
    code, body = chat(pools["url"], CHATS[0])   # the rest serve meanwhile
    assert code == 200, body
    ray.get(controller.scale.remote(None, 1, None), timeout=30)
    assert wait_until(lambda: ray.get(controller.ready.remote()), timeout=120), status(pools)
    new_events = [e for e in status(pools)["events"] if e not in before]
    assert not any(" lost: " in e for e in new_events), new_events   # waiting for resources is no failure


def test_a_size_that_cannot_serve_is_refused_and_changes_nothing(pools):
    controller = pools["controller"]
    wanted = status(pools)["wanted"]
    for sizes in ((1, 0, 0), (0, 0, 0), (-1, 1, 0), (1, 10 ** 20, 0)):
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(controller.scale.remote(*sizes), timeout=30)
        assert isinstance(e.value.cause, ValueError)
    assert status(pools)["wanted"] == wanted


def test_pdserve_scale_prints_the_pools_and_refuses_bad_sizes(pools, capsys):
    from argparse import Namespace

    from pdserve.cluster.ray import scale_main
    args = dict(address="auto", prefill=None, decode=None, colocated=None, wait=0)
    assert scale_main(Namespace(**args)) == 0
    out = capsys.readouterr().out
    assert pools["url"] in out and "prefill" in out and "serving" in out
    assert scale_main(Namespace(**{**args, "prefill": 2, "decode": 0})) == 2
    assert "need decode instances" in capsys.readouterr().err
    assert scale_main(Namespace(**{**args, "decode": 1})) == 0   # unchanged: a no-op
    assert "wanted 1P 1D" in capsys.readouterr().out


def test_stopping_the_pools_leaves_no_server(pools):
    """Last: stops the controller's pools (the fixture's stop then has nothing left to do)."""
    pids = {i["pid"] for i in status(pools)["instances"]}
    assert pids and all(os.path.exists(f"/proc/{pid}") for pid in pids)
    ray.get(pools["controller"].stop.remote(), timeout=60)
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids), timeout=20)
    with pytest.raises(urllib.error.URLError):   # the router actor is gone too
        chat(pools["url"], CHATS[0])
