"""The streaming client against the fake server: timing, usage-based counts and every kind of failure."""
import asyncio
import socket

import aiohttp
import pytest

from pdserve.bench.client import build_payload, fetch_first_model, normalize_base_url, send_request
from pdserve.bench.workloads import RequestSpec

MODEL_ID = "any-model"      # the fake server accepts any model name
IDS_SPEC = RequestSpec(prompt=list(range(1000, 1012)), messages=None, prompt_len=12, output_len=5)


def request(url, payload):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await send_request(session, url, payload)
    return asyncio.run(go())


def completions(server, **body):
    payload = build_payload(IDS_SPEC, endpoint="completions", model=MODEL_ID, extra_body=body)
    return request(server.base_url + "/v1/completions", payload)


def test_payload_streams_with_usage_and_carries_the_options():
    p = build_payload(IDS_SPEC, endpoint="completions", model="m", ignore_eos=True, extra_body={"top_k": 3})
    assert p["stream"] is True and p["stream_options"] == {"include_usage": True}
    assert p["prompt"] == IDS_SPEC.prompt and p["max_tokens"] == 5 and p["ignore_eos"] is True
    assert p["top_k"] == 3 and "messages" not in p
    chat = build_payload(RequestSpec(prompt=None, messages=[{"role": "user", "content": "hi"}],
                                     prompt_len=1, output_len=2), endpoint="chat", model="m")
    assert chat["messages"][0]["content"] == "hi" and "prompt" not in chat and "ignore_eos" not in chat


def test_measures_ttft_and_itl_from_chunk_timestamps(fake_server):
    record = completions(fake_server)
    first_delay_s, gap_s = fake_server.first_delay_s, fake_server.gap_s
    assert record.success and record.error is None, record.error
    assert first_delay_s * 0.9 <= record.ttft <= first_delay_s + 0.15   # slack for a busy CI box
    assert len(record.itls) == 4                                  # 5 chunks → 4 gaps
    assert all(gap_s * 0.5 <= gap <= gap_s + 0.1 for gap in record.itls)
    assert gap_s * 0.8 <= sum(record.itls) / 4 <= gap_s * 3
    assert record.e2e >= record.ttft + sum(record.itls) - 1e-6
    assert (record.prompt_tokens, record.output_tokens, record.finish_reason) == (12, 5, "length")
    assert record.tpot == pytest.approx((record.e2e - record.ttft) / 4)


def test_token_counts_come_from_usage_not_from_chunks(fake_server):
    record = completions(fake_server, tokens_per_chunk=2)        # 5 tokens in 3 chunks
    assert record.success and record.output_tokens == 5 and len(record.itls) == 2


def test_chat_endpoint_reads_deltas(fake_server):
    spec = RequestSpec(prompt=None, messages=[{"role": "user", "content": "a b c"}], prompt_len=3, output_len=3)
    record = request(fake_server.base_url + "/v1/chat/completions",
                     build_payload(spec, endpoint="chat", model=MODEL_ID))
    assert record.success and record.ttft is not None and len(record.itls) == 2
    assert (record.prompt_tokens, record.output_tokens) == (3, 3)


def test_http_error_is_a_failed_record_with_the_body(fake_server):
    record = completions(fake_server, fake_mode="http500")
    assert not record.success and record.error.startswith("HTTP 500") and "boom" in record.error


def test_dropped_connection_is_a_failed_record(fake_server):
    record = completions(fake_server, fake_mode="drop")
    assert not record.success and record.error and record.ttft is not None


def test_error_event_in_the_stream_is_a_failed_record(fake_server):
    record = completions(fake_server, fake_mode="error_event")
    assert not record.success and "engine died" in record.error


def test_stream_without_done_is_a_failed_record(fake_server):
    record = completions(fake_server, fake_mode="no_done")
    assert not record.success and "[DONE]" in record.error
    assert record.output_tokens == 5                              # what was measured is kept


def test_stream_without_usage_succeeds_with_unknown_token_counts(fake_server):
    record = completions(fake_server, fake_mode="no_usage")
    assert record.success and record.output_tokens is None and record.tpot is None


def test_connection_refused_is_a_failed_record():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                                 # free once closed: nothing listens
    record = request(f"http://127.0.0.1:{port}/v1/completions",
                     build_payload(IDS_SPEC, endpoint="completions", model="m"))
    assert not record.success and "Connect" in record.error


def test_first_model_comes_from_v1_models(fake_server):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await fetch_first_model(session, fake_server.base_url + "/v1/")
    assert asyncio.run(go()) == fake_server.model_id
    assert normalize_base_url("http://h:1/v1/") == normalize_base_url("http://h:1") == "http://h:1"
