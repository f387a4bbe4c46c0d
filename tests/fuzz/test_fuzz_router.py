"""Fuzzing the router's front door (build_proxy_app): one request must never take it down.

Three set-ups, all in-process on 127.0.0.1:
  pd:        the proxy over two fake P and one fake D (tests/router/conftest.py's FakeBackend)
  colocated: the proxy over two fake colocated instances
  stack:     the proxy over a real P and D instance (build_app over FakeEngines), so the instances'
             own 400s travel back through it
Thousands of fuzzed bodies and headers; every answer has the properties of tests/fuzz/common.py and
names no backend address. Afterwards: the proxy's requests_in_flight gauge is 0, and no backend ever saw
a client's kv_transfer_params (P's hop carries exactly {"do_remote_decode": true}, D's what P answered,
a colocated instance none) or a client's Authorization.
"""
from __future__ import annotations

import json
import time
import zlib

import pytest
from aiohttp import web
from hypothesis import given, strategies as st

from pdserve.config import ServerConfig
from pdserve.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from pdserve.router.proxy import PROXY_KEY, build_proxy_app
from pdserve.server.app import SERVER_KEY, build_app
from tests.router.conftest import FakeBackend, Harness, Received
from tests.server.fake_engine import WORDS

from . import strategies as s
from .common import (GENERATION_ROUTES, MAX_BODY_BYTES, MAX_MODEL_LEN, MAX_PROMPT_CHARS, TOKENIZER, VOCAB_SIZE,
                     FuzzEngine, LoopThread, Tally, check_answer, fuzz_settings, raw_request)

PASSTHROUGH_ROUTES = ("/v1/models", "/tokenize", "/detokenize")
OPEN_ROUTES = ("/health", "/metrics")
ROUTES = (*GENERATION_ROUTES, *PASSTHROUGH_ROUTES, *OPEN_ROUTES)
METHODS = {"/v1/models": "GET", "/health": "GET", "/metrics": "GET"}   # the others are POST


