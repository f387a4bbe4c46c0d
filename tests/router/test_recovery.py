"""Stream recovery against fake instances: a decode instance that dies (or fails) mid-stream after k tokens,
and the proxy resumes the request on another one; the client reads one ordinary stream, exactly the
uninterrupted one. Also: before the first byte, non-streamed requests, the limits, what is not resumed."""
from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from pdserve import protocol

from .conftest import NEVER_EJECT, MODEL, PIECES, TOKEN_IDS, dead_url, post_raw

PROMPT_BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16, "stream": True}
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": True}
USAGE = {"stream_options": {"include_usage": True}}


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}


def events_of(raw: bytes) -> list:
    events = [e for e in raw.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events)
    return ["[DONE]" if e == b"data: [DONE]" else json.loads(e[6:]) for e in events]


def uninterrupted(harness, path: str, body: dict) -> list:
    """The same request through a proxy whose only D never fails."""
    url = harness.proxy([harness.backend("prefill")], [harness.backend("decode")])
    status, _, raw = post_raw(url, path, body)
    assert status == 200
    return events_of(raw)


def same_stream(got: list, want: list) -> None:
    """One ordinary stream: the same events as the uninterrupted one, all with one id, created and model."""
    assert got[-1] == want[-1] == "[DONE]" and got.count("[DONE]") == 1
    assert not any("error" in e for e in got[:-1]), got
    assert len({(e["id"], e["created"], e["model"]) for e in got[:-1]}) == 1
    strip = lambda events: [{k: v for k, v in e.items() if k != "id"} for e in events[:-1]]  # noqa: E731
    assert strip(got) == strip(want)


@pytest.mark.parametrize("failure", ["die_after_1", "die_after_2", "error_after_2"])
@pytest.mark.parametrize("path,body", [("/v1/completions", PROMPT_BODY), ("/v1/chat/completions", CHAT_BODY)],
                         ids=["completions", "chat"])
def test_decode_dying_mid_stream_is_resumed_on_another_decode(harness, failure, path, body):
    body = dict(body, **USAGE)
    want = uninterrupted(harness, path, body)
    p, dying, healthy = harness.backend("prefill"), harness.backend("decode", failure), harness.backend("decode")
    url = harness.proxy([p], [dying, healthy])

    status, _, raw = post_raw(url, path, body)

    assert status == 200
    got = events_of(raw)
    same_stream(got, want)
    assert got[0]["id"].startswith(f"id-d-{dying.url[-5:]}")   # the stream the client began with
    text = [e["choices"][0]["delta" if "chat" in path else "text"] for e in got[:-2] if e["choices"]]
    assert "".join(t.get("content", "") if isinstance(t, dict) else t for t in text) == "".join(PIECES)
    assert [e["choices"][0]["finish_reason"] for e in got[:-2]].count("stop") == 1
    assert got[-2]["usage"]["prompt_tokens"] == 7 and got[-2]["usage"]["completion_tokens"] == len(PIECES)
    assert b"token_ids" not in raw   # neither the router's nor the client's (it did not ask)
    k = int(failure[-1])
    [resumed] = healthy.received
    assert resumed.body["resume"] == {"token_ids": TOKEN_IDS[:k], "num_tokens": k}
    assert "kv_transfer_params" not in resumed.body and resumed.body["router_token_ids"] is True
    assert resumed.body["stream_options"] == {"include_usage": True} and resumed.body["max_tokens"] == 16
    assert resumed.headers["X-Request-Id"] == dying.received[0].headers["X-Request-Id"]
    m = metrics(url)
    assert m["pdserve:proxy_recoveries_total"] == 1 and m["pdserve:proxy_request_errors_total"] == 0
    assert m['pdserve:proxy_backend_errors_total{backend="decode-0",role="decode"}'] == 1
    assert p.releases == []   # D took the request


def test_the_clients_own_token_ids_go_through_whole(harness):
    p, dying, healthy = harness.backend("prefill"), harness.backend("decode", "die_after_1"), harness.backend("decode")
    url = harness.proxy([p], [dying, healthy])
    status, _, raw = post_raw(url, "/v1/completions", dict(PROMPT_BODY, return_token_ids=True))
    assert status == 200 and b"router_token_ids" not in raw
    events = events_of(raw)
    assert [t for e in events[:-1] for t in e["choices"][0].get("token_ids", [])] == TOKEN_IDS


