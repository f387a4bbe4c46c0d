"""Fake prefill / decode / colocated instances and the proxy, all in-process on 127.0.0.1.

Servers run on an event loop in a background thread, so tests can drive them with blocking clients
(the official openai client, urllib) from the test thread.
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from pdserve import protocol
from pdserve.http_guard import runner_args
from pdserve.router.proxy import build_proxy_app

MODEL = "fake-model"
# For tests of a request meeting a dead backend: the monitor would otherwise eject it after three polls
# (0.3 s), and whether the request still meets it would depend on the machine's speed.
NEVER_EJECT = 1_000_000
PIECES = ["Hello", " from", " D"]          # what a decode instance generates
TOKEN_IDS = [11, 12, 13]                   # ... as tokens
D_USAGE = protocol.usage(7, len(PIECES))   # D saw the whole prompt
P_USAGE = protocol.usage(7, 1)


@dataclass
class Received:
    path: str
    headers: dict
    body: dict
    at: float = field(default_factory=time.monotonic)   # when the fake received it


@dataclass
class FakeBackend:
    """One instance. role: prefill | decode | colocated. mode picks a behaviour (see handle and stream).
    A stream reports its tokens as a pdserve instance does when asked (router_token_ids, return_token_ids)
    and takes `resume` as one does: it checks the tokens and goes on after them."""
    role: str
    mode: str = "ok"
    url: str = ""
    received: list[Received] = field(default_factory=list)
    sent: bytearray = field(default_factory=bytearray)   # raw bytes of the last streamed answer
    disconnected: threading.Event = field(default_factory=threading.Event)
    problems: list[str] = field(default_factory=list)     # what the fake found wrong in its requests
    releases: list[dict] = field(default_factory=list)    # bodies of POST /v1/kv/release
    load: dict = field(default_factory=dict)              # fields of GET /v1/load over the defaults
    boot_id: str = "boot-1"
    num_polls: int = 0
    load_mode: str = "ok"        # GET /v1/load: ok, http500 (an error status), hang (no answer for 5 s)
    kv_cached: list = field(default_factory=list)   # block hashes in the fake's prefix cache ...
    kv_seq: int = 0                                  # ... as of this event sequence number

    @property
    def kv_transfer_params(self) -> dict:
        """What this instance hands out as prefill (D checks it gets exactly this)."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.url,
                "remote_request_id": "r-1", "remote_block_ids": [3, 4], "remote_host": "127.0.0.1",
                "remote_port": 5555, "tp_size": 1}

    def check(self, is_ok: bool, what: str) -> None:
        if not is_ok:
            self.problems.append(what)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(Received(request.path, request.headers.copy(), body))
        is_chat = request.path.endswith("/chat/completions")
        if self.mode in ("http500", "http400", "http401", "http503"):
            status = int(self.mode[4:])
            headers = {"Retry-After": "7"} if status == 503 else None
            return web.json_response(protocol.error_body(f"{self.role} says {status}", status=status), status=status,
                                     headers=headers)
        if slow := re.fullmatch(r"slow_([0-9.]+)s", self.mode):   # slow_1s, slow_0.3s: before answering
            await asyncio.sleep(float(slow.group(1)))
        if self.mode == "slow":  # a long prefill, until the client goes away
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                self.disconnected.set()
                raise
        if self.role == "prefill":
            return self.prefill(body, is_chat)
        if self.role == "decode" and "resume" not in body and "kv_transfer_params" in body:  # else: resumed
            self.check(body["kv_transfer_params"].get("remote_engine_id", "").startswith("http://"),
                       f"decode got kv_transfer_params {body.get('kv_transfer_params')}")
        if self.mode == "silent":
            await asyncio.sleep(5)
        if body.get("stream"):
            return await self.stream(request, body, is_chat)
        make = protocol.chat_response if is_chat else protocol.completion_response
        return web.json_response(make("id-d", MODEL, "".join(PIECES), "stop", D_USAGE))

    def prefill(self, body: dict, is_chat: bool) -> web.Response:
        params = body.get("kv_transfer_params") or {}
        if self.load.get("kv_connector"):  # push: one transfer id per request, nothing else
            self.check(set(params) == {"do_remote_decode", "transfer_id"} and params["do_remote_decode"] is True,
                       f"push prefill kv_transfer_params {params}")
        else:
            self.check(params == {"do_remote_decode": True}, "prefill kv_transfer_params")
        self.check(body.get("stream") is False, "prefill stream")
        self.check("stream_options" not in body, "prefill got stream_options")
        make = protocol.chat_response if is_chat else protocol.completion_response
        params = None if self.mode == "no_kv" else self.kv_transfer_params
        return web.json_response(make("id-p", MODEL, "P!", "length", P_USAGE, kv_transfer_params=params))

    async def stream(self, request: web.Request, body: dict, is_chat: bool) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        self.sent.clear()

        async def send(data: bytes) -> None:
            self.sent += data
            await out.write(data)

        try:
            if self.mode == "endless":  # until the client goes away
                while True:
                    await send(protocol.sse_event(protocol.completion_chunk("id-d", MODEL, 0, "x")))
                    await asyncio.sleep(0.02)
            stream_id = f"id-d-{self.url[-5:]}"   # each instance its own, as pdserve instances
            resume = body.get("resume")
            first = 0
            if resume is not None:
                first = resume["num_tokens"]
                self.check(resume["token_ids"] == TOKEN_IDS[:first] and 0 < first < len(PIECES), f"resume {resume}")
                self.check("kv_transfer_params" not in body, "a resumed hop carried kv_transfer_params")
            with_ids, with_router_ids = body.get("return_token_ids") is True, body.get("router_token_ids") is True
            # die_after_K (the connection drops), error_after_K (a 500 error event), deadline_after_K (a 504
            # one): after K token chunks of this answer; "+no_ids": reports no router_token_ids
            failure = re.search(r"(die|error|deadline)_after_(\d+)", self.mode)
            die_after = 1 if self.mode == "die_mid_stream" else int(failure.group(2)) if failure else None
            for i in range(first, len(PIECES)):
                piece, ids = PIECES[i], [TOKEN_IDS[i]] if with_ids else None
                if is_chat:
                    delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
                    chunk = protocol.chat_chunk(stream_id, MODEL, 0, delta, token_ids=ids)
                else:
                    chunk = protocol.completion_chunk(stream_id, MODEL, 0, piece, token_ids=ids)
                if with_router_ids and "no_ids" not in self.mode:
                    chunk["router_token_ids"] = [TOKEN_IDS[i]]
                await send(protocol.sse_event(chunk))
                if self.mode == "slow_stream":   # a stream that takes a while: 0.15 s after each token
                    await asyncio.sleep(0.15)
                if die_after is not None and i + 1 - first == die_after:
                    if failure and failure.group(1) != "die":   # the instance's own error event
                        code = 504 if failure.group(1) == "deadline" else 500
                        await send(protocol.sse_event(protocol.error_body(f"{self.role} error {code}", status=code)))
                        await send(protocol.SSE_DONE)
                        await out.write_eof()
                        return out
                    request.transport.close()  # a crash: no final chunk of the chunked encoding
                    return out
            await send(protocol.sse_event(protocol.chat_chunk(stream_id, MODEL, 0, {}, "stop") if is_chat
                                          else protocol.completion_chunk(stream_id, MODEL, 0, "", "stop")))
            if (body.get("stream_options") or {}).get("include_usage"):
                await send(protocol.sse_event(protocol.usage_chunk(stream_id, MODEL, 0, D_USAGE, chat=is_chat)))
            await send(protocol.SSE_DONE)
            await out.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        return out

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def load_report(self, request: web.Request) -> web.Response:
        """GET /v1/load as a pdserve instance answers it: its role, its cache (kv_cached: a snapshot when the
        router's events_after is not kv_seq, else no new events), and `load` on top."""
        self.num_polls += 1
        if self.load_mode == "http500":
            return web.json_response(protocol.error_body("load says 500", status=500), status=500)
        if self.load_mode == "hang":
            await asyncio.sleep(5)
        kv_role = {"prefill": "producer", "decode": "consumer", "colocated": None}[self.role]
        in_sync = request.query.get("events_after") == str(self.kv_seq)
        events = {"last_seq": self.kv_seq, "reset": not in_sync, "snapshot": None if in_sync else list(self.kv_cached),
                  "batches": []}
        report = {"boot_id": self.boot_id, "kv_role": kv_role, "healthy": True, "health": "ok",
                  "block_size": 16, "hash_extra": "", "num_blocks": 1000, "num_free_blocks": 1000,
                  "kv_events": events}
        report.update(self.load)
        return web.json_response(report)

    async def release(self, request: web.Request) -> web.Response:
        self.releases.append(await request.json())
        return web.json_response({"status": "accepted"}, status=202)

    async def tokenize(self, request: web.Request) -> web.Response:
        self.received.append(Received(request.path, request.headers.copy(), await request.json()))
        return web.json_response({"count": 2, "max_model_len": 2048, "tokens": [1, 2]})

    async def models(self, request: web.Request) -> web.Response:
        self.received.append(Received(request.path, request.headers.copy(), {}))
        return web.json_response(protocol.models_response(MODEL, 2048))

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/load", self.load_report)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/kv/release", self.release)
        return app


