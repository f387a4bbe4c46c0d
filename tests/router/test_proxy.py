"""The proxy against fake P and D instances: the P/D lifecycle, failures, disconnects, colocated mode."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from pdserve import protocol
from pdserve.router.proxy import PROXY_KEY, add_proxy_arguments, build_proxy_app, proxy_kwargs

from .conftest import NEVER_EJECT, D_USAGE, MODEL, PIECES, dead_url, get_raw, post_raw

PROMPT_BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16}
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}


def client(url: str, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=10)


def ask(url: str, *, is_chat: bool, is_stream: bool) -> tuple[str, dict | None]:
    """One request through the official client; returns (text, usage)."""
    c = client(url)
    options = {"stream": True, "stream_options": {"include_usage": True}} if is_stream else {}
    if is_chat:
        answer = c.chat.completions.create(model=MODEL, messages=CHAT_BODY["messages"], max_tokens=16, **options)
    else:
        answer = c.completions.create(model=MODEL, prompt=PROMPT_BODY["prompt"], max_tokens=16, **options)
    if not is_stream:
        choice = answer.choices[0]
        return (choice.message.content if is_chat else choice.text), answer.usage.model_dump()
    text, usage = "", None
    for chunk in answer:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            text += (choice.delta.content or "") if is_chat else choice.text
    return text, usage


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}


def error_of(raw: bytes) -> dict:
    return json.loads(raw)["error"]


@pytest.mark.parametrize("is_stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("is_chat", [False, True], ids=["completions", "chat"])
def test_pd_round_trip(harness, is_chat, is_stream):
    p, d = harness.backend("prefill"), harness.backend("decode")
    url = harness.proxy([p], [d])

    text, usage = ask(url, is_chat=is_chat, is_stream=is_stream)

    assert text == "".join(PIECES)                                  # D's content, not P's "P!"
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (D_USAGE["prompt_tokens"], len(PIECES))
    [p_hop], [d_hop] = p.received, d.received
    assert p_hop.path == d_hop.path == ("/v1/chat/completions" if is_chat else "/v1/completions")
    # P gets the client's max_tokens to check against its context (and generates one token itself)
    assert p_hop.body["stream"] is False and p_hop.body["max_tokens"] == 16  # the fake P also checks these
    assert d_hop.body["kv_transfer_params"] == p.kv_transfer_params
    assert d_hop.body["max_tokens"] == 16 and d_hop.body.get("stream", False) is is_stream
    assert ("stream_options" in d_hop.body) is is_stream
    assert p_hop.headers["X-Request-Id"] == d_hop.headers["X-Request-Id"]


def test_sse_passthrough_is_byte_for_byte(harness):
    """D's bytes as they came, less the token ids the router asked for (router_token_ids) for itself."""
    p, d = harness.backend("prefill"), harness.backend("decode")
    url = harness.proxy([p], [d])
    status, headers, raw = post_raw(url, "/v1/completions", dict(PROMPT_BODY, stream=True),
                                    headers={"X-Request-Id": "client-id-7"})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert d.received[0].body["router_token_ids"] is True and b"router_token_ids" in d.sent
    assert raw == re.sub(rb',"router_token_ids":\[[0-9,]*\]', b"", bytes(d.sent)) and raw.endswith(protocol.SSE_DONE)
    assert p.received[0].headers["X-Request-Id"] == d.received[0].headers["X-Request-Id"] == "client-id-7"


@pytest.mark.parametrize("failure", ["refused", "http500"])
def test_failed_prefill_is_retried_on_another_prefill(harness, failure):
    bad = dead_url() if failure == "refused" else harness.backend("prefill", "http500")
    good, d = harness.backend("prefill"), harness.backend("decode")
    url = harness.proxy([bad, good], [d], eject_after=NEVER_EJECT)

    assert ask(url, is_chat=False, is_stream=False)[0] == "".join(PIECES)
    assert len(good.received) == 1
    assert d.received[0].body["kv_transfer_params"]["remote_engine_id"] == good.url
    assert metrics(url)["pdserve:proxy_prefill_retries_total"] == 1


