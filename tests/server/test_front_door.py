"""The front door of one instance: limits, admission, deadlines, keys and error bodies.

Each test is one finding of the front-door issue (a request that could stall or kill an instance,
or reach what only the router may), over a FakeEngine and real HTTP.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from types import SimpleNamespace

import aiohttp
import pytest

from pdserve.config import ServerConfig
from pdserve.server import app as app_module
from pdserve.server.app import ROUTER_KEY_HEADER, start_server

from .fake_engine import FakeEngine, make_tiny_tokenizer

pytestmark = pytest.mark.timeout(60)

TOKENIZER = make_tiny_tokenizer()
ROUTER_KEY = "router-secret"


@contextlib.asynccontextmanager
async def serving(engine: FakeEngine, **config):
    runner, port = await start_server(engine, "127.0.0.1", 0, ServerConfig(**config))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def post(url: str, path: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as session:
        kwargs = {"data": body} if isinstance(body, (bytes, str)) else {"json": body}
        async with session.post(url + path, headers=headers, **kwargs) as resp:
            return resp.status, await resp.json(content_type=None), dict(resp.headers)


def engine_with(**kwargs) -> FakeEngine:
    return FakeEngine(tokenizer=TOKENIZER, **kwargs)


def run(coro):
    return asyncio.run(coro)


# ----------------------------------------------------------------------------- 1. bounds

def test_huge_top_k_is_a_400_that_never_reaches_the_engine():
    engine = engine_with()
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 1.0, "top_p": 0.9, "top_k": 10000000000000000000}

    async def main():
        async with serving(engine) as url:
            return await post(url, "/v1/completions", body)

    status, answer, _ = run(main())
    assert status == 400 and answer["error"]["param"] == "top_k" and engine.calls == []


# ----------------------------------------------------------------------------- 2. templates, long prompts

@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hello"}], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
    {"messages": [{"role": "user", "content": "hello"}], "chat_template": "{% for i in range(9999) %}{% endfor %}"},
])
def test_a_client_template_is_refused(body):
    engine = engine_with()

    async def main():
        async with serving(engine) as url:
            return await post(url, "/v1/chat/completions", body)

    status, answer, _ = run(main())
    assert status == 400 and "chat_template" in answer["error"]["param"] and engine.calls == []


def test_a_prompt_far_longer_than_the_context_is_refused_before_tokenizing(monkeypatch):
    engine = engine_with()   # max_model_len 64: at most 32 * 64 characters
    calls = []
    monkeypatch.setattr(app_module, "tokenize", lambda *a: calls.append(a) or [1])

    async def main():
        async with serving(engine) as url:
            return await post(url, "/v1/completions", {"prompt": "hello " * 1000})

    status, answer, _ = run(main())
    assert status == 400 and answer["error"]["param"] == "prompt" and "characters" in answer["error"]["message"]
    assert calls == [] and engine.calls == []


class SlowOnLargeTokenizer:
    """The tiny tokenizer, taking a second for any prompt on the large lane."""

    def __init__(self) -> None:
        self.inner = make_tiny_tokenizer()

    def __call__(self, text: str, **kwargs):
        if len(text) > app_module.SMALL_INPUT_CHARS:
            time.sleep(1.0)
        return self.inner(text, **kwargs)


def test_a_large_prompt_being_tokenized_does_not_hold_up_small_ones():
    engine = FakeEngine(tokenizer=SlowOnLargeTokenizer(), max_model_len=4096)

    async def main():
        async with serving(engine) as url:
            large = asyncio.create_task(post(url, "/v1/completions", {"prompt": "hello " * 4000, "max_tokens": 1}))
            await asyncio.sleep(0.2)    # the large one is on its lane now
            start = time.monotonic()
            small = await post(url, "/v1/completions", {"prompt": "hello world", "max_tokens": 1})
            small_s = time.monotonic() - start
            return small, small_s, await large

    small, small_s, large = run(main())
    assert small[0] == 200 and large[0] == 200
    assert small_s < 0.5, f"a small prompt waited {small_s:.2f} s behind a large one"


# ----------------------------------------------------------------------------- 3. bodies

def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch):
    engine = FakeEngine(max_model_len=100_000)
    threads = []
    real_parse = app_module.parse_json
    monkeypatch.setattr(app_module, "parse_json",
                        lambda body: threads.append(threading.current_thread().name) or real_parse(body))
    prompt = [5] * 30_000    # about 90 KB of JSON

    async def main():
        async with serving(engine) as url:
            small = await post(url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 1})
            large = await post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
            return small, large

    small, large = run(main())
    assert small[0] == 200 and large[0] == 200
    assert threads[0] == threading.current_thread().name or not threads[0].startswith("pdserve-")
    assert threads[1].startswith("pdserve-large")


def test_a_body_over_the_limit_is_a_413_in_json():
    engine = engine_with()

    async def main():
        async with serving(engine, max_body_bytes=1000) as url:
            return await post(url, "/v1/completions", {"prompt": "hello " * 1000})

    status, answer, _ = run(main())
    assert status == 413 and answer["error"]["code"] == 413 and engine.calls == []


def test_a_slow_upload_gets_a_408_and_frees_its_slot():
    engine = engine_with()

    async def main():
        async with serving(engine, body_timeout_s=0.3) as url:
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": ")   # and then nothing more
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), 5)
            writer.close()
            after = await post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 1})
            return status_line, after

    status_line, after = run(main())
    assert b" 408 " in status_line and after[0] == 200


# ----------------------------------------------------------------------------- 4. stop lists

def test_too_many_stop_strings_are_refused():
    engine = engine_with()

    async def main():
        async with serving(engine) as url:
            return await post(url, "/v1/completions", {"prompt": "hello", "stop": [f"s{i}" for i in range(400)]})

    status, answer, _ = run(main())
    assert status == 400 and answer["error"]["param"] == "stop" and engine.calls == []


# ----------------------------------------------------------------------------- 5. keys

def raw_request(port: int, headers: bytes, body: bytes = b'{"prompt": "hi"}') -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + headers
                     + b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_non_utf8_authorization_is_a_401_not_a_500():
    engine = engine_with()

    async def main():
        async with serving(engine, api_key="sekret") as url:
            port = int(url.rsplit(":", 1)[1])
            return await asyncio.to_thread(raw_request, port, b"Authorization: Bearer \xff\xfe\x80\r\n")

    answer = run(main())
    assert answer.startswith(b"HTTP/1.1 401") and b"Traceback" not in answer and engine.calls == []


KV_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r",
             "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": 1}


def test_only_the_router_may_send_kv_transfer_params_or_release_blocks():
    engine = engine_with()
    engine.release_kv = lambda params: engine.calls.append(("release", params))

    async def main():
        async with serving(engine, api_key="client-key", router_key=ROUTER_KEY) as url:
            client = {"Authorization": "Bearer client-key"}
            router = {ROUTER_KEY_HEADER: ROUTER_KEY}
            body = {"prompt": "hello", "max_tokens": 1, "kv_transfer_params": KV_PARAMS}
            return [await post(url, "/v1/completions", body, client),
                    await post(url, "/v1/kv/release", {"kv_transfer_params": KV_PARAMS}, client),
                    await post(url, "/v1/completions", body, {ROUTER_KEY_HEADER: "wrong"}),
                    await post(url, "/v1/completions", body, router),
                    await post(url, "/v1/kv/release", {"kv_transfer_params": KV_PARAMS}, router)]

    (s1, a1, _), (s2, a2, _), (s3, _, _), (s4, _, _), (s5, _, _) = run(main())
    assert s1 == 403 and a1["error"]["param"] == "kv_transfer_params"
    assert s2 == 403 and s3 == 401
    assert s4 == 200 and s5 == 202     # the router key also passes the api-key check
    assert [c.kv_transfer_params for c in engine.calls[:1]] == [KV_PARAMS] and engine.calls[1][0] == "release"


# ----------------------------------------------------------------------------- 6. error bodies

def test_engine_failures_reach_the_client_without_internals():
    engine = engine_with(raise_after=1)

    async def main():
        async with serving(engine) as url:
            return await post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 4})

    status, answer, _ = run(main())
    assert status == 500 and answer["error"]["message"] == "internal engine error"
    assert "RuntimeError" not in json.dumps(answer) and "exploded" not in json.dumps(answer)


def test_an_unexpected_exception_is_a_500_without_internals(monkeypatch):
    engine = engine_with()

    def explode(*args):
        raise KeyError("/secret/path/on/the/server")

    monkeypatch.setattr(app_module.OpenAIServer, "_max_tokens", explode)

    async def main():
        async with serving(engine) as url:
            return await post(url, "/v1/completions", {"prompt": "hello"})

    status, answer, _ = run(main())
    assert status == 500 and answer["error"]["message"] == "internal server error"
    assert "KeyError" not in json.dumps(answer) and "secret" not in json.dumps(answer)


# ----------------------------------------------------------------------------- 8. admission, deadlines, health

def test_past_the_queue_limit_requests_get_503_with_retry_after():
    engine = engine_with(token_delay_s=0.05)
    engine.config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=2))

    async def main():
        async with serving(engine, max_queued_requests=1) as url:
            body = {"prompt": "hello", "max_tokens": 10}
            answers = await asyncio.gather(*(post(url, "/v1/completions", body) for _ in range(6)))
            after = await post(url, "/v1/completions", body)
            return answers, after

    answers, after = run(main())
    statuses = sorted(status for status, _, _ in answers)
    assert statuses == [200, 200, 200, 503, 503, 503]
    refused = [headers for status, _, headers in answers if status == 503]
    assert all(h.get("Retry-After") == "1" for h in refused)
    assert after[0] == 200   # the slots came back


def test_a_request_past_its_deadline_is_ended_and_aborted():
    engine = engine_with(token_delay_s=0.1)

    async def main():
        async with serving(engine, request_timeout_s=0.35) as url:
            plain = await post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 50})
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/v1/completions",
                                        json={"prompt": "hello", "max_tokens": 50, "stream": True}) as resp:
                    events = (await resp.read()).decode()
            return plain, events

    (status, answer, _), events = run(main())
    assert status == 504 and "did not finish" in answer["error"]["message"]
    assert "did not finish" in events and events.rstrip().endswith("data: [DONE]")
    assert len(engine.aborted) == 2 and not engine.running


def test_health_reports_why_the_engine_is_unhealthy():
    engine = engine_with()
    engine.health = lambda: (False, "the engine has not stepped for 75 s")

    async def main():
        async with serving(engine) as url:
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/health") as resp:
                    return resp.status, await resp.json()

    status, answer = run(main())
    assert status == 503 and "not stepped for 75 s" in answer["error"]["message"]


# ----------------------------------------------------------------------------- /tokenize, /detokenize

def test_tokenize_and_detokenize_as_vllm_serves_them():
    engine = engine_with(vocab_size=50)

    async def main():
        async with serving(engine) as url:
            return [await post(url, "/tokenize", {"prompt": "hello world"}),
                    await post(url, "/tokenize", {"messages": [{"role": "user", "content": "hello"}]}),
                    await post(url, "/detokenize", {"tokens": TOKENIZER("hello world").input_ids}),
                    await post(url, "/detokenize", {"tokens": [10**6]})]

    (s1, a1, _), (s2, a2, _), (s3, a3, _), (s4, a4, _) = run(main())
    assert s1 == 200 and a1["tokens"] == TOKENIZER("hello world").input_ids and a1["count"] == 2
    assert a1["max_model_len"] == engine.max_model_len
    chat_text = TOKENIZER.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                              tokenize=False)
    assert s2 == 200 and a2["tokens"] == TOKENIZER(chat_text, add_special_tokens=False).input_ids
    assert s3 == 200 and a3["prompt"] == "hello world"
    assert s4 == 400 and a4["error"]["param"] == "tokens"


# ----------------------------------------------------------------------------- found by the hostile client

def test_a_prefill_for_a_remote_decode_checks_the_clients_max_tokens_then_makes_one_token():
    """The router passes the client's max_tokens to P: what D would refuse is refused before the prefill."""
    engine = engine_with()   # max_model_len 64
    router = {ROUTER_KEY_HEADER: ROUTER_KEY}

    async def main():
        async with serving(engine, router_key=ROUTER_KEY) as url:
            params = {"do_remote_decode": True}
            too_long = await post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 500,
                                                           "kv_transfer_params": params}, router)
            fits = await post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 20,
                                                       "kv_transfer_params": params}, router)
            return too_long, fits

    (s1, a1, _), (s2, _, _) = run(main())
    assert s1 == 400 and a1["error"]["param"] == "max_tokens"
    assert s2 == 200 and [c.params.max_tokens for c in engine.calls] == [1]


