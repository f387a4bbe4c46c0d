"""Fuzzing one instance's front door: one request must never take an instance down.

Two layers:
  fast: build_app over a FakeEngine (tiny tokenizer, vocab_size set) with an api key and a router key,
        on 127.0.0.1 port 0; thousands of generated bodies and headers against every route, then the
        engine holds nothing and every request it saw finished, was aborted or refused.
  real: one real engine (the default model on CPU, in-process AsyncEngine as `pdserve serve` builds it)
        fed a few hundred fuzzed generation requests whose max_tokens mixes garbage with 1..4, and
        sampling fields with extreme values; afterwards /health is 200, the engine is idle (nothing
        running or waiting, no KV blocks used) and a plain greedy request still works.
Properties of every answer: see tests/fuzz/common.py (check_answer).
"""
from __future__ import annotations

import json
import time
import zlib

import pytest
from hypothesis import given, strategies as st

from pdserve.config import ServerConfig
from pdserve.server.app import SERVER_KEY, start_server
from tests.server.fake_engine import WORDS

from . import strategies as s
from .common import (FUZZ_SCALE, GENERATION_ROUTES, MAX_BODY_BYTES, MAX_MODEL_LEN, MAX_PROMPT_CHARS, TOKENIZER,
                     VOCAB_SIZE, FuzzEngine, LoopThread, Tally, check_answer, fuzz_settings,
                     raw_request)

POST_ROUTES = (*GENERATION_ROUTES, "/tokenize", "/detokenize", "/v1/kv/release")
GET_ROUTES = ("/v1/models", "/health", "/metrics")
OPEN_ROUTES = ("/health", "/metrics")


# ----------------------------------------------------------------------------- the fast layer

class Instance:
    def __init__(self, loop: LoopThread) -> None:
        self.loop = loop
        self.engine = FuzzEngine(tokenizer=TOKENIZER, token_delay_s=0, vocab_size=VOCAB_SIZE,
                                 max_model_len=MAX_MODEL_LEN)
        config = ServerConfig(api_key=s.API_KEY, router_key=s.ROUTER_KEY, max_body_bytes=MAX_BODY_BYTES)
        self.runner, self.port = loop.run(start_server(self.engine, "127.0.0.1", 0, config))
        self.server = self.runner.app[SERVER_KEY]
        self.url = f"http://127.0.0.1:{self.port}"
        self.tally = Tally()

    def send(self, method: str, route: str, body: bytes | None, headers: dict) -> None:
        """One request, every property of its answer, and what the engine saw of it."""
        num_calls = len(self.engine.calls)
        answer = self.loop.request(method, self.url + route, body, headers)
        self.tally.add(route, answer)
        if method == "HEAD":   # no body to check
            assert answer.error is None and answer.status < 500, (route, answer)
            return
        check_answer(answer, route, body or b"", secrets=() if s.ROUTER_KEY.encode() in (body or b"")
                     else (s.ROUTER_KEY,))
        # HTTP drops the spaces around a header value; the scheme "Bearer" is case-insensitive (RFC 7235)
        is_router = headers.get(s.ROUTER_KEY_HEADER, "").strip(" \t") == s.ROUTER_KEY
        scheme, _, token = headers.get("Authorization", "").strip(" \t").partition(" ")
        is_client = scheme.lower() == "bearer" and token == s.API_KEY
        if route not in OPEN_ROUTES and not (is_router or is_client):
            assert answer.status == 401, f"{route} without a key answered {answer.status}"
        if route == "/v1/kv/release" and not is_router and answer.status != 401 and method == "POST":
            assert answer.status == 403, f"/v1/kv/release without the router key answered {answer.status}"
        new_calls = self.engine.calls[num_calls:]
        if not is_router:   # only the router may hand the engine kv_transfer_params
            assert all(call.kv_transfer_params is None for call in new_calls), new_calls
            parsed = _loads(body)
            if route in GENERATION_ROUTES and isinstance(parsed, dict) and parsed.get("kv_transfer_params") is not None:
                assert not 200 <= answer.status < 300, f"{route}: a client's kv_transfer_params were accepted"
        if route in GENERATION_ROUTES and 200 <= answer.status < 300:
            assert len(new_calls) == 1, f"a 2xx from {route} with {len(new_calls)} engine calls"

    def idle(self) -> list[str]:
        """What is left over: engine leaks, requests still counted in flight, logged errors."""
        deadline = time.monotonic() + 3
        while (self.engine.running or self.server.num_in_flight) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.engine.leaks() + ([f"num_in_flight {self.server.num_in_flight}"]
                                      if self.server.num_in_flight else [])