def test_with_every_prefill_down_the_decode_instance_serves_the_request_itself(harness):
    """Two P tried (or ejected): the request goes to D without kv_transfer_params, and D prefills it."""
    bad_urls, d = [dead_url(), dead_url()], harness.backend("decode")
    url = harness.proxy(bad_urls, [d])
    status, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "".join(PIECES)
    assert len(d.received) == 1 and "kv_transfer_params" not in d.received[0].body
    assert ask(url, is_chat=True, is_stream=True)[0] == "".join(PIECES)   # the official client, streaming
    assert metrics(url)['pdserve:proxy_routing_decisions_total{reason="prefill_saturated"}'] >= 1.0


def test_with_every_instance_down_the_client_gets_a_clean_error(harness):
    url = harness.proxy([dead_url()], [dead_url()])
    status, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    error = error_of(raw)
    assert status in (502, 503) and error["code"] == status
    assert "127.0.0.1" not in raw.decode()   # no backend address reaches a client
    with pytest.raises(openai.APIStatusError) as caught:  # the official client sees a clean error too
        ask(url, is_chat=True, is_stream=True)
    assert caught.value.status_code in (502, 503)


def test_prefill_400_is_passed_through_without_retry(harness):
    p1, p2, d = harness.backend("prefill", "http400"), harness.backend("prefill", "http400"), harness.backend("decode")
    url = harness.proxy([p1, p2], [d])
    status, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    assert status == 400 and error_of(raw)["message"] == "prefill says 400"
    assert len(p1.received) + len(p2.received) == 1 and d.received == []


def test_a_prefill_without_kv_transfer_params_is_routed_around(harness):
    """A P that answers without kv_transfer_params (not a KV producer) fails the prefill hop; with no other
    P the request goes straight to D, which prefills it itself, and the client gets its answer."""
    p, d = harness.backend("prefill", "no_kv"), harness.backend("decode")
    url = harness.proxy([p], [d])
    status, _, raw = post_raw(url, "/v1/chat/completions", CHAT_BODY)
    assert status == 200 and len(p.received) == 1
    [d_hop] = d.received
    assert "kv_transfer_params" not in d_hop.body
    assert metrics(url)['pdserve:proxy_routing_decisions_total{reason="prefill_saturated"}'] == 1.0


def test_missing_kv_transfer_params_gives_502_naming_the_prefill_when_no_decode_can_serve(harness):
    p, d = harness.backend("prefill", "no_kv"), harness.backend("decode", "http500")
    url = harness.proxy([p], [d], max_recoveries=0)
    status, _, raw = post_raw(url, "/v1/chat/completions", CHAT_BODY)
    assert status == 502 and error_of(raw)["message"].startswith("the decode-0 instance failed")


@pytest.mark.parametrize("mode,status", [("http500", 502), ("http400", 400), ("silent", 502)])
def test_decode_failure_before_streaming(harness, mode, status):
    p, d = harness.backend("prefill"), harness.backend("decode", mode)
    if mode == "silent":   # and its load reports too: an instance that answers them is computing
        d.load_mode = "hang"
    url = harness.proxy([p], [d], timeout=0.3, eject_after=NEVER_EJECT)
    code, _, raw = post_raw(url, "/v1/completions", dict(PROMPT_BODY, stream=True))
    assert code == status
    message = error_of(raw)["message"]
    expected = {"http400": "decode says 400", "http500": "the decode-0 instance failed: decode says 500",
                "silent": "the decode-0 instance timed out"}
    assert message == expected[mode] and str(d.url) not in raw.decode()


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


@pytest.mark.parametrize("mode", ["http500", "http400", "dead"])
def test_decode_hop_that_never_happened_releases_p_blocks(harness, mode):
    """P holds the prompt's blocks for D until its lease runs out (30 s) unless told no D is coming."""
    p = harness.backend("prefill")
    decode = dead_url() if mode == "dead" else harness.backend("decode", mode).url
    url = harness.proxy([p], [decode], timeout=0.3, eject_after=NEVER_EJECT)
    code, _, _ = post_raw(url, "/v1/completions", dict(PROMPT_BODY, stream=True), headers={"Authorization": "Bearer k"})
    assert code in (400, 502)
    assert wait_for(lambda: p.releases), "P was not told to release"
    assert p.releases == [{"kv_transfer_params": p.kv_transfer_params}]
    assert metrics(url)["pdserve:proxy_kv_releases_total"] == 1


