"""A fake OpenAI-compatible server for the bench tests, on 127.0.0.1 in a thread of its own.

It streams one SSE chunk per token (or `tokens_per_chunk`): the first after `first_delay_s`, then
every `gap_s`, usage in a last chunk with no choices, then `data: [DONE]`. A request body field
`fake_mode` picks a failure: "http500", "drop" (close the connection mid-stream), "error_event",
"no_done", "no_usage".
"""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web

FIRST_DELAY_S = 0.05
GAP_S = 0.01
MODEL_ID = "fake-model"


class FakeServer:
    model_id = MODEL_ID
    first_delay_s = FIRST_DELAY_S
    gap_s = GAP_S

    def __init__(self) -> None:
        self.port = 0
        self.reset()

    def reset(self) -> None:
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        is_open = [True]

        def finish() -> None:
            if is_open[0]:
                is_open[0] = False
                self.num_in_flight -= 1

        try:
            return await self._stream(request, body, finish)
        finally:
            finish()

    async def _stream(self, request: web.Request, body: dict, finish) -> web.StreamResponse:
        mode = body.get("fake_mode")
        if mode == "http500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        is_chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if is_chat else body["prompt"]
        num_prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        num_tokens = body["max_tokens"]
        per_chunk = body.get("tokens_per_chunk", 1)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(data) -> None:
            await resp.write(f"data: {json.dumps(data)}\n\n".encode())

        await asyncio.sleep(body.get("first_delay_s", FIRST_DELAY_S))
        num_sent = 0
        while num_sent < num_tokens:
            if num_sent:
                await asyncio.sleep(body.get("gap_s", GAP_S))
            n = min(per_chunk, num_tokens - num_sent)
            num_sent += n
            finish_reason = "length" if num_sent == num_tokens else None
            text = " tok" * n
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish_reason} if is_chat
                      else {"index": 0, "text": text, "finish_reason": finish_reason})
            await send({"id": "x", "object": "chunk", "model": MODEL_ID, "choices": [choice], "usage": None})
            if mode == "drop":
                request.transport.close()
                return resp
            if mode == "error_event":
                await send({"error": {"message": "engine died", "type": "internal_error"}})
                return resp
        # out of flight before the last writes: the client may send its next request as soon as
        # [DONE] arrives, possibly before this handler resumes after write_eof
        finish()
        if mode != "no_usage":
            await send({"id": "x", "object": "chunk", "model": MODEL_ID, "choices": [],
                        "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_tokens,
                                  "total_tokens": num_prompt_tokens + num_tokens}})
        if mode != "no_done":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture(scope="session")
def _fake_server_thread():
    server = FakeServer()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner = web.AppRunner(server.app())

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        server.port = runner.addresses[0][1]
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, name="fake-openai-server", daemon=True)
    thread.start()
    assert started.wait(10), "fake server did not start"
    yield server
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture
def fake_server(_fake_server_thread: FakeServer) -> FakeServer:
    _fake_server_thread.reset()
    return _fake_server_thread