class FuzzBackend(FakeBackend):
    """A FakeBackend that checks a generation body with the instances' own schemas first (the fake itself
    reads fields such as stream_options as the schema would have them), and answers POST /detokenize."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        schema = ChatCompletionRequest if request.path.endswith("/chat/completions") else CompletionRequest
        try:
            schema.from_json(await request.json())
        except ProtocolError as e:
            self.received.append(Received(request.path, request.headers.copy(), await request.json()))
            return web.json_response(e.to_dict(), status=e.status)
        return await super().handle(request)

    async def detokenize(self, request: web.Request) -> web.Response:
        self.received.append(Received(request.path, request.headers.copy(), await request.json()))
        return web.json_response({"prompt": "hello"})

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/detokenize", self.detokenize)
        return app


class Router:
    """One proxy and its backends, started on the shared loop."""

    def __init__(self, harness: Harness, mode: str) -> None:
        self.harness, self.mode = harness, mode
        self.backends: list[FuzzBackend] = []
        self.engines: list[FuzzEngine] = []
        self.instance_servers: list = []
        urls: dict[str, list[str]] = {"prefill": [], "decode": [], "colocated": []}
        if mode == "stack":   # real instances over fake engines, holding the router key
            for role in ("prefill", "decode"):
                engine = FuzzEngine(tokenizer=TOKENIZER, token_delay_s=0, vocab_size=VOCAB_SIZE,
                                    max_model_len=MAX_MODEL_LEN, served_model_name="fake-model",
                                    kv_transfer_params_out=P_PARAMS if role == "prefill" else None)
                app = build_app(engine, ServerConfig(router_key=s.ROUTER_KEY, max_body_bytes=MAX_BODY_BYTES))
                urls[role].append(harness.run(harness._start(app)))
                self.engines.append(engine)
                self.instance_servers.append(app[SERVER_KEY])
        else:
            roles = ("prefill", "prefill", "decode") if mode == "pd" else ("colocated", "colocated")
            for role in roles:
                backend = FuzzBackend(role)
                backend.url = harness.run(harness._start(backend.app()))
                self.backends.append(backend)
                urls[role].append(backend.url)
        self.app = build_proxy_app(urls["prefill"], urls["decode"], urls["colocated"] or None, api_key=s.API_KEY,
                                   router_key=s.ROUTER_KEY, max_body_bytes=MAX_BODY_BYTES)
        self.url = harness.run(harness._start(self.app))
        self.port = int(self.url.rsplit(":", 1)[1])
        self.proxy = self.app[PROXY_KEY]
        ports = [u.rsplit(":", 1)[1] for pool in urls.values() for u in pool]
        self.addresses = tuple(f"{host}:{port}" for port in ports for host in ("127.0.0.1", "localhost"))
        self.tally = Tally()

    def send(self, loop: LoopThread, method: str, route: str, body: bytes | None, headers: dict) -> None:
        answer = loop.request(method, self.url + route, body, headers)
        self.tally.add(route, answer)
        if method == "HEAD":
            assert answer.error is None and answer.status < 500, (route, answer)
            return
        check_answer(answer, route, body or b"", backend_addresses=self.addresses,
                     secrets=() if s.ROUTER_KEY in json.dumps(headers) else (s.ROUTER_KEY,))
        # HTTP drops the spaces around a header value; the scheme "Bearer" is case-insensitive (RFC 7235)
        scheme, _, token = headers.get("Authorization", "").strip(" \t").partition(" ")
        is_client = scheme.lower() == "bearer" and token == s.API_KEY
        if route in ROUTES and route not in OPEN_ROUTES and method == METHODS.get(route, "POST") and not is_client:
            assert answer.status == 401, f"{route} without the api key answered {answer.status}"

    def gauge_in_flight(self, loop: LoopThread) -> float:
        text = loop.request("GET", self.url + "/metrics").body.decode()
        return float(next(line.split()[1] for line in text.splitlines()
                          if line.startswith("pdserve:proxy_requests_in_flight ")))

    def leaks(self, loop: LoopThread) -> list[str]:
        """In-flight requests, or hops that carried what they must not."""
        problems = []
        deadline = time.monotonic() + 3
        while (self.proxy.num_in_flight or any(e.running for e in self.engines)) and time.monotonic() < deadline:
            time.sleep(0.01)
        if (gauge := self.gauge_in_flight(loop)) != 0 or self.proxy.num_in_flight:
            problems.append(f"requests_in_flight {gauge}, num_in_flight {self.proxy.num_in_flight}")
        p_params = [b.kv_transfer_params for b in self.backends if b.role == "prefill"]
        for backend in self.backends:
            problems += backend.problems
            for received in backend.received:
                if "Authorization" in received.headers:
                    problems.append(f"{backend.role} got the client's Authorization")
                if received.headers.get(s.ROUTER_KEY_HEADER) != s.ROUTER_KEY:
                    problems.append(f"{backend.role} did not get the router key")
                if received.path not in GENERATION_ROUTES:
                    continue
                params = received.body.get("kv_transfer_params", "absent")
                expected = {"prefill": [{"do_remote_decode": True}], "decode": p_params,
                            "colocated": ["absent"]}[backend.role]
                if params not in expected:
                    problems.append(f"{backend.role} got kv_transfer_params {params!r:.200}")
        for engine, expected in zip(self.engines, ({"do_remote_decode": True}, P_PARAMS)):   # stack: P, D
            problems += engine.leaks()
            problems += [f"an instance got kv_transfer_params {c.kv_transfer_params!r:.200}"
                         for c in engine.calls if c.kv_transfer_params != expected]
        for server in self.instance_servers:
            if server.num_in_flight:
                problems.append(f"an instance has {server.num_in_flight} requests in flight")
        return problems


P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
            "remote_request_id": "r-1", "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 1,
            "tp_size": 1}


@pytest.fixture(scope="module")
def harness(loop):
    harness = Harness(loop.loop)
    yield harness
    harness.run(harness._cleanup())


@pytest.fixture(scope="module")
def routers(harness):
    routers = {mode: Router(harness, mode) for mode in ("pd", "colocated", "stack")}
    yield routers
    print("\n" + "\n".join(f"router {mode}: {r.tally}" for mode, r in routers.items()))


@pytest.fixture
def after(routers, loop, errors):
    num_records = len(errors.records)
    yield
    for mode, router in routers.items():
        problems = router.leaks(loop)
        assert not problems, (mode, problems)
    new = errors.findings(since=num_records)
    assert not new, new


def generation_body(route: str) -> st.SearchStrategy:
    if route == "/v1/completions":
        return s.completion_requests(WORDS, VOCAB_SIZE, MAX_PROMPT_CHARS, MAX_MODEL_LEN)
    return s.chat_requests(WORDS)


COMPLETIONS, CHATS = generation_body("/v1/completions"), generation_body("/v1/chat/completions")
ANY_GENERATION = st.one_of(COMPLETIONS, CHATS)


@pytest.mark.timeout(120)
@fuzz_settings(700)
@given(mode=st.sampled_from(("pd", "pd", "colocated", "stack")), route=st.sampled_from(GENERATION_ROUTES),
       data=st.data(), headers=s.headers())
def test_generation_routes_fuzzed_requests(routers, loop, after, mode, route, data, headers):
    """Plausible fields with random values, kv_transfer_params included (the router must drop them)."""
    body = data.draw(COMPLETIONS if route == "/v1/completions" else CHATS, "body")
    routers[mode].send(loop, "POST", route, s.dumps(body), headers)


@pytest.mark.timeout(120)
@fuzz_settings(400)
@given(mode=st.sampled_from(("pd", "colocated", "stack")), route=st.sampled_from(GENERATION_ROUTES + ("/tokenize",
                                                                                                     "/detokenize")),
       body=s.raw_bodies(ANY_GENERATION, MAX_BODY_BYTES), headers=s.headers())
def test_raw_bodies(routers, loop, after, mode, route, body, headers):
    """Bytes that are not JSON, not UTF-8, not an object, too deep, too large, numbers past every bound."""
    routers[mode].send(loop, "POST", route, body, headers)


@pytest.mark.timeout(90)
@fuzz_settings(400)
@given(mode=st.sampled_from(("pd", "colocated", "stack")), route=st.sampled_from(ROUTES + ("/v1/kv/release", "/x")),
       method=st.sampled_from(("GET", "POST", "POST", "PUT", "DELETE", "HEAD")), data=st.data(), headers=s.headers())
def test_every_route_every_method(routers, loop, after, mode, route, method, data, headers):
    """The passthrough routes (/v1/models, /tokenize, /detokenize), /health and /metrics with fuzzed
    bodies and headers; every route with the wrong method too."""
    body = data.draw(st.one_of(
        st.none(), ANY_GENERATION.map(s.dumps), s.json_values.map(s.dumps), st.binary(max_size=20),
        st.fixed_dictionaries({"tokens": st.one_of(st.lists(st.integers(0, 20), max_size=4), s.json_values)},
                              optional={"model": s.json_values}).map(s.dumps)), "body")
    routers[mode].send(loop, method, route, body, headers)


@pytest.mark.timeout(90)
@fuzz_settings(300)
@given(mode=st.sampled_from(("pd", "colocated", "stack")), route=st.sampled_from(ROUTES), extra=s.raw_headers,
       auth=st.one_of(st.just(b"Bearer " + s.API_KEY.encode()), s.raw_header_values),
       request_id=st.one_of(st.none(), s.raw_header_values), content_type=st.one_of(st.none(), s.raw_header_values),
       body=st.one_of(st.just(b'{"prompt": "hello world", "max_tokens": 2}'), COMPLETIONS.map(s.dumps)))
def test_odd_headers_on_a_raw_socket(routers, loop, after, mode, route, extra, auth, request_id, content_type, body):
    """Header bytes that are not UTF-8, huge, control characters; an X-Request-Id the router forwards to
    every hop. What aiohttp's parser refuses must be a 4xx; all the rest must have every property."""
    router = routers[mode]
    lines = [(b"Authorization", auth)] + ([(b"X-Request-Id", request_id)] if request_id is not None else []) + \
            ([(b"Content-Type", content_type)] if content_type is not None else []) + extra
    method = METHODS.get(route, "POST")
    answer = loop.raw(router.port, raw_request(method, route, body, lines, len(body)))
    router.tally.add(f"raw {route}", answer)
    is_http = s.is_plain_http(lines, extra)
    if answer is not None and answer.content_type != "application/json" and not is_http:
        assert 400 <= answer.status < 500, (lines, answer)   # aiohttp's answer to bytes that are not HTTP
    else:
        check_answer(answer, route, body, backend_addresses=router.addresses, allow_no_answer=not is_http)
    health = loop.request("GET", router.url + "/health")
    assert health.status == 200, health


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["pd", "colocated", "stack"])
def test_gzip_bomb_is_refused(routers, loop, after, mode):
    """A body of 100 KB that inflates to 100 MB: compressed bodies are refused unread (415), no backend
    sees it."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)   # 31: the gzip format
    bomb = compressor.compress(b'{"prompt": "' + b"a" * (100 << 20) + b'"}') + compressor.flush()
    headers = {"Authorization": f"Bearer {s.API_KEY}", "Content-Encoding": "gzip", "Content-Type": "application/json"}
    for route in (*GENERATION_ROUTES, "/tokenize", "/detokenize"):
        answer = loop.request("POST", routers[mode].url + route, bomb, headers)
        check_answer(answer, route, b"", backend_addresses=routers[mode].addresses)
        assert answer.status == 415, answer


# ----------------------------------------------------------------------------- findings
# Product bugs this fuzzer found, fixed since (pdserve/http_guard.py): each test failed before its fix.

def _findings(router: Router, answers) -> list[str]:
    failures = []
    for route, request, answer in answers:
        try:
            check_answer(answer, route, request, backend_addresses=router.addresses)
        except AssertionError as e:
            failures.append(str(e))
    return failures


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_found_the_router_answers_a_body_that_lies_about_its_encoding_with_a_json_400(routers, loop, mode):
    """FINDING content-encoding (router), pdserve/router/proxy.py Proxy.read_body (`data = await
    request.read()`): a body that is not what its Content-Encoding says raises aiohttp's RequestPayloadError,
    which read_body does not catch and the json_errors middleware (web.HTTPException only) lets through:
    aiohttp answers a text/plain "500 Internal Server Error" (traceback in the log) on /v1/completions,
    /v1/chat/completions, /tokenize and /detokenize. Reproducer:
        curl -H 'Authorization: Bearer KEY' -H 'Content-Encoding: gzip' -d '{"prompt": "hi"}' \\
             http://127.0.0.1:8000/v1/completions   -> 500 text/plain
    Fix: read_body: `except web_protocol.RequestPayloadError: raise ClientError(400, "the request body could
    not be read: it is not what its Content-Encoding says")`; and in the json_errors middleware a catch-all
    (`except Exception`: log it, answer json_error 500) as OpenAIServer.middleware has."""
    router = routers[mode]
    body = b'{"prompt": "hello", "max_tokens": 1}'
    headers = {"Authorization": f"Bearer {s.API_KEY}", "Content-Encoding": "gzip"}
    answers = [(route, body, loop.request("POST", router.url + route, body, headers))
               for route in (*GENERATION_ROUTES, "/tokenize", "/detokenize")]
    assert not _findings(router, answers), _findings(router, answers)


@pytest.mark.timeout(30)
def test_found_the_router_answers_an_unknown_expect_header_with_a_json_417(routers, loop):
    """FINDING expect (router), pdserve/router/proxy.py build_proxy_app (routes added without an
    expect_handler; the json_errors middleware never sees it): aiohttp's default expect handler runs before
    any middleware and answers an Expect other than 100-continue with a text/plain 417 "Unknown Expect: ...",
    and one whose bytes are not UTF-8 with a text/plain 500 (UnicodeEncodeError while building that 417,
    traceback in the log). Reproducer:
        printf 'POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\nExpect: \\x80\\r\\n' > req
        printf 'Content-Length: 2\\r\\n\\r\\n{}' >> req; nc -q 1 127.0.0.1 8000 < req
        -> HTTP/1.1 500 Internal Server Error, text/plain
    Fix: an expect_handler on every route (as for the instance), answering OpenAI-style JSON."""
    router = routers["pd"]
    body = b'{"prompt": "hello", "max_tokens": 1}'
    answers = []
    for route in ROUTES:
        for expect in (b"foo", b"\x80"):
            lines = [(b"Authorization", f"Bearer {s.API_KEY}".encode()), (b"Expect", expect)]
            answers.append((route, body, loop.raw(router.port, raw_request(METHODS.get(route, "POST"), route, body,
                                                                          lines, len(body)))))
    assert not _findings(router, answers), _findings(router, answers)