def test_two_recoveries_then_the_limit(harness):
    p = harness.backend("prefill")
    d1, d2, d3 = (harness.backend("decode", "die_after_1"), harness.backend("decode", "die_after_1"),
                  harness.backend("decode"))
    url = harness.proxy([p], [d1, d2, d3])
    status, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    same_stream(events_of(raw), uninterrupted(harness, "/v1/completions", PROMPT_BODY))
    assert d3.received[0].body["resume"] == {"token_ids": TOKEN_IDS[:2], "num_tokens": 2}
    assert metrics(url)["pdserve:proxy_recoveries_total"] == 2

    limited = harness.proxy([p], [harness.backend("decode", "die_after_1"), harness.backend("decode", "die_after_1"),
                                  harness.backend("decode")], max_recoveries=1)
    events = events_of(post_raw(limited, "/v1/completions", PROMPT_BODY)[2])
    assert events[-2]["error"]["message"] == "the decode-1 instance dropped the connection mid-stream"
    assert events[-1] == "[DONE]" and [e["choices"][0]["text"] for e in events[:-2]] == PIECES[:2]
    m = metrics(limited)
    assert m["pdserve:proxy_recoveries_total"] == 1 and m['pdserve:proxy_recovery_failures_total{reason="limit"}'] == 1
    assert m["pdserve:proxy_request_errors_total"] == 1


@pytest.mark.parametrize("mode,reason", [("die_after_1", "no_backend"), ("die_after_1+no_ids", "untracked"),
                                         ("deadline_after_1", None)])
def test_what_is_not_resumed_ends_with_an_error_event_as_before(harness, mode, reason):
    """No other D; an instance that does not report its tokens; the request's own deadline (504)."""
    p, failing = harness.backend("prefill"), harness.backend("decode", mode)
    others = [harness.backend("decode")] if reason != "no_backend" else []
    url = harness.proxy([p], [failing, *others])
    status, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    events = events_of(raw)
    assert status == 200 and events[-1] == "[DONE]" and events[0]["choices"][0]["text"] == PIECES[0]
    assert events[-2]["error"]["code"] == (504 if mode.startswith("deadline") else 502)
    assert all(not o.received for o in others)
    m = metrics(url)
    assert m["pdserve:proxy_recoveries_total"] == 0 and m["pdserve:proxy_request_errors_total"] == 1
    if reason is not None:
        assert m[f'pdserve:proxy_recovery_failures_total{{reason="{reason}"}}'] == 1