def test_a_decode_that_never_accepts_the_connection_releases_p_blocks(harness, unaccepting_url):
    """A connect timeout is a hop D never took: P must not hold the prompt's blocks until its lease runs out."""
    p = harness.backend("prefill")
    url = harness.proxy([p], [unaccepting_url], connect_timeout=0.3, eject_after=NEVER_EJECT, max_recoveries=0)
    code, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    assert code == 502 and error_of(raw)["message"].startswith("the decode-0 instance"), raw
    assert wait_for(lambda: p.releases), "P was not told to release"
    assert p.releases == [{"kv_transfer_params": p.kv_transfer_params}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("poll_interval", [0.1, 1.0])
def test_an_answer_that_comes_whole_may_take_longer_than_the_timeout(harness, stream, poll_interval):
    """--timeout bounds a backend's silence. Before its first byte an instance computes the prompt (P's answer
    and a non-streamed one come whole; a stream's headers come with its first token): a healthy instance that
    sends its load reports is waited for however long that takes, and however seldom it is polled."""
    p, d = harness.backend("prefill", "slow_0.8s"), harness.backend("decode", "slow_0.8s")
    url = harness.proxy([p], [d], timeout=0.3, max_recoveries=0, poll_interval=poll_interval)
    code, _, raw = post_raw(url, "/v1/completions", dict(PROMPT_BODY, stream=stream))
    assert code == 200, raw
    [d_hop] = d.received
    assert d_hop.body.get("kv_transfer_params") == p.kv_transfer_params   # P's hop was not given up on
    assert metrics(url).get("pdserve:proxy_kv_releases_total", 0) == 0


def test_a_direct_stream_may_compute_its_prompt_for_longer_than_the_timeout(harness):
    c = harness.backend("colocated", "slow_0.8s")
    url = harness.proxy(colocated=[c], timeout=0.3, max_recoveries=0)
    code, _, raw = post_raw(url, "/v1/completions", dict(PROMPT_BODY, stream=True))
    assert code == 200 and raw.endswith(protocol.SSE_DONE), raw


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_that_comes_whole_fails_when_the_instance_stops_answering_polls(harness, stream):
    d = harness.backend("decode", "slow_5s")
    d.load_mode = "hang"
    url = harness.proxy([harness.backend("prefill")], [d], timeout=0.3, eject_after=NEVER_EJECT, max_recoveries=0)
    began = time.monotonic()
    code, _, raw = post_raw(url, "/v1/completions", dict(PROMPT_BODY, stream=stream))
    assert code == 502 and error_of(raw)["message"] == "the decode-0 instance timed out", raw
    assert time.monotonic() - began < 4.0   # a poll round's bound (0.1 + 2 s) at least, not the 5 s answer


def test_a_healthy_instance_that_never_answers_is_given_up_on_at_the_cap(harness):
    """Healthy load reports keep a hop waiting, but not for ever (the cap is 3,600 s; 1 s here)."""
    c = harness.backend("colocated", "slow_5s")
    url = harness.proxy(colocated=[c], timeout=0.3, max_recoveries=0)
    harness.proxy_app[PROXY_KEY].first_byte_cap_s = 1.0
    began = time.monotonic()
    code, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    assert code == 502 and error_of(raw)["message"] == "the colocated-0 instance timed out", raw
    assert 1.0 <= time.monotonic() - began < 3.0


def test_an_answer_that_comes_whole_fails_when_the_instance_says_it_is_stuck(harness):
    """An unhealthy report (a pdserve instance whose engine is stuck in a step) is no sign of progress."""
    c = harness.backend("colocated", "slow_5s")
    c.load = {"healthy": False, "health": "engine stalled: no word from the engine process for 60 s"}
    # never ejected, so the request meets it whatever the order of its first poll and the request
    url = harness.proxy(colocated=[c], timeout=0.3, eject_after=NEVER_EJECT, max_recoveries=0)
    began = time.monotonic()
    code, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    assert code == 502 and error_of(raw)["message"] == "the colocated-0 instance timed out", raw
    assert time.monotonic() - began < 4.0


def test_an_answer_that_comes_whole_from_a_removed_instance_is_bounded_by_the_timeout(harness):
    """A removed instance is no longer polled: its hops get --timeout from the removal (a hostile review:
    one on a node that vanished waited forever)."""
    c, other = harness.backend("colocated", "slow_5s"), harness.backend("colocated")
    url = harness.proxy(colocated=[c, other], timeout=0.3, eject_after=NEVER_EJECT, max_recoveries=0)
    proxy = harness.proxy_app[PROXY_KEY]

    async def remove_soon():
        await asyncio.sleep(0.3)
        proxy.set_members([("colocated-1", other.url, "colocated")])
    began = time.monotonic()
    asyncio.run_coroutine_threadsafe(remove_soon(), harness.loop)
    code, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    assert code == 502 and "timed out" in error_of(raw)["message"], raw
    assert time.monotonic() - began < 4.0


@pytest.mark.parametrize("flag,value", [(flag, value) for flag in ("--timeout", "--connect-timeout")
                                        for value in ("0", "-1", "nan")] + [("--connect-timeout", "inf")])
def test_a_timeout_that_is_not_a_positive_number_is_refused(flag, value):
    """(--connect-timeout inf was taken, then every new connection failed with a 500: aiohttp rounds the
    deadline to an integer; a hostile review)"""
    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    args = parser.parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", flag, value])
    with pytest.raises(ValueError, match=flag):
        proxy_kwargs(args)


@pytest.mark.parametrize("mode", ["ok", "silent"])
def test_no_release_when_d_may_be_reading(harness, mode):
    """Served, or D timed out (it may be reading P's blocks: it releases or finishes the read itself)."""
    p, d, failing = harness.backend("prefill"), harness.backend("decode", mode), harness.backend("decode", "http500")
    if mode == "silent":   # and its load reports too: an instance that answers them is computing
        d.load_mode = "hang"
    # round-robin: d first, then failing; no recovery (which would resume each request on the other D)
    url = harness.proxy([p], [d, failing], timeout=0.3, max_recoveries=0, eject_after=NEVER_EJECT)
    assert post_raw(url, "/v1/completions", dict(PROMPT_BODY, stream=True))[0] == (200 if mode == "ok" else 502)
    assert post_raw(url, "/v1/completions", dict(PROMPT_BODY, stream=True))[0] == 502
    # the second request's release arrives; had the first sent one, it would be here by then too
    assert wait_for(lambda: p.releases)
    time.sleep(0.1)
    assert len(p.releases) == 1 and metrics(url)["pdserve:proxy_kv_releases_total"] == 1
    assert [r.path for r in failing.received] == ["/v1/completions"]


def test_decode_dying_mid_stream_gives_sse_error_then_done(harness):
    p, d = harness.backend("prefill"), harness.backend("decode", "die_mid_stream")
    url = harness.proxy([p], [d])
    status, _, raw = post_raw(url, "/v1/chat/completions", dict(CHAT_BODY, stream=True))
    assert status == 200
    events = [e for e in raw.split(b"\n\n") if e]
    assert protocol.parse_sse_data(events[0])["choices"][0]["delta"]["content"] == PIECES[0]
    assert (protocol.parse_sse_data(events[-2])["error"]["message"]
            == "the decode-0 instance dropped the connection mid-stream")
    assert events[-1] + b"\n\n" == protocol.SSE_DONE


def test_client_disconnect_mid_stream_closes_the_decode_connection(harness):
    p, d = harness.backend("prefill"), harness.backend("decode", "endless")
    url = harness.proxy([p], [d])
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(dict(PROMPT_BODY, stream=True)).encode()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"data: " not in received:          # until streaming has begun
            received += sock.recv(65536)
    assert d.disconnected.wait(5)                 # D saw its connection closed: it would abort
    deadline = time.monotonic() + 5
    while metrics(url)["pdserve:proxy_requests_in_flight"] != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metrics(url)["pdserve:proxy_client_disconnects_total"] == 1


def test_client_disconnect_during_prefill_closes_the_prefill_connection(harness):
    p, d = harness.backend("prefill", "slow"), harness.backend("decode")
    url = harness.proxy([p], [d])
    with pytest.raises(openai.APITimeoutError):
        client(url).with_options(timeout=0.3).completions.create(model=MODEL, prompt="x", max_tokens=4)
    assert p.disconnected.wait(5) and d.received == []


def test_colocated_mode_round_robins_the_body_as_is(harness):
    a, b = harness.backend("colocated"), harness.backend("colocated")
    url = harness.proxy(colocated=[a, b])
    for _ in range(2):
        assert ask(url, is_chat=False, is_stream=False)[0] == "".join(PIECES)
        assert ask(url, is_chat=True, is_stream=True)[0] == "".join(PIECES)
    assert len(a.received) == len(b.received) == 2
    assert all("kv_transfer_params" not in r.body and r.body["max_tokens"] == 16 for r in a.received + b.received)


def test_a_ps_400_is_the_clients_error_not_a_backend_failure(harness, caplog):
    """A prompt P refuses (too long, an unknown model) was logged as "prefill backend ... failed" (a new-user
    check): it is passed through, counted as a client error, and logged as the request refused."""
    p, d = harness.backend("prefill", "http400"), harness.backend("decode")
    url = harness.proxy([p], [d])
    with caplog.at_level(logging.INFO, logger="pdserve.router.proxy"):
        status, _, _ = post_raw(url, "/v1/completions", PROMPT_BODY)
    assert status == 400 and d.received == []
    m = metrics(url)
    assert m["pdserve:proxy_request_errors_total"] == m["pdserve:proxy_client_errors_total"] == 1
    assert m["pdserve:proxy_prefill_retries_total"] == 0
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "refused the request: HTTP 400" in logged and "failed" not in logged


def test_metrics_count_requests_and_errors(harness):
    p, d = harness.backend("prefill"), harness.backend("decode")
    # Never ejected: each request meets the dead P in turn (the monitor would otherwise route around it
    # after its third failed poll, and the retries counted would depend on the machine's speed).
    url = harness.proxy([p, dead_url()], [d], eject_after=NEVER_EJECT)
    ask(url, is_chat=False, is_stream=True)
    post_raw(url, "/v1/chat/completions", CHAT_BODY)
    d.mode = "http500"
    post_raw(url, "/v1/completions", PROMPT_BODY)
    post_raw(url, "/v1/completions", [1, 2])  # not a JSON object: 400 from the proxy
    m = metrics(url)
    assert m["pdserve:proxy_requests_total"] == 4
    assert m["pdserve:proxy_request_errors_total"] == 2     # D's 500 and the proxy's own 400
    assert m["pdserve:proxy_client_errors_total"] == 1      # the proxy's own 400 (review: it was not counted)
    assert m["pdserve:proxy_prefill_retries_total"] == 2    # requests 2 and 3 met the dead P first
    assert m["pdserve:proxy_requests_in_flight"] == 0
    assert m["pdserve:proxy_time_to_first_token_seconds_count"] == 2
    assert m["pdserve:proxy_prefill_seconds_count"] == 3
    assert m['pdserve:proxy_prefill_seconds_bucket{le="+Inf"}'] == 3


def test_api_key_is_required_and_the_router_key_replaces_it_on_hops(harness):
    p, d = harness.backend("prefill"), harness.backend("decode")
    url = harness.proxy([p], [d], api_key="sekret", router_key="router-secret")
    with pytest.raises(openai.AuthenticationError):
        client(url, api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=4)
    assert p.received == []
    answer = client(url, api_key="sekret").completions.create(model=MODEL, prompt="x", max_tokens=4)
    assert answer.choices[0].text == "".join(PIECES)
    for hop in (p.received[0], d.received[0]):   # the client's key never leaves the proxy
        assert "Authorization" not in hop.headers and hop.headers["X-PDServe-Router-Key"] == "router-secret"
    assert [m.id for m in client(url, api_key="sekret").models.list()] == [MODEL]


def test_health_reports_each_backend_and_models_come_from_the_first_decode(harness):
    p, d1, d2 = harness.backend("prefill"), harness.backend("decode"), harness.backend("decode")
    down = dead_url()
    url = harness.proxy([p, down], [d1, d2], poll_interval=0.05)
    deadline = time.monotonic() + 5
    while True:   # the monitor ejects the dead P after --eject-after failed polls
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            assert resp.status == 200
            health = json.load(resp)
        if not health["backends"]["prefill"][1]["healthy"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [(b["name"], b["healthy"]) for b in health["backends"]["prefill"]] == [("prefill-0", True),
                                                                                ("prefill-1", False)]
    assert "127.0.0.1" not in json.dumps(health)
    assert all(b["healthy"] for b in health["backends"]["decode"])
    assert [m.id for m in client(url).models.list()] == [MODEL]
    assert [r.path for r in d1.received] == ["/v1/models"] and d2.received == []
    assert client(url).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client(url).models.retrieve("org/other")
    # a name is never put in a path the router sends: this one read an instance's router-only load report
    # with the router's key (review)
    for sneaky in ("..%2F..%2Fv1%2Fload", "%2E%2E/%2E%2E/v1/load", "..%2F..%2Fmetrics%3Fx%3D1"):
        status, _, body = get_raw(url, "/v1/models/" + sneaky)
        assert status == 404 and b"does not exist" in body
    assert {r.path for r in d1.received + d2.received} == {"/v1/models"}


def test_one_client_session_per_app(harness):
    url = harness.proxy([harness.backend("prefill")], [harness.backend("decode")])
    session = harness.proxy_app[PROXY_KEY].session
    ask(url, is_chat=False, is_stream=False)
    assert harness.proxy_app[PROXY_KEY].session is session and not session.closed


def test_build_and_cli_validation():
    with pytest.raises(ValueError, match="prefill_urls"):
        build_proxy_app(["http://p:1"], [])
    with pytest.raises(ValueError, match="colocated_urls"):
        build_proxy_app([], [], [])
    with pytest.raises(ValueError, match="given twice"):
        build_proxy_app(["http://p:1"], ["http://p:1/"])
    build_proxy_app(["http://p:1"], ["http://d:1"], ["http://c:1"])   # mixed pools: the router may skip P/D
    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    args = parser.parse_args(["--prefill", "p:1", "p:2", "--decode", "d:1", "--port", "9000", "--api-key", "k"])
    assert (args.prefill, args.decode, args.colocated, args.host, args.port, args.api_key) == \
        (["p:1", "p:2"], ["d:1"], [], "127.0.0.1", 9000, "k")
    assert parser.parse_args(["--colocated", "c:1", "c:2"]).colocated == ["c:1", "c:2"]


def test_client_kv_transfer_params_never_reach_a_backend(harness):
    """Colocated mode forwards the body as it is, except what only the router may set."""
    c = harness.backend("colocated")
    url = harness.proxy(colocated=[c], router_key="router-secret")
    forged = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 22}
    status, _, _ = post_raw(url, "/v1/completions", dict(PROMPT_BODY, kv_transfer_params=forged))
    assert status == 200 and "kv_transfer_params" not in c.received[0].body


def test_a_backend_refusing_the_router_key_is_a_502_not_the_clients_401(harness):
    c = harness.backend("colocated", "http401")
    url = harness.proxy(colocated=[c])
    status, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    assert status == 502 and error_of(raw)["message"] == "the colocated-0 instance refused the router"


def test_past_max_in_flight_the_proxy_answers_503_with_retry_after_never_502(harness):
    """Admission, not the backend connection pool, decides who waits: the excess gets a 503 at once;
    nobody waits for a pool slot until it times out as if a healthy P had (a 502 blaming it)."""
    from concurrent.futures import ThreadPoolExecutor
    p, d = harness.backend("prefill", "slow_1s"), harness.backend("decode")
    url = harness.proxy([p], [d], max_in_flight=3)
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: post_raw(url, "/v1/completions", PROMPT_BODY, timeout=10), range(6)))
    assert sorted(status for status, _, _ in answers) == [200, 200, 200, 503, 503, 503]
    assert all(headers["Retry-After"] == "1" and error_of(raw)["code"] == 503
               for status, headers, raw in answers if status == 503)


