"""The HTTP layer end to end over a FakeEngine: the official openai client, raw HTTP for errors,
and disconnects that must abort the request in the engine."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import openai
import pytest
from aiohttp import web

from pdserve.config import ServerConfig
from pdserve.server import app as app_module
from pdserve.server.app import build_app, start_server

from .fake_engine import FakeEngine, make_tiny_tokenizer

pytestmark = pytest.mark.timeout(30)

TOKENIZER = make_tiny_tokenizer()


@contextlib.asynccontextmanager
async def serving(engine: FakeEngine, **kwargs):
    runner, port = await start_server(engine, "127.0.0.1", 0, ServerConfig(**kwargs))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def openai_client(engine: FakeEngine):
    async with serving(engine) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        try:
            yield client
        finally:
            await client.close()


def run(coro):
    return asyncio.run(coro)


def tiny_engine(**kwargs) -> FakeEngine:
    return FakeEngine(tokenizer=TOKENIZER, **kwargs)


async def wait_until(predicate, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


# ----------------------------------------------------------------------------- openai client

def test_completion_text_prompt():
    engine = tiny_engine()

    async def main():
        async with openai_client(engine) as client:
            return await client.completions.create(model="fake-model", prompt="hello world", max_tokens=3)

    resp = run(main())
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion" and resp.model == "fake-model"
    assert resp.choices[0].text == "t2 t3 t4 " and resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (2, 3, 5)
    assert engine.calls[0].prompt_token_ids == TOKENIZER("hello world").input_ids
    assert engine.calls[0].request_id == resp.id and engine.finished == {resp.id} and not engine.aborted


def test_completion_token_ids_carry_sampling_params():
    engine = FakeEngine()    # no tokenizer: token-id prompts still work

    async def main():
        async with openai_client(engine) as client:
            return await client.completions.create(
                model="fake-model", prompt=[5, 6, 7, 8], max_tokens=10, temperature=0.0, top_p=0.9, seed=7,
                stop=["t9"], extra_body={"top_k": 5, "ignore_eos": True, "stop_token_ids": [3]})

    resp = run(main())
    params = engine.calls[0].params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed, params.top_k) == (10, 0.0, 0.9, 7, 5)
    assert params.stop == ["t9"] and params.ignore_eos and params.stop_token_ids == [3]
    assert resp.choices[0].text == "t4 t5 t6 t7 t8 " and resp.choices[0].finish_reason == "stop"


def test_a_developer_message_is_the_system_message():
    """OpenAI's newer name for the system message: the template, which knows only "system", rendered a
    literal developer turn after its own default system prompt (a hostile-client check)."""
    engine = tiny_engine()

    async def main():
        async with openai_client(engine) as client:
            for role in ("developer", "system"):
                await client.chat.completions.create(
                    model="fake-model", max_completion_tokens=1,
                    messages=[{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}])

    run(main())
    developer, system = (call.prompt_token_ids for call in engine.calls)
    assert developer == system == TOKENIZER.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True, tokenize=True)["input_ids"]


def test_chat_completion_uses_chat_template():
    engine = tiny_engine(num_cached_tokens=2)
    messages = [{"role": "system", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "how are"}, {"type": "text", "text": "you"}]}]

    async def main():
        async with openai_client(engine) as client:
            return await client.chat.completions.create(model="fake-model", messages=messages,
                                                        max_completion_tokens=2)

    resp = run(main())
    expected = TOKENIZER.apply_chat_template(
        [{"role": "system", "content": "hello"}, {"role": "user", "content": "how are\nyou"}],
        add_generation_prompt=True, tokenize=True)["input_ids"]
    assert engine.calls[0].prompt_token_ids == expected
    n = len(expected)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == f"t{n} t{n + 1} " and resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == n and resp.usage.prompt_tokens_details.cached_tokens == 2


def test_chat_without_max_tokens_fills_the_model_length():
    engine = tiny_engine(max_model_len=20, token_delay_s=0)

    async def main():
        async with openai_client(engine) as client:
            return await client.chat.completions.create(model="fake-model",
                                                        messages=[{"role": "user", "content": "hello"}])

    resp = run(main())
    assert engine.calls[0].params.max_tokens == 20 - resp.usage.prompt_tokens
    assert resp.usage.total_tokens == 20


def test_streaming_completion_with_usage():
    engine = tiny_engine()

    async def main():
        async with openai_client(engine) as client:
            stream = await client.completions.create(model="fake-model", prompt="hello world", max_tokens=4,
                                                     stream=True, stream_options={"include_usage": True})
            return [chunk async for chunk in stream]

    chunks = run(main())
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == "t2 t3 t4 t5 " and len(texts) == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, None, None, "length"]
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 6


def test_streaming_chat_starts_with_the_role():
    engine = tiny_engine()

    async def main():
        async with openai_client(engine) as client:
            stream = await client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hello"}], max_tokens=3, stream=True)
            return [chunk async for chunk in stream]

    chunks = run(main())
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content.count("t") == 3 and chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_kv_transfer_params_pass_through():
    out_params = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [1, 2],
                  "remote_host": "10.0.0.1", "remote_port": 5600, "remote_request_id": "cmpl-x"}
    engine = tiny_engine(kv_transfer_params_out=out_params)

    async def main():
        async with openai_client(engine) as client:
            return await client.completions.create(model="fake-model", prompt="hello", max_tokens=1,
                                                   extra_body={"kv_transfer_params": {"do_remote_decode": True}})

    resp = run(main())
    assert engine.calls[0].kv_transfer_params == {"do_remote_decode": True}
    assert resp.model_extra["kv_transfer_params"] == out_params


def test_a_model_is_retrieved_by_its_name_and_an_unknown_one_is_a_404():
    """client.models.retrieve(...) (GET /v1/models/{model}) was a 404 for the served model too (a new-user check)."""
    engine = tiny_engine()

    async def main():
        async with openai_client(engine) as client:
            card = await client.models.retrieve("fake-model")
            try:
                await client.models.retrieve("gpt-4")
            except openai.NotFoundError as e:
                return card, e.body
        raise AssertionError("an unknown model was found")

    card, error = run(main())
    assert (card.id, card.object, card.owned_by) == ("fake-model", "model", "pdserve")
    assert "'gpt-4' does not exist" in error["message"] and error["param"] == "model"


def test_models_health_and_metrics():
    engine = tiny_engine(extra_stats={"num_requests_waiting_for_remote_kvs": 1, "kv_transfer_failures_total": 2})

    async def main():
        async with serving(engine) as url, aiohttp.ClientSession() as http:
            async with http.get(f"{url}/v1/models") as r:
                models = await r.json()
            async with http.get(f"{url}/health") as r:
                healthy = r.status
            engine.healthy = False
            async with http.get(f"{url}/health") as r:
                unhealthy = r.status
            async with http.post(f"{url}/v1/completions", json={"prompt": "hello world", "max_tokens": 3}) as r:
                assert r.status == 200
            async with http.get(f"{url}/metrics") as r:
                return models, healthy, unhealthy, r.headers["Content-Type"], await r.text()

    models, healthy, unhealthy, content_type, text = run(main())
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    assert (healthy, unhealthy) == (200, 503)
    assert content_type.startswith("text/plain")
    for line in ("pdserve:prompt_tokens_total 2.0", "pdserve:generation_tokens_total 3.0",
                 "pdserve:request_success_total 1.0", "pdserve:request_failure_total 0.0",
                 "pdserve:time_to_first_token_seconds_count 1.0", "pdserve:inter_token_latency_seconds_count 2.0",
                 "pdserve:e2e_request_latency_seconds_count 1.0", "pdserve:kv_cache_usage_perc 0.25",
                 "pdserve:prefix_cache_hits_total 4.0", "pdserve:num_requests_waiting_for_remote_kvs 1.0",
                 "pdserve:kv_transfer_failures_total 2.0", 'pdserve:kv_transfer_seconds_bucket{le="+Inf"} 4.0'):
        assert f"\n{line}\n" in text, line


# ----------------------------------------------------------------------------- errors over raw HTTP

async def _post(url: str, path: str, body, headers=None) -> tuple[int, dict]:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, data=data, headers=headers or {"Content-Type": "application/json"}) as r:
            return r.status, await r.json()


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"\xff\xfe", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "hello", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hello", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hello", "model": "gpt-4"}, 404, "model"),   # as OpenAI answers it
    ("/v1/completions", {"prompt": list(range(64))}, 400, "prompt"),            # prompt + 1 > max_model_len
    ("/v1/completions", {"prompt": list(range(60)), "max_tokens": 5}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 70}]}, 400, "messages"),
])
def test_bad_requests_get_openai_errors(path, body, status, param):
    engine = tiny_engine()

    async def main():
        async with serving(engine) as url:
            return await _post(url, path, body)

    got_status, error = run(main())
    assert got_status == status
    assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["param"] == param
    assert error["error"]["code"] == status and error["error"]["message"]
    assert not engine.calls


def test_token_ids_outside_the_vocabulary_are_refused():
    engine = FakeEngine(vocab_size=100)

    async def main():
        async with serving(engine) as url:
            return await _post(url, "/v1/completions", {"prompt": [1, 100], "max_tokens": 1})

    status, error = run(main())
    assert status == 400 and error["error"]["param"] == "prompt" and not engine.calls


def test_concurrent_requests_get_unique_ids_and_leave_nothing_behind():
    engine = tiny_engine()

    async def main():
        async with openai_client(engine) as client:
            return await asyncio.gather(*(client.completions.create(model="fake-model", prompt=[1] * (i + 1),
                                                                    max_tokens=3) for i in range(8)))

    responses = run(main())
    assert len({r.id for r in responses}) == 8
    assert [r.choices[0].text for r in responses][:2] == ["t1 t2 t3 ", "t2 t3 t4 "]
    assert not engine.running and not engine.aborted and len(engine.finished) == 8


def test_text_prompts_need_a_tokenizer():
    engine = FakeEngine()

    async def main():
        async with serving(engine) as url:
            return (await _post(url, "/v1/completions", {"prompt": "hello"}),
                    await _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}))

    (s1, e1), (s2, e2) = run(main())
    assert s1 == s2 == 400 and "token ids" in e1["error"]["message"] and "tokenizer" in e2["error"]["message"]


def test_api_key_unknown_route_and_wrong_method():
    engine = tiny_engine()

    async def main():
        async with serving(engine, api_key="s3cret") as url, aiohttp.ClientSession() as http:
            results = {}
            for name, headers in (("none", {}), ("wrong", {"Authorization": "Bearer nope"}),
                                  ("right", {"Authorization": "Bearer s3cret"})):
                async with http.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 1},
                                     headers=headers) as r:
                    results[name] = (r.status, await r.json())
            async with http.get(f"{url}/health") as r:
                results["health"] = (r.status, None)
            async with http.get(f"{url}/v1/nope", headers={"Authorization": "Bearer s3cret"}) as r:
                results["404"] = (r.status, await r.json())
            async with http.get(f"{url}/v1/completions", headers={"Authorization": "Bearer s3cret"}) as r:
                results["405"] = (r.status, await r.json(), r.headers.get("Allow"))
            return results

    results = run(main())
    assert results["none"][0] == results["wrong"][0] == 401 and results["none"][1]["error"]["code"] == 401
    assert results["right"][0] == 200 and results["health"][0] == 200
    assert results["404"][0] == 404 and results["404"][1]["error"]["code"] == 404
    assert results["405"][0] == 405 and results["405"][1]["error"]["type"] and results["405"][2] == "POST"


def test_openai_client_sees_api_errors():
    async def main():
        async with openai_client(tiny_engine()) as client:
            with pytest.raises(openai.NotFoundError):   # as OpenAI answers an unknown model (was a 400)
                await client.completions.create(model="other", prompt="hello")
            with pytest.raises(openai.BadRequestError) as e:
                await client.completions.create(model="fake-model", prompt="hello", n=2)
            assert "n" in e.value.message

    run(main())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("failure", ["error_after", "raise_after"])
def test_engine_failure_ends_the_request_with_an_error(stream, failure):
    engine = tiny_engine(**{failure: 2})

    async def main():
        async with serving(engine) as url, aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions",
                                 json={"prompt": "hello", "max_tokens": 5, "stream": stream}) as r:
                status, raw = r.status, await r.read()
            async with http.get(f"{url}/metrics") as r:
                return status, raw, await r.text()

    status, raw, metrics = run(main())
    if stream:
        events = [line[len(b"data: "):] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert status == 200 and events[-1] == b"[DONE]"
        assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["t1 ", "t2 "]
        assert json.loads(events[2])["error"]["code"] == 500 and len(events) == 4
    else:
        assert status == 500 and json.loads(raw)["error"]["type"] == "server_error"
    assert "\npdserve:request_failure_total 1.0\n" in metrics


def test_engine_refusal_is_a_bad_request():
    engine = tiny_engine(refuse_with="kv_transfer_params: remote_block_ids missing")

    async def main():
        async with serving(engine) as url:
            return await _post(url, "/v1/completions", {"prompt": "hello", "stream": True})

    status, error = run(main())
    assert status == 400 and "remote_block_ids" in error["error"]["message"]


# ----------------------------------------------------------------------------- disconnects

def test_disconnect_mid_stream_aborts_the_request():
    engine = tiny_engine(token_delay_s=0.02)

    async def main():
        async with serving(engine) as url:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/v1/completions",
                                     json={"prompt": "hello", "max_tokens": 50, "stream": True}) as r:
                    await r.content.readline()   # the first chunk is out
                    r.close()                    # drop the connection
            request_id = engine.calls[0].request_id
            assert await wait_until(lambda: request_id in engine.aborted)
            assert not engine.running and request_id not in engine.finished
            async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
                assert "\npdserve:request_abort_total 1.0\n" in await r.text()

    run(main())


@pytest.mark.parametrize("handler_cancellation", [True, False])
def test_disconnect_while_waiting_aborts_the_request(handler_cancellation, monkeypatch):
    """Non-streaming: nothing is written until the end, so only cancellation can notice the client left."""
    monkeypatch.setattr(app_module, "DISCONNECT_POLL_S", 0.02)
    engine = tiny_engine(token_delay_s=0.02)

    async def main():
        runner = web.AppRunner(build_app(engine), handler_cancellation=handler_cancellation)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as http:
                with pytest.raises(asyncio.TimeoutError):
                    await http.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 50},
                                    timeout=aiohttp.ClientTimeout(total=0.2))
            assert await wait_until(lambda: engine.calls and engine.calls[0].request_id in engine.aborted)
            assert not engine.running
        finally:
            await runner.cleanup()

    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_unexpected_server_exception_is_a_500(stream):
    engine = tiny_engine(kv_transfer_params_out={"not_json": object()})   # json.dumps fails on the last output

    async def main():
        async with serving(engine) as url, aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions",
                                 json={"prompt": "hello", "max_tokens": 2, "stream": stream}) as r:
                return r.status, await r.read()

    status, raw = run(main())
    if stream:
        events = [line[len(b"data: "):] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert status == 200 and json.loads(events[-2])["error"]["code"] == 500 and events[-1] == b"[DONE]"
    else:
        assert status == 500 and json.loads(raw)["error"]["type"] == "server_error"


def test_return_token_ids_and_token_ids_without_a_tokenizer():
    """return_token_ids puts the generated ids in each choice; a server with no tokenizer (dummy
    weights) always does, and streams one chunk per token even though there is no text."""
    async def main(engine, stream, extra):
        async with openai_client(engine) as client:
            if not stream:
                resp = await client.completions.create(model="fake-model", prompt=[1, 2, 3], max_tokens=4,
                                                       extra_body=extra)
                return resp.choices[0].model_extra.get("token_ids")
            chunks = [c async for c in await client.completions.create(
                model="fake-model", prompt=[1, 2, 3], max_tokens=4, stream=True, extra_body=extra)]
            return [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]

    expected = [(3 + i) % 100 for i in range(4)]
    assert run(main(tiny_engine(), False, {"return_token_ids": True})) == expected
    assert run(main(tiny_engine(), True, {"return_token_ids": True})) == expected
    assert run(main(tiny_engine(), False, {})) is None
    assert run(main(FakeEngine(), True, {})) == expected   # no tokenizer


def test_a_draining_server_answers_new_requests_with_503_and_retry_after():
    """During the SIGTERM drain a request that still reaches the server (a kept-alive connection) gets a
    503 with Retry-After, which a router retries on another instance; before, a 500."""
    engine = tiny_engine()
    engine.draining = "the server is shutting down"

    async def main():
        async with serving(engine) as url, aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/completions", json={"model": "fake-model", "prompt": "hi",
                                                                   "max_tokens": 2}) as resp:
                return resp.status, resp.headers.get("Retry-After"), await resp.json()

    status, retry_after, body = run(main())
    assert status == 503 and retry_after and "shutting down" in body["error"]["message"]
    assert not engine.calls