def _loads(body: bytes | None):
    try:
        return json.loads(body) if body else None
    except (ValueError, RecursionError):
        return None


@pytest.fixture(scope="module")
def instance(loop, errors):
    instance = Instance(loop)
    yield instance
    loop.run(instance.runner.cleanup())
    print(f"\nfast instance: {instance.tally}")


@pytest.fixture
def after(instance, errors):
    """After each test: nothing left in the engine or the server, no error logged."""
    num_records = len(errors.records)
    yield
    problems = instance.idle()
    assert not problems, problems
    new = errors.findings(since=num_records)
    assert not new, new


COMPLETIONS = s.completion_requests(WORDS, VOCAB_SIZE, MAX_PROMPT_CHARS, MAX_MODEL_LEN)
CHATS = s.chat_requests(WORDS)
ANY_REQUEST = st.one_of(
    COMPLETIONS, CHATS,
    st.fixed_dictionaries({"tokens": st.one_of(st.lists(st.integers(0, VOCAB_SIZE + 2), max_size=5), s.json_values)},
                          optional={"model": s.json_values}),
    st.fixed_dictionaries({"kv_transfer_params": s.kv_transfer_params}))


@pytest.mark.timeout(120)
@fuzz_settings(1000)
@given(data=st.data(), route=st.sampled_from(GENERATION_ROUTES), headers=s.headers())
def test_generation_routes_fuzzed_requests(instance, after, data, route, headers):
    """Plausible fields with random values, kv_transfer_params with and without the router key."""
    body = data.draw(COMPLETIONS if route == "/v1/completions" else CHATS, "body")
    instance.send("POST", route, s.dumps(body), headers)


@pytest.mark.timeout(120)
@fuzz_settings(600)
@given(route=st.sampled_from(POST_ROUTES), body=s.raw_bodies(ANY_REQUEST, MAX_BODY_BYTES),
       headers=s.headers(router_key_share=3))
def test_every_post_route_raw_bodies(instance, after, route, body, headers):
    """Bytes that are not JSON, not UTF-8, not an object, too deep, too large, numbers past every bound."""
    instance.send("POST", route, body, headers)


tokenize_bodies = st.builds(lambda body, extra: {**body, **extra}, st.one_of(COMPLETIONS, CHATS),
                            st.fixed_dictionaries({}, optional={"add_special_tokens": s.booleans}))
detokenize_bodies = st.fixed_dictionaries(
    {"tokens": st.one_of(st.lists(st.integers(0, VOCAB_SIZE + 2), max_size=6), st.lists(s.ints, max_size=3),
                         st.just(list(range(MAX_MODEL_LEN + 1))), st.just([[1, 2]]), st.just([True]), s.json_values)},
    optional={"model": st.one_of(st.just("fake-model"), s.json_values,
                                 st.sampled_from([s.nested(n) for n in (100, 500, 900, 950, 980)]),
                                 st.just(["x" * 1000] * 200))})
release_bodies = st.one_of(st.fixed_dictionaries({"kv_transfer_params": s.kv_transfer_params}),
                           st.fixed_dictionaries({"kv_transfer_params": st.fixed_dictionaries({
                               "remote_request_id": s.garbage_or(st.just("r-1"), 3),
                               "remote_engine_id": s.garbage_or(st.just("fuzz-engine"), 3)})}),
                           s.json_values)


@pytest.mark.timeout(120)
@fuzz_settings(500)
@given(data=st.data(), route=st.sampled_from(("/tokenize", "/detokenize", "/v1/kv/release")),
       headers=s.headers(router_key_share=4))
def test_tokenize_detokenize_release_fuzzed(instance, after, data, route, headers):
    if route == "/tokenize":
        body = data.draw(tokenize_bodies, "body")
    elif route == "/detokenize":
        body = data.draw(detokenize_bodies, "body")
    else:
        body = data.draw(release_bodies, "body")
    instance.send("POST", route, s.dumps(body), headers)


@pytest.mark.timeout(60)
@fuzz_settings(60)
@given(batch=st.lists(st.one_of(st.tuples(st.just("/v1/completions"), COMPLETIONS.map(s.dumps), s.headers()),
                                st.tuples(st.just("/v1/chat/completions"), CHATS.map(s.dumps), s.headers())),
                      min_size=2, max_size=12))
