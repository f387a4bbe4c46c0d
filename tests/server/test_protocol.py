"""Request parsing and response shapes (pure Python, milliseconds)."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from pdserve import protocol
from pdserve.protocol import (MAX_INT32, RESERVED_TEMPLATE_KWARGS, ChatCompletionRequest, CompletionRequest,
                              ProtocolError)

USER = {"role": "user", "content": "hi"}


def completion(**fields):
    return {"prompt": "hi", **fields}


def chat(messages=(USER,), **fields):
    return {"messages": list(messages), **fields}


def parse(body):
    return (ChatCompletionRequest if "messages" in body else CompletionRequest).from_json(body)


def refusal(body) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.message.startswith(f"{e.value.param}: ")
    return e.value


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


# ----------------------------------------------------------------------------- the front door
# One request must never take an instance down: every number bounded, every list and string capped.

def _parts(n):
    return [{"role": "user", "content": [{"type": "text", "text": "x"}] * n}]


def _kwargs(n):
    return {f"k{i}": i for i in range(n)}


@pytest.mark.parametrize("inside, outside, param", [
    (completion(max_tokens=1), completion(max_tokens=0), "max_tokens"),
    (completion(max_tokens=MAX_INT32), completion(max_tokens=MAX_INT32 + 1), "max_tokens"),
    (completion(max_completion_tokens=MAX_INT32), completion(max_completion_tokens=MAX_INT32 + 1),
     "max_completion_tokens"),
    (completion(max_completion_tokens=1), completion(max_completion_tokens=0), "max_completion_tokens"),
    (completion(temperature=0), completion(temperature=-1e-9), "temperature"),
    (completion(temperature=100), completion(temperature=100.000001), "temperature"),
    (completion(top_p=1e-300), completion(top_p=0.0), "top_p"),
    (completion(top_p=1), completion(top_p=1.000001), "top_p"),
    (completion(top_k=-1), completion(top_k=-2), "top_k"),
    (completion(top_k=MAX_INT32), completion(top_k=MAX_INT32 + 1), "top_k"),
    (completion(seed=-2**63), completion(seed=-2**63 - 1), "seed"),
    (completion(seed=2**64 - 1), completion(seed=2**64), "seed"),
    (completion(prompt=[0, MAX_INT32]), completion(prompt=[0, MAX_INT32 + 1]), "prompt"),
    (completion(prompt=[0]), completion(prompt=[-1]), "prompt"),
    (completion(stop_token_ids=[0, MAX_INT32]), completion(stop_token_ids=[0, MAX_INT32 + 1]), "stop_token_ids[1]"),
    (completion(stop_token_ids=[0]), completion(stop_token_ids=[-1]), "stop_token_ids[0]"),
    (completion(presence_penalty=0), completion(presence_penalty=-2.01), "presence_penalty"),
    (completion(frequency_penalty=0.0), completion(frequency_penalty=2.01), "frequency_penalty"),
    (completion(n=1), completion(n=2), "n"),
    (completion(best_of=1), completion(best_of=2), "best_of"),
    (completion(logprobs=None), completion(logprobs=0), "logprobs"),   # 0 still asks for the sampled token's
    (chat(logprobs=False), chat(logprobs=True), "logprobs"),
    (chat(top_logprobs=0), chat(top_logprobs=1), "top_logprobs"),
    # not implemented, so refused unless neutral: they were validated, then silently ignored (a new-user check)
    (completion(presence_penalty=0), completion(presence_penalty=0.5), "presence_penalty"),
    (chat(frequency_penalty=0), chat(frequency_penalty=-1), "frequency_penalty"),
    (chat(logit_bias={}), chat(logit_bias={"1": 5}), "logit_bias"),
    (chat(tools=[]), chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (chat(response_format={"type": "text"}), chat(response_format={"type": "json_object"}), "response_format"),
    (chat(functions=[]), chat(functions=[{"name": "f"}]), "functions"),
    (chat(tool_choice="auto"), chat(tool_choice="required"), "tool_choice"),
    (chat(function_call="none"), chat(function_call={"name": "f"}), "function_call"),
    (completion(repetition_penalty=1.0), completion(repetition_penalty=1.1), "repetition_penalty"),
    (completion(min_p=0), completion(min_p=0.05), "min_p"),
    (completion(min_tokens=0), completion(min_tokens=4), "min_tokens"),
    (chat(guided_json=None), chat(guided_json={"type": "object"}), "guided_json"),
    (chat(structured_outputs=None), chat(structured_outputs={"choice": ["a"]}), "structured_outputs"),
    (completion(suffix=""), completion(suffix="end"), "suffix"),
    (completion(allowed_token_ids=[]), completion(allowed_token_ids=[1, 2, 3]), "allowed_token_ids"),
    (completion(bad_words=[]), completion(bad_words=["x"]), "bad_words"),
    (chat(include_stop_str_in_output=False), chat(include_stop_str_in_output=True), "include_stop_str_in_output"),
    (chat(skip_special_tokens=True), chat(skip_special_tokens=False), "skip_special_tokens"),
    (completion(truncate_prompt_tokens=None), completion(truncate_prompt_tokens=8), "truncate_prompt_tokens"),
    (completion(use_beam_search=False), completion(use_beam_search=True), "use_beam_search"),
    (completion(length_penalty=1.0), completion(length_penalty=0.5), "length_penalty"),
    (completion(logits_processors=[]), completion(logits_processors=["x"]), "logits_processors"),
    (completion(prompt_logprobs=0), completion(prompt_logprobs=1), "prompt_logprobs"),
    (chat(echo=False), chat(echo=True), "echo"),
    (chat(continue_final_message=False), chat(continue_final_message=True), "continue_final_message"),
    # size caps
    (completion(stop=["s"] * 32), completion(stop=["s"] * 33), "stop"),
    (completion(stop="s" * 1024), completion(stop="s" * 1025), "stop"),
    (completion(stop=["s", "s" * 1024]), completion(stop=["s", "s" * 1025]), "stop"),
    (completion(stop_token_ids=[1] * 1024), completion(stop_token_ids=[1] * 1025), "stop_token_ids"),
    (chat([USER] * 4096), chat([USER] * 4097), "messages"),
    (chat(_parts(1024)), chat(_parts(1025)), "messages[0].content"),
    (chat([{**USER, "name": "n" * 256}]), chat([{**USER, "name": "n" * 257}]), "messages[0].name"),
    (chat(chat_template_kwargs=_kwargs(32)), chat(chat_template_kwargs=_kwargs(33)), "chat_template_kwargs"),
    (chat(chat_template_kwargs={"k": "v" * 1024}), chat(chat_template_kwargs={"k": "v" * 1025}),
     "chat_template_kwargs.k"),
    (chat(chat_template_kwargs={"k": None}), chat(chat_template_kwargs={"k": {"nested": 1}}), "chat_template_kwargs.k"),
    (chat(chat_template_kwargs={"k": 1.5}), chat(chat_template_kwargs={"k": [1]}), "chat_template_kwargs.k"),
    (completion(model="m" * 1024), completion(model="m" * 1025), "model"),
    (completion(kv_transfer_params=_kwargs(32)), completion(kv_transfer_params=_kwargs(33)), "kv_transfer_params"),
])
def test_every_field_is_bounded(inside, outside, param):
    parse(inside)
    assert refusal(outside).param == param


def test_huge_top_k_is_refused_not_overflowed():
    error = refusal(completion(top_k=10000000000000000000))
    assert error.param == "top_k" and str(MAX_INT32) in error.message


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "top_k", "seed", "n", "best_of",
                                   "temperature", "top_p", "presence_penalty"])
@pytest.mark.parametrize("value", [True, False, "16", "0.5", [1], {"a": 1}])
def test_numbers_are_strict(field, value):
    assert refusal(completion(**{field: value})).param == field


@pytest.mark.parametrize("field", ["ignore_eos", "stream", "return_token_ids", "echo"])
@pytest.mark.parametrize("value", [1, 0, "true"])
def test_booleans_are_strict(field, value):
    assert refusal(completion(**{field: value})).param == field


def test_token_ids_are_strict():
    assert refusal(completion(prompt=[1, True])).param == "prompt"
    assert refusal(completion(prompt=[1, 2.0])).param == "prompt"   # ids come from a tokenizer, never as floats
    assert refusal(completion(stop_token_ids=[False])).param == "stop_token_ids[0]"


def test_integral_floats_are_integers():
    req = CompletionRequest.from_json(completion(max_tokens=16.0, top_k=5.0, seed=7.0, n=1.0))
    assert (req.max_tokens, req.top_k, req.seed) == (16, 5, 7) and type(req.max_tokens) is int
    assert refusal(completion(top_k=1e300)).param == "top_k"


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "seed", "temperature", "top_p", "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinities_are_refused(field, value):
    assert refusal(completion(**{field: value})).param == field


def test_role_must_be_openai_s():
    for role in ("system", "user", "assistant", "tool", "developer"):
        parse(chat([USER, {"role": role, "content": "x"}]))
    error = refusal(chat([USER, USER, {"role": "wizard", "content": "x"}]))
    assert error.param == "messages[2].role" and "'developer'" in error.message


@pytest.mark.parametrize("body, param", [
    (chat(chat_template="{{ messages }}"), "chat_template"),
    (chat(chat_template_kwargs={"chat_template": "{{ messages }}"}), "chat_template_kwargs.chat_template"),
])
def test_custom_chat_templates_are_refused(body, param):
    error = refusal(body)
    assert error.param == param and "custom chat templates are not accepted" in error.message


@pytest.mark.parametrize("key", sorted(RESERVED_TEMPLATE_KWARGS))
def test_template_kwargs_the_server_sets_are_refused(key):
    assert refusal(chat(chat_template_kwargs={key: False})).param == f"chat_template_kwargs.{key}"


def test_clients_extras_and_nulls_are_accepted():
    req = ChatCompletionRequest.from_json(chat(
        [USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}], "name": None}],
        user="u", logit_bias={}, response_format={"type": "text"}, presence_penalty=0, tools=None, metadata={"a": 1},
        temperature=None, stop=None, seed=None, max_tokens=None, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        chat_template_kwargs={"enable_thinking": False}))
    assert req.messages == [USER, {"role": "assistant", "content": ""}]
    assert (req.temperature, req.stop, req.seed, req.max_tokens, req.include_usage) == (1.0, [], None, None, True)
    assert req.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("body", [
    completion(temperature="hot"), completion(stream_options=[]), completion(top_p=2), chat([5]),
    chat([{"role": "user", "content": {"a": 1}}]), chat(messages=[]), completion(max_tokens=2**70),
])
def test_errors_do_not_leak_pydantic(body):
    message = refusal(body).message
    assert "pydantic" not in message and "http" not in message and "StreamOptions" not in message
    assert "ChatMessage" not in message and "Request" not in message


# Any JSON value json.loads can produce: huge ints, NaN and infinities included. Scalars come half the
# time, so that each field meets the edge values themselves, not only inside lists.
SCALAR = (st.none() | st.booleans() | st.text(max_size=8)
          | st.integers() | st.sampled_from([0, 1, -1, MAX_INT32 + 1, 2**63, 2**64, 10**19, -2**63 - 1, 10**400])
          | st.floats() | st.sampled_from([math.nan, math.inf, -math.inf, 16.0, 2.5, 1e300, -0.0]))
JSON = SCALAR | st.recursive(
    SCALAR,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None)
COMMON_FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                 "stop_token_ids", "ignore_eos", "stream", "stream_options", "kv_transfer_params",
                 "return_token_ids", "n", "best_of", "logprobs", "top_logprobs", "presence_penalty",
                 "frequency_penalty"]


def _parses_or_refuses(cls, body):
    try:
        req = cls.from_json(body)
    except ProtocolError as e:
        # "Value error" is pydantic's wrapping of a ValueError no validator meant to raise
        assert e.status == 400 and isinstance(e.message, str) and "Value error" not in e.message
    else:
        req.to_sampling_params()   # whatever passes the door, the sampler takes


@FUZZ
@given(body=JSON)
def test_any_json_body_parses_or_gets_a_400(body):
    _parses_or_refuses(CompletionRequest, body)
    _parses_or_refuses(ChatCompletionRequest, body)


@FUZZ
@given(field=st.sampled_from(COMMON_FIELDS + ["prompt", "echo"]), value=JSON)
def test_any_completion_field_value_parses_or_gets_a_400(field, value):
    _parses_or_refuses(CompletionRequest, {**completion(stream=True), field: value})


@FUZZ
@given(field=st.sampled_from(COMMON_FIELDS + ["messages", "add_generation_prompt", "chat_template_kwargs",
                                              "chat_template"]), value=JSON)
def test_any_chat_field_value_parses_or_gets_a_400(field, value):
    _parses_or_refuses(ChatCompletionRequest, {**chat(stream=True), field: value})


@FUZZ
@given(field=st.sampled_from(["role", "content", "name"]), value=JSON)
def test_any_message_field_value_parses_or_gets_a_400(field, value):
    _parses_or_refuses(ChatCompletionRequest, chat([USER, {**USER, field: value}]))