def test_a_backend_at_capacity_passes_its_503_and_retry_after_to_the_client(harness):
    """After waiting --queue-timeout for room (recovery.wait_for_room)."""
    c = harness.backend("colocated", "http503")
    url = harness.proxy(colocated=[c], queue_timeout=0.3)
    status, headers, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    assert status == 503 and headers["Retry-After"] == "7" and error_of(raw)["message"] == "colocated says 503"
    assert len(c.received) == 1   # held back for its Retry-After (capped at 2 s), past the queue timeout


def test_a_request_the_decode_would_refuse_costs_no_prefill(harness):
    p, d = harness.backend("prefill"), harness.backend("decode")
    url = harness.proxy([p], [d])
    for body, param in ((dict(PROMPT_BODY, stream="yes"), "stream"),
                        (dict(PROMPT_BODY, stream_options={"include_usage": True}), "stream_options"),
                        (dict(PROMPT_BODY, max_tokens=-1), "max_tokens")):
        status, _, raw = post_raw(url, "/v1/completions", body)
        assert status == 400 and error_of(raw)["param"] == param
    assert p.received == [] and d.received == []


def test_aiohttp_errors_of_the_proxy_are_openai_json(harness):
    url = harness.proxy(colocated=[harness.backend("colocated")])
    import urllib.request
    for method, path, status in (("PUT", "/v1/completions", 405), ("POST", "/v1/kv/release", 404)):
        request = urllib.request.Request(url + path, data=b"{}", method=method)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=5)
        assert caught.value.code == status and json.loads(caught.value.read())["error"]["code"] == status


