"""Request parsing and response shapes (pure Python, milliseconds)."""
import pytest

from pdserve import protocol
from pdserve.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError


def test_completion_request_fields_become_sampling_params():
    req = CompletionRequest.from_json({
        "model": "m", "prompt": "hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3,
        "seed": 11, "stop": "x", "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        "kv_transfer_params": {"do_remote_decode": True}, "unknown_vendor_field": [1, 2]})
    params = req.to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (7, 0.0, 0.5, 3, 11)
    assert params.stop == ["x"] and params.ignore_eos and params.is_greedy
    assert req.stream and req.include_usage and req.kv_transfer_params == {"do_remote_decode": True}


def test_defaults_and_prompt_forms():
    assert CompletionRequest.from_json({"prompt": "hi"}).max_tokens == 16     # OpenAI's default
    assert ChatCompletionRequest.from_json({"messages": [{"role": "user", "content": "hi"}]}).max_tokens is None
    assert CompletionRequest.from_json({"prompt": ["hi"]}).prompt == "hi"
    assert CompletionRequest.from_json({"prompt": [[1, 2]]}).prompt == [1, 2]
    assert CompletionRequest.from_json({"prompt": [1, 2], "max_completion_tokens": 3, "max_tokens": 9}).max_tokens == 3
    assert CompletionRequest.from_json({"prompt": "hi", "max_tokens": 4.0}).max_tokens == 4


def test_chat_content_parts_are_joined():
    req = ChatCompletionRequest.from_json({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]})
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                            {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("body, param", [
    ([1, 2], None),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "a", "temperature": -0.1}, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "temperature": True}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_p": float("nan")}, "top_p"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "a", "top_k": -2}, "top_k"),
    ({"prompt": "a", "n": 2}, "n"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "stop": ["ok", ""]}, "stop"),
    ({"prompt": "a", "stop": 3}, "stop"),
    ({"prompt": "a", "seed": "1"}, "seed"),
    ({"prompt": "a", "model": 3}, "model"),
    ({"prompt": "a", "kv_transfer_params": "x"}, "kv_transfer_params"),
    ({"prompt": "a", "logprobs": 1}, "logprobs"),
    ({"prompt": "a", "echo": True}, "echo"),
])
def test_completion_request_rejects(body, param):
    with pytest.raises(ProtocolError) as e:
        CompletionRequest.from_json(body)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("messages, param", [
    (None, "messages"), ([], "messages"), (["hi"], "messages[0]"),
    ([{"role": 1, "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
])
def test_chat_request_rejects(messages, param):
    with pytest.raises(ProtocolError) as e:
        ChatCompletionRequest.from_json({"messages": messages})
    assert e.value.param == param


def test_response_shapes():
    usage = protocol.usage(3, 2, num_cached_tokens=1)
    assert usage["total_tokens"] == 5 and usage["prompt_tokens_details"] == {"cached_tokens": 1}
    body = protocol.completion_response("cmpl-1", "m", "hi", "stop", usage, kv_transfer_params={"a": 1})
    assert body["object"] == "text_completion" and body["choices"][0] == {
        "index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop"}
    assert body["kv_transfer_params"] == {"a": 1}
    chat = protocol.chat_response("chatcmpl-1", "m", "hi", "length", usage)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert protocol.new_completion_id().startswith("cmpl-")
    assert protocol.new_chat_completion_id().startswith("chatcmpl-")
    event = protocol.sse_event(protocol.chat_chunk("c", "m", 1, {"content": "x"}))
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert protocol.parse_sse_data(event.split(b"\n")[0])["choices"][0]["delta"] == {"content": "x"}
    assert protocol.parse_sse_data(b"data: [DONE]") is None and protocol.is_sse_done(b"data: [DONE]\n")
    assert ProtocolError(404, "no", "model").to_dict() == {
        "error": {"message": "no", "type": "not_found_error", "param": "model", "code": 404}}