def test_tokenize_and_detokenize_check_ids_and_the_model_field():
    engine = engine_with(vocab_size=50)

    async def main():
        async with serving(engine) as url:
            return [await post(url, "/detokenize", {"tokens": [1], "model": {"a": 1}}),
                    await post(url, "/tokenize", {"prompt": [99999999]}),
                    await post(url, "/tokenize", {"prompt": [1] * 65})]

    (s1, a1, _), (s2, a2, _), (s3, a3, _) = run(main())
    assert s1 == 400 and a1["error"]["param"] == "model" and "{" not in a1["error"]["message"]
    assert s2 == 400 and a2["error"]["param"] == "prompt" and s3 == 400


def test_the_bearer_scheme_is_case_insensitive():
    engine = engine_with()

    async def main():
        async with serving(engine, api_key="sekret") as url:
            return await post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 1},
                              {"Authorization": "bearer sekret"})

    assert run(main())[0] == 200


def test_a_connection_that_never_finishes_its_headers_is_closed(monkeypatch):
    from pdserve import http_guard
    monkeypatch.setattr(http_guard, "IDLE_CONNECTION_TIMEOUT_S", 0.5)
    engine = engine_with()

    async def main():
        async with serving(engine) as url:
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")   # and never the blank line
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), 5)   # b"" once the server closes it
            writer.close()
            return data

    assert run(main()) == b""