def test_fuzzed_requests_at_once(instance, after, batch):
    """Bursts of fuzzed requests in flight together (streams interleaved with refusals): every answer has
    every property, and the engine and the admission count are left clean (checked after the test)."""
    answers = instance.loop.requests_at_once([("POST", instance.url + route, body, headers)
                                               for route, body, headers in batch])
    for (route, body, headers), answer in zip(batch, answers):
        instance.tally.add(f"burst {route}", answer)
        check_answer(answer, route, body)


@pytest.mark.timeout(60)
@fuzz_settings(450)
@given(route=st.sampled_from((*GET_ROUTES, *GET_ROUTES, *POST_ROUTES, "/v1/nope", "/v1/completions/", "/V1/models")),
       method=st.sampled_from(("GET", "GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")),
       body=st.one_of(st.none(), st.binary(max_size=30), s.json_values.map(s.dumps)), headers=s.headers())
def test_every_route_every_method(instance, after, route, method, body, headers):
    """The GET routes with bodies and odd headers; every route with the wrong method (405 as JSON)."""
    instance.send(method, route, body, headers)


@pytest.mark.timeout(90)
@fuzz_settings(300)
@given(route=st.sampled_from((*POST_ROUTES, *GET_ROUTES)), extra=s.raw_headers,
       auth=st.one_of(st.just(b"Bearer " + s.API_KEY.encode()), s.raw_header_values),
       router_key=st.one_of(st.none(), st.just(s.ROUTER_KEY.encode()), s.raw_header_values),
       content_type=st.one_of(st.none(), st.just(b"application/json"), s.raw_header_values),
       body=st.one_of(st.just(b'{"prompt": "hello world", "max_tokens": 2}'),
                      COMPLETIONS.map(s.dumps),
                      st.binary(max_size=20)),
       length_delta=st.sampled_from([0, 0, 0, 0, 0, 5, -1]))
def test_odd_headers_on_a_raw_socket(instance, after, route, extra, auth, router_key, content_type, body,
                                     length_delta):
    """Header bytes that are not UTF-8, huge, control characters, wrong Content-Type, a Content-Length
    that lies. What aiohttp's HTTP parser refuses (not HTTP at all) must still be a 4xx, never a 5xx or
    a dead server; everything it lets through must have every property."""
    lines = [(b"Authorization", auth)] + ([(s.ROUTER_KEY_HEADER.encode(), router_key)] if router_key else []) + \
            ([(b"Content-Type", content_type)] if content_type is not None else []) + extra
    method = "GET" if route in GET_ROUTES else "POST"
    answer = instance.loop.raw(instance.port, raw_request(method, route, body, lines, len(body) + length_delta),
                               half_close=length_delta > 0)
    instance.tally.add(f"raw {route}", answer)
    is_http = s.is_plain_http(lines, extra) and length_delta >= 0   # a body longer than said: not HTTP
    if answer is not None and answer.content_type != "application/json" and not is_http:
        # aiohttp's own answer to bytes that are not HTTP: never reaches pdserve's middleware
        assert 400 <= answer.status < 500, (lines, answer)
    else:
        check_answer(answer, route, body, allow_no_answer=length_delta > 0 or not is_http)
    # the server survived it
    health = instance.loop.request("GET", instance.url + "/health")
    assert health.status == 200, health


