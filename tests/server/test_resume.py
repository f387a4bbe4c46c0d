"""The resume extension (the router's stream recovery): a request carrying the tokens another instance
generated before it died goes on from there. Over a FakeEngine: the plumbing, the router key, the
bounds. Over a real tiny engine: the resumed stream is the rest of the uninterrupted one, greedy and
seeded, text and usage included."""
from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from pdserve.server.app import ROUTER_KEY_HEADER, start_server

from .fake_engine import FakeEngine, make_tiny_tokenizer

pytestmark = pytest.mark.timeout(120)

ROUTER_KEY = "router-secret"
ROUTER = {ROUTER_KEY_HEADER: ROUTER_KEY}
TOKENIZER = make_tiny_tokenizer()


@contextlib.asynccontextmanager
async def serving(engine, **config):
    runner, port = await start_server(engine, "127.0.0.1", 0, ServerConfig(**config))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict | list]:
    """The JSON answer, or for a stream the list of its events' payloads (the last is "[DONE]")."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body, headers=headers) as resp:
            raw = await resp.read()
            if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
                return resp.status, [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]
            return resp.status, json.loads(raw)


def resume(token_ids: list[int]) -> dict:
    return {"token_ids": token_ids, "num_tokens": len(token_ids)}


def test_a_resumed_stream_goes_on_and_counts_every_token():
    engine = FakeEngine(tokenizer=TOKENIZER)
    chat = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}

    async def main():
        async with serving(engine, router_key=ROUTER_KEY) as url:
            whole = await post(url, "/v1/chat/completions", chat, ROUTER)
            resumed = await post(url, "/v1/chat/completions", dict(chat, resume=resume([7, 8])), ROUTER)
            return whole, resumed

    (s1, whole), (s2, resumed) = asyncio.run(main())
    assert s1 == s2 == 200
    assert whole[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # no second role chunk: the stream it continues had one
    assert all("role" not in e["choices"][0]["delta"] for e in resumed[:-2])
    def text(events):
        return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e != "[DONE]" and e["choices"])
    assert text(resumed) == "".join(text(whole).split(" ", 2)[2:]) and resumed[-1] == "[DONE]"
    assert engine.calls[1].resumed_token_ids == [7, 8]
    assert engine.calls[1].prompt_token_ids == engine.calls[0].prompt_token_ids   # the template, as before
    assert engine.calls[1].params.max_tokens == 6   # the engine counts the resumed tokens against it
    assert resumed[-2]["usage"]["completion_tokens"] == whole[-2]["usage"]["completion_tokens"] == 6
    assert resumed[-2]["usage"]["prompt_tokens"] == whole[-2]["usage"]["prompt_tokens"]


BAD_RESUMES = [
    ({"token_ids": [1, 2], "num_tokens": 3}, "num_tokens is 3"),
    ({"token_ids": [], "num_tokens": 0}, "resume"),
    ({"token_ids": [1, -2], "num_tokens": 2}, "resume.token_ids[1]"),
    ({"token_ids": [1, 2**31], "num_tokens": 2}, "resume.token_ids[1]"),
    ({"token_ids": [True], "num_tokens": 1}, "resume.token_ids[0]"),
    ({"token_ids": ["1"], "num_tokens": 1}, "resume.token_ids[0]"),
    ({"token_ids": [1], "num_tokens": 1, "seed_offset": 3}, "resume.seed_offset"),
    ({"token_ids": [1]}, "resume.num_tokens"),
    ([1, 2], "resume"),
    ({"token_ids": [1, 2, 3, 4], "num_tokens": 4}, "4 tokens already generated, max_tokens is 4"),
    ({"token_ids": [1, 500], "num_tokens": 2}, "out of the vocabulary"),
]


@pytest.mark.parametrize("bad,message", BAD_RESUMES)
def test_a_malformed_resume_is_a_400_naming_it(bad, message):
    engine = FakeEngine(tokenizer=TOKENIZER, vocab_size=100)

    async def main():
        async with serving(engine, router_key=ROUTER_KEY) as url:
            return await post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 4, "resume": bad}, ROUTER)

    status, body = asyncio.run(main())
    assert status == 400 and message in body["error"]["message"], body
    assert body["error"]["param"].startswith("resume") and engine.calls == []


def test_only_the_router_may_resume_and_never_with_kv_transfer_params():
    engine = FakeEngine(tokenizer=TOKENIZER)
    body = {"prompt": "hello", "max_tokens": 4, "resume": resume([5])}

    async def main():
        async with serving(engine, api_key="client-key", router_key=ROUTER_KEY) as url:
            return [await post(url, "/v1/completions", body, {"Authorization": "Bearer client-key"}),
                    await post(url, "/v1/completions", dict(body, kv_transfer_params={"do_remote_decode": True}),
                               ROUTER),
                    await post(url, "/v1/completions", body, ROUTER)]

    (s1, a1), (s2, a2), (s3, a3) = asyncio.run(main())
    assert s1 == 403 and a1["error"]["param"] == "resume"
    assert s2 == 400 and a2["error"]["param"] == "resume"
    assert s3 == 200 and len(engine.calls) == 1 and engine.calls[0].resumed_token_ids == [5]
    assert a3["usage"]["completion_tokens"] == 4   # the resumed token counts


# ----------------------------------------------------------------------------- a real engine

@pytest.fixture(scope="module")
def tiny_engine_url(tmp_path_factory):
    """A real engine (tiny random Llama, byte-level tokenizer: text full of split multi-byte characters)
    behind the server, on a loop in a thread."""
    import threading

    from pdserve.engine.async_engine import AsyncEngine
    from tests.helpers_models import make_tiny_hf_model

    config = EngineConfig(model=ModelConfig(model=make_tiny_hf_model(tmp_path_factory.mktemp("m"), "llama")),
                          cache=CacheConfig(kv_cache_memory=8 << 20), num_threads=1)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    call = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(120)  # noqa: E731
    engine = AsyncEngine(config, served_model_name="tiny")
    call(engine.start())
    runner, port = call(start_server(engine, "127.0.0.1", 0, ServerConfig(router_key=ROUTER_KEY)))
    yield f"http://127.0.0.1:{port}"
    call(runner.cleanup())
    call(engine.shutdown())
    loop.call_soon_threadsafe(loop.stop)


def stream_of(url: str, body: dict) -> tuple[list[int], str, dict, list[str]]:
    """(token ids, text, usage, finish reasons) of one stream."""
    status, events = asyncio.run(post(url, "/v1/completions", dict(body, stream=True, return_token_ids=True,
                                                                   stream_options={"include_usage": True}),
                                      ROUTER))
    assert status == 200 and events[-1] == "[DONE]", events
    chunks = [e for e in events[:-1] if e["choices"]]
    return ([t for c in chunks for t in c["choices"][0]["token_ids"]], "".join(c["choices"][0]["text"] for c in chunks),
            events[-2]["usage"], [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]])


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 42},
                                      {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7}],
                         ids=["greedy", "seeded", "seeded_top_k_top_p"])
def test_resumed_on_a_real_engine_is_the_rest_of_the_uninterrupted_stream(tiny_engine_url, sampling):
    body = {"model": "tiny", "prompt": [3, 70, 101, 108, 108, 111], "max_tokens": 20, "ignore_eos": True, **sampling}
    ids, text, usage, finishes = stream_of(tiny_engine_url, body)
    assert len(ids) == 20 and finishes == ["length"] and usage["completion_tokens"] == 20
    for k in (1, 8, 19):
        first_text = stream_of(tiny_engine_url, dict(body, max_tokens=k))[1]   # what the client had
        rest_ids, rest_text, rest_usage, rest_finishes = stream_of(tiny_engine_url, dict(body, resume=resume(ids[:k])))
        assert rest_ids == ids[k:], (sampling, k)
        assert first_text + rest_text == text, (sampling, k)
        assert rest_finishes == ["length"]
        assert (rest_usage["prompt_tokens"], rest_usage["completion_tokens"]) == (6, 20)


def test_router_token_ids_come_last_in_each_chunk_and_leave_the_clients_field_alone():
    engine = FakeEngine(tokenizer=TOKENIZER)
    body = {"prompt": "hello world", "max_tokens": 3, "stream": True, "router_token_ids": True}

    async def main():
        async with serving(engine) as url:
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    return await resp.read()

    events = [e for e in asyncio.run(main()).split(b"\n\n") if e][:-1]
    assert len(events) == 3
    for i, event in enumerate(events):   # prompt of 2 tokens: outputs 2, 3, 4
        assert event.endswith(b',"router_token_ids":[%d]}' % (i + 2))
        assert "token_ids" not in json.loads(event[6:])["choices"][0]
