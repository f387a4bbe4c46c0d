"""One real instance on the default model, driven by the official openai client."""
from __future__ import annotations

import socket
import json

import openai
import pytest

from tests.e2e.cluster import ROUTER_KEY, serve, wait_until


@pytest.fixture(scope="module")
def server():
    proc = serve("server", "--api-key", "sekret", "--max-model-len", "2048")
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekret", max_retries=0)


def test_completions_chat_and_streaming(client):
    out = client.completions.create(model="default", prompt="The capital of France is", max_tokens=8,
                                    temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens <= 8
    chat = client.chat.completions.create(model="default", max_tokens=16, temperature=0,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model="default", max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "What is the capital of France?"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    seeded = [client.completions.create(model="default", prompt="Once upon a time", max_tokens=12,
                                        temperature=1.0, seed=7).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    stopped = client.completions.create(model="default", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                        stop=[" 7"])
    assert " 7" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_errors(server, client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt="hi", max_tokens=10, n=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt=[5] * 3000, max_tokens=10)  # over max-model-len
    with pytest.raises(openai.NotFoundError):   # as OpenAI answers an unknown model
        client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt="hi", temperature=-1)
    assert client.models.list().data[0].id == "default"


def test_disconnect_frees_the_blocks(server):
    body = json.dumps({"model": "default", "prompt": "Tell me a very long story.", "max_tokens": 1000,
                       "ignore_eos": True, "stream": True}).encode()
    conn = socket.create_connection(("127.0.0.1", server.port))
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert wait_until(lambda: server.metrics()["num_requests_running"] == 1, timeout=10)
    assert server.metrics()["kv_cache_usage_perc"] > 0
    conn.recv(4096)  # a chunk arrived: the request is generating
    conn.close()
    assert wait_until(lambda: server.metrics()["kv_cache_usage_perc"] == 0
                      and server.metrics()["num_requests_running"] == 0, timeout=10)
    assert server.metrics()["request_abort_total"] == 1


@pytest.mark.parametrize("params", [
    {"do_remote_prefill": True},                                   # required fields missing
    {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_host": "h",
     "remote_port": "abc", "remote_block_ids": [1]},              # wrong type
    {"do_remote_prefill": True, "remote_engine_id": ["p"], "remote_request_id": "r", "remote_host": "h",
     "remote_port": 1, "remote_block_ids": [1], "num_remote_tokens": "5"},
    *({"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_host": "h",
       "remote_port": 1, "remote_block_ids": [1], "first_token_ids": first}   # P's token: exactly one id
      for first in ([], [1, 2], ["1"], [True], [-1], 7)),
])
def test_malformed_kv_transfer_params_are_a_400_and_the_engine_survives(server, client, params):
    with pytest.raises(openai.PermissionDeniedError):   # from a client, even well-formed ones are refused
        client.completions.create(model="default", prompt="hi", max_tokens=2, extra_body={"kv_transfer_params": params})
    with pytest.raises(openai.BadRequestError):   # from the router: checked before they reach the engine
        client.completions.create(model="default", prompt="hi", max_tokens=2, extra_body={"kv_transfer_params": params},
                                  extra_headers={"X-PDServe-Router-Key": ROUTER_KEY})
    assert client.completions.create(model="default", prompt="hi", max_tokens=2).usage.completion_tokens == 2