class Harness:
    """Starts fake backends and a proxy on the background loop; stops them all at teardown."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.runners: list[web.AppRunner] = []
        self.backends: list[FakeBackend] = []
        self.proxy_app: web.Application | None = None

    def run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, app: web.Application) -> str:
        # handler_cancellation as in run_proxy: a client disconnect cancels the handler
        runner = web.AppRunner(app, access_log=None, **runner_args())   # as `pdserve proxy` runs it
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    def backend(self, role: str, mode: str = "ok") -> FakeBackend:
        backend = FakeBackend(role, mode)
        backend.url = self.run(self._start(backend.app()))
        self.backends.append(backend)
        return backend

    def proxy(self, prefill=(), decode=(), colocated=None, **kwargs) -> str:
        urls = [[b if isinstance(b, str) else b.url for b in pool] for pool in (prefill, decode, colocated or ())]
        kwargs.setdefault("policy", "round-robin")   # the mechanics under test, in an order the test can know
        self.proxy_app = build_proxy_app(urls[0], urls[1], urls[2] or None, **kwargs)
        return self.run(self._start(self.proxy_app))

    async def _cleanup(self) -> None:
        for runner in reversed(self.runners):
            await runner.cleanup()


def dead_url() -> str:
    """A port nothing listens on: connection refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def unaccepting_url():
    """A port that listens but never accepts: its one-slot backlog is full, so a new connection's SYN is
    dropped and connecting times out (a host that is down, or a server too busy to accept)."""
    with socket.socket() as server, socket.socket() as filler:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        filler.connect(server.getsockname())
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


@pytest.fixture(scope="session")
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


@pytest.fixture
def harness(loop):
    harness = Harness(loop)
    yield harness
    harness.run(harness._cleanup())
    problems = [p for b in harness.backends for p in b.problems]
    assert not problems, problems  # leak check of sorts: no fake saw a malformed hop


def post_raw(url: str, path: str, body: dict, headers: dict | None = None, timeout: float = 10.0):
    """POST with urllib; returns (status, headers, raw body bytes) for any status."""
    import urllib.error
    import urllib.request
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def get_raw(url: str, path: str, timeout: float = 10.0):
    """GET with urllib, the path sent as written (percent-escapes kept); (status, headers, raw body)."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path), timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()