@pytest.mark.parametrize("is_stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("failure", ["http500", "dead"])
def test_a_decode_failing_before_the_first_byte_is_retried_on_another(harness, failure, is_stream):
    """No token reached the client: the request goes to another D as it is, which computes the prompt
    itself; P's blocks, which no D took, are released."""
    p, healthy = harness.backend("prefill"), harness.backend("decode")
    failing = dead_url() if failure == "dead" else harness.backend("decode", failure)
    url = harness.proxy([p], [failing, healthy], eject_after=NEVER_EJECT)
    status, _, raw = post_raw(url, "/v1/completions", dict(PROMPT_BODY, stream=is_stream))
    assert status == 200
    if is_stream:
        same_stream(events_of(raw), uninterrupted(harness, "/v1/completions", PROMPT_BODY))
    else:
        assert json.loads(raw)["choices"][0]["text"] == "".join(PIECES)
    [hop] = healthy.received
    assert "kv_transfer_params" not in hop.body and "resume" not in hop.body
    assert p.releases == [{"kv_transfer_params": p.kv_transfer_params}]
    assert metrics(url)["pdserve:proxy_recoveries_total"] == 1


def test_colocated_instances_resume_each_other(harness):
    dying, healthy = harness.backend("colocated", "die_after_2"), harness.backend("colocated")
    url = harness.proxy(colocated=[dying, healthy])
    status, _, raw = post_raw(url, "/v1/chat/completions", dict(CHAT_BODY, **USAGE))
    assert status == 200
    same_stream(events_of(raw), uninterrupted(harness, "/v1/chat/completions", dict(CHAT_BODY, **USAGE)))
    assert healthy.received[0].body["resume"]["token_ids"] == TOKEN_IDS[:2]


def test_a_client_cannot_send_the_routers_fields(harness):
    c = harness.backend("colocated")
    url = harness.proxy(colocated=[c])
    body = dict(PROMPT_BODY, stream=False, resume={"token_ids": [1], "num_tokens": 1}, router_token_ids=True)
    assert post_raw(url, "/v1/completions", body)[0] == 200
    assert "resume" not in c.received[0].body and "router_token_ids" not in c.received[0].body


def test_a_stream_split_anywhere_is_relayed_whole():
    """Reads of any size, several events in one or one event in several: the same events, ids noted."""
    from pdserve.router.relay import StreamRelay
    chunks = [protocol.completion_chunk("x", MODEL, 1, piece) | {"router_token_ids": [t, t + 1]}
              for piece, t in zip(PIECES, (5, 7, 9))]
    data = b"".join(protocol.sse_event(c) for c in chunks) + protocol.SSE_DONE
    want = b"".join(protocol.sse_event({k: v for k, v in c.items() if k != "router_token_ids"}) for c in chunks)
    for size in (1, 2, 7, 50, len(data)):
        relay = StreamRelay()
        out = b"".join(relay.feed(data[i:i + size]) for i in range(0, len(data), size))
        assert out == want + protocol.SSE_DONE and relay.is_done and relay.is_tracked
        assert relay.resume_token_ids() == [5, 6, 7, 8, 9, 10] and relay.num_tokens == 6


def test_an_event_of_tokens_without_text_reaches_the_client_only_where_it_asked_for_token_ids():
    """Text held back (the start of a possible stop string) came to the client as empty chunks through the
    router, which asks for every event's tokens (new-user check, session 50); the ids are still noted."""
    from pdserve.router.relay import StreamRelay
    for chunk, kept in ((protocol.completion_chunk("x", MODEL, 1, ""), False),
                        (protocol.chat_chunk("x", MODEL, 1, {}), False),
                        (protocol.completion_chunk("x", MODEL, 1, "", token_ids=[4]), True),
                        (protocol.chat_chunk("x", MODEL, 1, {}, token_ids=[4]), True),
                        (protocol.completion_chunk("x", MODEL, 1, "", finish_reason="stop"), True),
                        (protocol.completion_chunk("x", MODEL, 1, " 5"), True)):
        relay = StreamRelay()
        out = relay.feed(protocol.sse_event(chunk | {"router_token_ids": [4]}))
        assert out == (protocol.sse_event(chunk) if kept else b""), chunk
        assert relay.resume_token_ids() == [4] and relay.is_tracked


def test_a_decode_at_capacity_is_waited_for_not_given_up_on(harness):
    """The 10,000-request soak: a D failed a request (a claim on P's KV timed out) and the other D, full,
    answered 503; the router gave up on it and the client's stream ended in an error. A 503 at capacity
    is not a failure: the request waits for room (here the only other D frees up 0.5 s later)."""
    p, dying, full = harness.backend("prefill"), harness.backend("decode", "die_after_1"), harness.backend("decode",
                                                                                                          "http503")
    url = harness.proxy([p], [dying, full], eject_after=NEVER_EJECT)
    threading.Timer(0.5, lambda: setattr(full, "mode", "ok")).start()
    status, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    assert status == 200
    same_stream(events_of(raw), uninterrupted(harness, "/v1/completions", PROMPT_BODY))
    assert len(full.received) >= 2 and full.received[-1].body["resume"]["num_tokens"] == 1
    assert len(full.received) < 20                         # asked again at capacity pulses, not in a loop
    m = metrics(url)
    assert m["pdserve:proxy_request_errors_total"] == 0


@pytest.mark.parametrize("is_stream", [False, True], ids=["json", "stream"])
def test_the_only_decode_at_capacity_serves_the_request_once_it_has_room(harness, is_stream):
    p, full = harness.backend("prefill"), harness.backend("decode", "http503")
    url = harness.proxy([p], [full], eject_after=NEVER_EJECT)
    threading.Timer(0.5, lambda: setattr(full, "mode", "ok")).start()
    status, _, raw = post_raw(url, "/v1/completions", dict(PROMPT_BODY, stream=is_stream))
    assert status == 200
    if not is_stream:
        assert json.loads(raw)["choices"][0]["text"] == "".join(PIECES)
    assert "kv_transfer_params" in full.received[0].body and "kv_transfer_params" not in full.received[-1].body
    assert p.releases == [{"kv_transfer_params": p.kv_transfer_params}]   # the first hop's KV went unused
    # waiting for room is not a recovery (before, each 503 at capacity counted one, and logged a failure)
    assert metrics(url)["pdserve:proxy_recoveries_total"] == 0


def test_room_that_never_comes_ends_at_the_queue_timeout(harness):
    p, dying, full = harness.backend("prefill"), harness.backend("decode", "die_after_1"), harness.backend("decode",
                                                                                                          "http503")
    url = harness.proxy([p], [dying, full], eject_after=NEVER_EJECT, queue_timeout=0.5)
    start = time.monotonic()
    status, _, raw = post_raw(url, "/v1/completions", PROMPT_BODY)
    assert time.monotonic() - start < 3
    events = events_of(raw)
    assert status == 200 and events[-1] == "[DONE]" and "error" in events[-2]
    assert metrics(url)['pdserve:proxy_recovery_failures_total{reason="no_room"}'] == 1