def test_a_body_over_the_limit_or_not_json_is_refused_in_json(harness):
    url = harness.proxy(colocated=[harness.backend("colocated")], max_body_bytes=1000)
    status, _, raw = post_raw(url, "/v1/completions", {"prompt": "x" * 2000})
    assert status == 413 and error_of(raw)["code"] == 413
    import urllib.request
    request = urllib.request.Request(url + "/v1/completions", data=b'{"prompt": [1, 2', method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=5)
    assert caught.value.code == 400 and json.loads(caught.value.read())["error"]["code"] == 400


def test_tokenize_and_detokenize_go_to_a_decode_instance(harness):
    d = harness.backend("decode")
    url = harness.proxy([harness.backend("prefill")], [d])
    status, _, raw = post_raw(url, "/tokenize", {"prompt": "x"})
    assert status == 200 and json.loads(raw)["tokens"] == [1, 2]
    assert [r.path for r in d.received] == ["/tokenize"]


def test_per_backend_counters_are_labelled_by_name(harness):
    bad, good, d = dead_url(), harness.backend("prefill"), harness.backend("decode")
    url = harness.proxy([bad, good], [d], eject_after=NEVER_EJECT)
    for _ in range(2):
        assert post_raw(url, "/v1/completions", PROMPT_BODY)[0] == 200
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'pdserve:proxy_backend_errors_total{backend="prefill-0",role="prefill"} 2.0' in text   # round-robin: both
    assert 'pdserve:proxy_backend_requests_total{backend="decode-0",role="decode"} 2.0' in text