@pytest.mark.timeout(30)
def test_gzip_bomb_is_refused(instance, after):
    """A body of 100 KB that inflates to 100 MB: compressed bodies are refused unread (415)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)   # 31: the gzip format
    bomb = compressor.compress(b'{"prompt": "' + b"a" * (100 << 20) + b'"}') + compressor.flush()
    headers = {"Authorization": f"Bearer {s.API_KEY}", s.ROUTER_KEY_HEADER: s.ROUTER_KEY, "Content-Encoding": "gzip",
               "Content-Type": "application/json"}
    for route in POST_ROUTES:
        answer = instance.loop.request("POST", instance.url + route, bomb, headers)
        check_answer(answer, route, b"")
        assert answer.status == 415, answer


# ----------------------------------------------------------------------------- the real layer

REAL_WORDS = ["hello", "world", "The", "capital", "of", "France", "is", "Paris", "<|im_start|>", "<|im_end|>",
              "<|endoftext|>", "🙂", "\n", "{{", "}}", "def", "1", "2"]
REAL_MAX_MODEL_LEN = 256
REAL_VOCAB = 49152


class RealInstance:
    def __init__(self, loop: LoopThread) -> None:
        from pdserve.config import CacheConfig, EngineConfig, ModelConfig
        from pdserve.engine.async_engine import AsyncEngine
        self.loop = loop
        config = EngineConfig(model=ModelConfig(model="default", max_model_len=REAL_MAX_MODEL_LEN),
                              cache=CacheConfig(kv_cache_memory=32 << 20), num_threads=1)
        self.engine = AsyncEngine(config)
        loop.run(self.engine.start(), timeout=240)
        server_config = ServerConfig(router_key=s.ROUTER_KEY)
        self.runner, port = loop.run(start_server(self.engine, "127.0.0.1", 0, server_config))
        self.server = self.runner.app[SERVER_KEY]
        self.url = f"http://127.0.0.1:{port}"
        self.tally = Tally()
        self.num_log_records = 0   # where this engine's part of the error log starts

    def metrics(self) -> dict[str, float]:
        answer = self.loop.request("GET", self.url + "/metrics")
        values = {}
        for line in answer.body.decode().splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("pdserve:") and "{" not in name:
                values[name[len("pdserve:"):]] = float(value)
        return values

    def close(self) -> None:
        self.loop.run(self.runner.cleanup())
        self.loop.run(self.engine.shutdown(), timeout=60)


@pytest.fixture(scope="module")
def real_instance(loop, errors):
    instance = RealInstance(loop)
    instance.num_log_records = len(errors.records)
    yield instance
    instance.close()
    print(f"\nreal instance: {instance.tally}")


EXTREME_SAMPLING = {   # valid, at the edges of every bound
    "temperature": st.sampled_from([0, 0.0, 5e-324, 1e-300, 1e-30, 1.0, 100, 100.0]),
    "top_p": st.sampled_from([5e-324, 1e-300, 1e-8, 0.5, 1, 1.0]),
    "top_k": st.sampled_from([-1, 0, 1, 2, 49151, 49152, 49153, 2**31 - 1]),
    "seed": st.sampled_from([None, 0, -2**63, 2**63 - 1, 2**63, 2**64 - 1]),
    "stop": st.sampled_from([[], "!", ["x" * 1024] * 32, [" ", ".", "\n", "the"], "🙂"]),
    "stop_token_ids": st.sampled_from([[], [0], [2**31 - 1], list(range(1024)), [2, 0, 1]]),
    "ignore_eos": st.booleans(), "stream": st.booleans(), "return_token_ids": st.booleans(),
    "n": st.sampled_from([1, 1.0]), "presence_penalty": st.sampled_from([-2.0, 0, 2]),
}


def real_requests(route: str) -> st.SearchStrategy:
    """Fuzzed bodies whose max_tokens mixes garbage with 1..4, and valid ones with extreme sampling."""
    max_tokens = s.max_tokens_values()
    extreme = st.fixed_dictionaries({"max_tokens": s.small_counts}, optional=EXTREME_SAMPLING)
    if route == "/v1/completions":
        fuzzed = s.completion_requests(REAL_WORDS, REAL_VOCAB, 32 * REAL_MAX_MODEL_LEN, REAL_MAX_MODEL_LEN,
                                       max_tokens=max_tokens)
        valid = st.fixed_dictionaries({"prompt": st.one_of(
            st.lists(st.sampled_from(REAL_WORDS), min_size=1, max_size=8).map(" ".join),
            st.lists(st.integers(0, REAL_VOCAB - 1), min_size=1, max_size=8))})
    else:
        fuzzed = s.chat_requests(REAL_WORDS, max_tokens=max_tokens)
        valid = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["user", "system", "assistant"]),
            "content": st.lists(st.sampled_from(REAL_WORDS), max_size=6).map(" ".join)}), min_size=1, max_size=3)})
    return s.weighted((4, fuzzed), (1, st.builds(lambda a, b: {**a, **b}, valid, extreme)))


REAL_REQUESTS = {route: real_requests(route) for route in GENERATION_ROUTES}


@pytest.mark.timeout(180)
def test_real_engine_survives_fuzzed_generation(real_instance, errors):
    """A few hundred fuzzed generation requests, then: /health 200, nothing running or waiting, no KV
    block in use, no request in flight, and a plain greedy request still answers."""

    @fuzz_settings(250)
    @given(data=st.data(), route=st.sampled_from(GENERATION_ROUTES),
           headers=st.fixed_dictionaries({}, optional={s.ROUTER_KEY_HEADER: st.just(s.ROUTER_KEY),
                                                       "Content-Type": s.content_types}))
    def fuzz(data, route, headers):
        body = data.draw(REAL_REQUESTS[route], "body")
        raw = s.dumps(body)
        answer = real_instance.loop.request("POST", real_instance.url + route, raw, headers, timeout=60)
        real_instance.tally.add(route, answer)
        check_answer(answer, route, raw)

    fuzz()
    tally = real_instance.tally
    assert sum(tally.num_ok(r) for r in GENERATION_ROUTES) >= 40 * FUZZ_SCALE, f"too few valid requests: {tally}"
    health = real_instance.loop.request("GET", real_instance.url + "/health")
    assert health.status == 200, health
    deadline = time.monotonic() + 10
    while True:
        m = real_instance.metrics()
        idle = (m.get("num_requests_running"), m.get("num_requests_waiting"), m.get("kv_cache_usage_perc"))
        if idle == (0.0, 0.0, 0.0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle == (0.0, 0.0, 0.0), f"running, waiting, KV usage after the fuzz: {idle}"
    assert real_instance.server.num_in_flight == 0
    body = s.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    answer = real_instance.loop.request("POST", real_instance.url + "/v1/completions", body)
    check_answer(answer, "/v1/completions", body)
    assert answer.status == 200 and json.loads(answer.body)["usage"]["completion_tokens"] >= 1, answer
    findings = errors.findings(since=real_instance.num_log_records)
    assert not findings, findings


# ----------------------------------------------------------------------------- findings
# Product bugs this fuzzer found, fixed since (pdserve/http_guard.py): each test failed before its fix.

def _findings(answers) -> list[str]:
    failures = []
    for route, request, answer in answers:
        try:
            check_answer(answer, route, request)
        except AssertionError as e:
            failures.append(str(e))
    return failures


@pytest.mark.timeout(30)
def test_found_a_body_that_lies_about_its_content_encoding_is_a_json_400(instance):
    """FINDING content-encoding, pdserve/server/app.py OpenAIServer._read_body (`body = await request.read()`):
    a body that is not what its Content-Encoding says makes aiohttp raise RequestPayloadError ("Can not
    decode content-encoding: gzip"), which nothing maps to a 400, so the middleware's catch-all answers
    500 "internal server error" and logs a traceback, on every POST route. Reproducer:
        curl -H 'Content-Encoding: gzip' -H 'Content-Type: application/json' \\
             -d '{"prompt": "hello", "max_tokens": 1}' http://127.0.0.1:PORT/v1/completions   -> 500
    Fix: in _read_body, `except web_protocol.RequestPayloadError as e: raise ProtocolError(400, "the request
    body could not be read: it is not what its Content-Encoding says")` (aiohttp.web_protocol)."""
    body = b'{"prompt": "hello", "max_tokens": 1}'
    headers = {"Authorization": f"Bearer {s.API_KEY}", s.ROUTER_KEY_HEADER: s.ROUTER_KEY,
               "Content-Type": "application/json"}
    answers = [(route, body, instance.loop.request("POST", instance.url + route, body,
                                                   {**headers, "Content-Encoding": encoding}))
               for route in POST_ROUTES for encoding in ("gzip", "deflate")]
    assert not _findings(answers), _findings(answers)


@pytest.mark.timeout(30)
def test_found_an_unknown_expect_header_is_a_json_417(instance):
    """FINDING expect, pdserve/server/app.py build_app (routes added without an expect_handler): aiohttp's
    default expect handler runs before the middleware and answers any Expect but 100-continue with a
    text/plain 417 "Unknown Expect: <the header>", and one whose bytes are not UTF-8 with a text/plain 500
    ("Server got itself in trouble", UnicodeEncodeError building that 417, traceback in the log).
    Reproducer:
        printf 'POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\nExpect: \\x80\\r\\n' > req
        printf 'Content-Length: 2\\r\\n\\r\\n{}' >> req; nc -q 1 127.0.0.1 PORT < req
        -> HTTP/1.1 500 Internal Server Error, text/plain
    Fix: build_app passes expect_handler= to every route: 100-continue as aiohttp does (write
    b"HTTP/1.1 100 Continue\\r\\n\\r\\n"), anything else `return json_error(417, "Expect: only 100-continue is
    supported")`."""
    body = b'{"prompt": "hello", "max_tokens": 1}'
    answers = []
    for route in (*POST_ROUTES, *GET_ROUTES):
        method = "GET" if route in GET_ROUTES else "POST"
        for expect in (b"foo", b"\x80"):
            lines = [(b"Authorization", f"Bearer {s.API_KEY}".encode()), (b"Expect", expect)]
            answers.append((route, body, instance.loop.raw(instance.port, raw_request(method, route, body, lines,
                                                                                      len(body)))))
    assert not _findings(answers), _findings(answers)