def test_requests_waiting_on_a_prefill_the_polls_eject_go_elsewhere_at_once(harness):
    """A stopped P (SIGSTOP) was ejected by the polls within seconds, but the requests it already held
    waited for it as long as --timeout allows (20 s in the hostile run, 600 by default). Now the hop is
    given up on at the ejection, and the request goes to another instance."""
    p, d = harness.backend("prefill", "slow_5s"), harness.backend("decode")
    url = harness.proxy([p], [d], timeout=600, eject_after=1, poll_interval=0.1, max_recoveries=1)
    threading.Timer(0.3, lambda: setattr(p, "load_mode", "hang")).start()
    began = time.monotonic()
    code, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    assert code == 200, raw
    assert time.monotonic() - began < 4.0   # the ejection (a poll's timeout), not P's 5 s answer
    assert "kv_transfer_params" not in d.received[-1].body   # D computed the prompt itself


def test_a_draining_or_unhealthy_instance_the_polls_eject_keeps_the_requests_it_holds(harness):
    """Only an instance whose polls go unanswered is given up on at its ejection: one that answers them
    unhealthy (draining after SIGTERM, a long step) is finishing its requests (review of the rule above:
    it first cut these too)."""
    p, d = harness.backend("prefill", "slow_1s"), harness.backend("decode")
    url = harness.proxy([p], [d], timeout=600, eject_after=1, poll_interval=0.05, max_recoveries=1)
    threading.Timer(0.2, lambda: p.load.update(healthy=False, health="draining")).start()
    code, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    assert code == 200, raw
    assert "kv_transfer_params" in d.received[-1].body   # P's answer came, and D read its KV
    assert len(p.received) == 1
