"""OpenAI-compatible request and response schemas, shared by server, proxy and bench.

Requests are pydantic models, validated at the door so that one request can never take an instance
down or slow every other stream:
  - strict types: a bool is not an integer and "16" is not a number (16.0 is 16: some clients send it);
  - every number bounded (token ids and counts fit an int32, the seed what a torch generator takes),
    NaN and infinities refused, so nothing overflows a tensor downstream;
  - every list, string and map a client sends capped (the MAX_* constants say why);
  - no client-supplied chat template, and no chat_template_kwargs the server sets itself.
A failure raises `ProtocolError(400, "<field>: <reason>", param="<field>")` naming the first failing
field the OpenAI way (`messages[2].role`); the server turns it into an OpenAI-style error body.
Unknown fields are ignored, so clients that send vendor extras (user, metadata, ...) keep working,
and null means "not given". OpenAI fields pdserve does not implement (n > 1, logprobs, echo, penalties,
logit_bias, tools and functions, a response_format other than text, suffix; vLLM's repetition_penalty,
min_p, min_tokens, guided decoding, allowed_token_ids, bad_words, beam search and the like) are accepted
at the value that asks for nothing and refused (400) otherwise, never silently ignored.
`kv_transfer_params` travels as an opaque dict with vLLM's field names (see kv_transfer/base.py); the
engine checks its contents.

Pure Python and pydantic: no torch, no aiohttp, so the proxy and the benchmark client can import it anywhere.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, Optional

from pydantic import (AfterValidator, AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator,
                      Strict, ValidationError, ValidationInfo, ValidatorFunctionWrapHandler, WrapValidator,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError
from typing_extensions import NotRequired, Self, TypedDict

from pdserve.sampling_params import SamplingParams

SSE_DONE = b"data: [DONE]\n\n"

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                413: "invalid_request_error", 415: "invalid_request_error", 417: "invalid_request_error",
                500: "server_error", 502: "backend_error",
                503: "service_unavailable", 504: "timeout_error"}

# Numeric bounds. Token ids and token counts fit an int32, so no tensor that holds them can overflow.
MAX_INT32 = 2**31 - 1
MIN_SEED, MAX_SEED = -2**63, 2**64 - 1   # what torch.Generator.manual_seed takes

# Size caps: what one request may ask of every step it shares with other streams, and of the server.
# Every stop string is searched in every step's new text: 400,000 of them once slowed every other stream 3x.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024      # checked against every sampled token
MAX_MESSAGES = 4096            # the chat template renders them in Python, in the tokenizer thread
MAX_CONTENT_PARTS = 1024
MAX_NAME_CHARS = 256           # a participant's name, not a second content field
MAX_TEMPLATE_KWARGS = 32       # each becomes a variable of the chat template
MAX_TEMPLATE_VALUE_CHARS = 1024
MAX_MODEL_CHARS = 1024         # echoed in every response chunk
MAX_KV_TRANSFER_KEYS = 32      # vLLM's fields are a handful; the engine checks each one
MAX_RESUME_TOKENS = 1 << 20    # a resumed request's tokens so far: no context is longer (the server checks its own)

# chat_template_kwargs keys the server sets itself when it applies the chat template.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                                      "return_dict", "return_tensors", "padding", "truncation",
                                      "chat_template", "tokenizer"})
# A template is code: a client's own would run in the server's tokenizer thread, loops included.
_CUSTOM_TEMPLATE = "custom chat templates are not accepted; the server applies the model's own"


class ProtocolError(Exception):
    """A request the server must refuse; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, status=self.status, param=self.param)


def error_body(message: str, *, status: int, param: str | None = None,
               type: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; `code` carries the HTTP status, as vLLM does."""
    return {"error": {"message": message, "type": type or _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": status}}


def _bad(param: str, message: str) -> ProtocolError:
    return ProtocolError(400, f"{param}: {message}", param)


def _from_validation_error(error: ValidationError) -> ProtocolError:
    """The first failing field, named the OpenAI way: ("messages", 2, "role") is messages[2].role.

    pydantic's own `msg` is the reason: str(error) would add model names and a documentation URL.
    """
    first = error.errors(include_url=False, include_context=False, include_input=False)[0]
    param = ""
    for part in first["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part != "[key]":   # a map key's own error: named by the key, which precedes it
            param += f".{part}" if param else part
    return _bad(param, first["msg"]) if param else ProtocolError(400, first["msg"])


# ----------------------------------------------------------------------------- field types
# Validators raise PydanticCustomError: pydantic then names the field, and its message is ours verbatim.

def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid", message)


def _integral_float_as_int(value: Any) -> Any:
    # Some clients send 16.0 for 16; any other float is left to fail the strict int check.
    return int(value) if type(value) is float and value.is_integer() else value


def _int(*checks: Any) -> Any:
    # The before-validator goes last: constraints after a validator would run as Python functions,
    # not inside pydantic-core.
    return Annotated[(int, Strict(), *checks, BeforeValidator(_integral_float_as_int))]


def _number(**bounds: float) -> Any:
    return Annotated[float, Strict(), Field(allow_inf_nan=False, **bounds)]


def _seed_in_range(seed: int) -> int:
    # Checked here, not with Field(le=...): pydantic prints 2**64 - 1 rounded to a float.
    if not MIN_SEED <= seed <= MAX_SEED:
        raise _invalid(f"must be in [{MIN_SEED}, {MAX_SEED}], got {seed}")
    return seed


def _must_be_one(value: int) -> int:
    if value != 1:
        raise _invalid(f"only 1 is supported, got {value}")
    return value


def _refuse_logprobs(value: Any) -> Any:
    if value not in (False, 0):   # chat: logprobs switches them on, top_logprobs counts them (0 with it off)
        raise _invalid("logprobs are not supported")
    return value


def _refuse_penalty(value: float) -> float:
    if value != 0:
        raise _invalid(f"penalties are not supported (only 0), got {value}")
    return value


def _refuse_logit_bias(value: Any) -> Any:
    if value not in ({}, None):
        raise _invalid("logit_bias is not supported (only {} or null)")
    return value


def _refuse_tools(value: Any) -> Any:
    if value not in ([], None):
        raise _invalid("tools (function calling) are not supported")
    return value


def _neutral_only(*neutral: Any, what: str = "") -> Any:
    """A validator refusing any value but the neutral ones (compared with ==, a bool only with a bool)."""
    only = f" (only {' or '.join(json.dumps(n) for n in neutral)})" if neutral else ""
    message = f"{what} is not supported" if what else f"not supported{only}"

    def check(value: Any) -> Any:
        if value is not None and not any(value == n and isinstance(value, bool) == isinstance(n, bool)
                                         for n in neutral):
            raise _invalid(message)
        return value
    return PlainValidator(check)


def _refuse_response_format(value: Any) -> Any:
    if not (isinstance(value, dict) and value.get("type") == "text"):
        raise _invalid('only {"type": "text"} is supported (no JSON mode or schema)')
    return value


def _refuse_echo(echo: bool) -> bool:
    if echo:
        raise _invalid("not supported")
    return echo


def _refuse_custom_template(value: Any) -> Any:
    raise _invalid(_CUSTOM_TEMPLATE)


def _stop(value: Any) -> list[str]:
    stop = [value] if isinstance(value, str) else value
    if not isinstance(stop, list):
        raise _invalid("expected a string or a list of strings")
    if len(stop) > MAX_STOP_STRINGS:   # before looking at each one
        raise _invalid(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if not all(type(s) is str and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise _invalid(f"each stop string must be a string of 1 to {MAX_STOP_CHARS} characters")
    return stop


def _is_token_ids(value: Any) -> bool:
    # One pass in Python: on a 100k-id prompt it measured faster than pydantic's list[int] (3.4 ms vs 4.5).
    if type(value) is not list:
        return False
    for token_id in value:
        if type(token_id) is not int or not 0 <= token_id <= MAX_INT32:
            return False
    return True


def _prompt(value: Any) -> str | list[int]:
    # A batch of one ([str] or [[int]]) is unwrapped; larger batches are refused.
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) != 1:
            raise _invalid(f"only one prompt per request is supported, got {len(value)}")
        value = value[0]
    if not (isinstance(value, str) or _is_token_ids(value)):
        raise _invalid(f"expected a string, a list of token ids in [0, {MAX_INT32}], or a list of one of these")
    if not value:
        raise _invalid("must not be empty")
    return value


def _text_part(part: Any) -> str:
    if type(part) is dict and part.get("type") == "text" and type(part.get("text")) is str:
        return part["text"]
    raise _invalid('only parts of the form {"type": "text", "text": str} are supported')


def _join_text_parts(value: Any, validate_parts: ValidatorFunctionWrapHandler) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _invalid("expected a string or a list of content parts")
    return "\n".join(validate_parts(value))   # a bad part is named by its index


def _template_kwarg_name(name: str) -> str:
    if name == "chat_template":
        raise _invalid(_CUSTOM_TEMPLATE)
    if name in RESERVED_TEMPLATE_KWARGS:
        raise _invalid("is set by the server")
    return name


def _template_kwarg_value(value: Any) -> Any:
    # Scalars only: a template variable needs no structure, and a scalar's size is its length.
    if value is None or type(value) in (bool, int, float) or (
            type(value) is str and len(value) <= MAX_TEMPLATE_VALUE_CHARS):
        return value
    raise _invalid(f"expected a string of at most {MAX_TEMPLATE_VALUE_CHARS} characters, a number, "
                   "a boolean or null")


TokenCount = _int(Field(ge=1, le=MAX_INT32))
Temperature = _number(ge=0.0, le=100.0)
TopP = _number(gt=0.0, le=1.0)
TopK = _int(Field(ge=-1, le=MAX_INT32))   # -1 and 0: no cut; the sampler clamps it to the vocabulary
Seed = _int(AfterValidator(_seed_in_range))
StrictBool = Annotated[bool, Strict()]
TokenId = Annotated[int, Strict(), Field(ge=0, le=MAX_INT32)]   # ids come from tokenizers: never 3.0
OnlyOne = _int(AfterValidator(_must_be_one))
Penalty = Annotated[_number(ge=-2.0, le=2.0), AfterValidator(_refuse_penalty)]   # OpenAI's range; 0 only
Stop = Annotated[list[str], PlainValidator(_stop)]
Prompt = Annotated[str | list[int], PlainValidator(_prompt)]
# Text, or text parts joined by newlines: the value is the str the chat template reads.
MessageContent = Annotated[list[Annotated[str, PlainValidator(_text_part)]], Field(max_length=MAX_CONTENT_PARTS),
                           WrapValidator(_join_text_parts)]
TemplateKwargs = Annotated[dict[Annotated[str, AfterValidator(_template_kwarg_name)],
                                Annotated[Any, PlainValidator(_template_kwarg_value)]],
                           Field(max_length=MAX_TEMPLATE_KWARGS)]


class StreamOptions(TypedDict):
    include_usage: NotRequired[Optional[StrictBool]]


class ChatMessage(TypedDict):
    """One message as the chat template reads it; other fields (tool_calls, ...) are dropped."""
    role: Literal["system", "user", "assistant", "tool", "developer"]   # OpenAI's roles
    content: NotRequired[Optional[MessageContent]]
    name: NotRequired[Optional[Annotated[str, Strict(), Field(max_length=MAX_NAME_CHARS)]]]


# ----------------------------------------------------------------------------- requests

class Resume(BaseModel):
    """The router's stream recovery (its key only): the tokens the instance that died had generated for
    this request, streamed to the client already. The instance computes them as context after the
    prompt and goes on from there: max_tokens and usage count them, a seeded generator skips their draws,
    the text continues where the client's stopped. `num_tokens` must be their number (a check on a
    truncated list)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_RESUME_TOKENS)]
    num_tokens: TokenCount

    @model_validator(mode="after")
    def _count_matches(self) -> Self:
        if self.num_tokens != len(self.token_ids):
            raise _invalid(f"num_tokens is {self.num_tokens} but token_ids holds {len(self.token_ids)}")
        return self


class _Request(BaseModel):
    """Fields both endpoints share: sampling, streaming, P/D."""
    model_config = ConfigDict(extra="ignore", frozen=True)

    model: Optional[Annotated[str, Strict(), Field(max_length=MAX_MODEL_CHARS)]] = None
    # max_completion_tokens is the newer name; it wins when both are given. None: up to the model's length.
    max_tokens: Optional[TokenCount] = Field(None, validation_alias=AliasChoices("max_completion_tokens",
                                                                                 "max_tokens"))
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Optional[Seed] = None
    stop: Stop = Field(default_factory=list)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] = Field(default_factory=list)
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    kv_transfer_params: Optional[Annotated[dict[str, Any], Strict(), Field(max_length=MAX_KV_TRANSFER_KEYS)]] = None
    return_token_ids: StrictBool = False   # extension (as vLLM's): choices carry "token_ids"
    resume: Optional[Resume] = None        # extension, the router's alone: see Resume
    # Extension for the router's stream recovery: each stream chunk with new tokens also carries them in a
    # top-level "router_token_ids", which the router removes. Not return_token_ids: those are the client's
    # (and always on without a tokenizer), so the router could not tell which ids it may remove.
    router_token_ids: StrictBool = False
    # OpenAI fields pdserve does not implement: accepted at the value that asks for nothing.
    n: Optional[OnlyOne] = None
    best_of: Optional[OnlyOne] = None
    logprobs: Annotated[Any, PlainValidator(_refuse_logprobs)] = None
    top_logprobs: Annotated[Any, PlainValidator(_refuse_logprobs)] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    # Refused rather than ignored: an answer that silently skips a JSON mode, a bias or a tool call is
    # worse than a 400 the client can act on.
    logit_bias: Annotated[Any, PlainValidator(_refuse_logit_bias)] = None
    tools: Annotated[Any, PlainValidator(_refuse_tools)] = None
    functions: Annotated[Any, PlainValidator(_refuse_tools)] = None   # the legacy form of tools
    tool_choice: Annotated[Any, _neutral_only("none", "auto")] = None
    function_call: Annotated[Any, _neutral_only("none", "auto")] = None
    response_format: Annotated[Any, PlainValidator(_refuse_response_format)] = None
    # vLLM's extensions that change an answer: clients written for vLLM send them
    repetition_penalty: Annotated[Any, _neutral_only(1)] = None
    min_p: Annotated[Any, _neutral_only(0)] = None
    min_tokens: Annotated[Any, _neutral_only(0)] = None
    guided_json: Annotated[Any, _neutral_only(what="guided decoding")] = None
    guided_regex: Annotated[Any, _neutral_only(what="guided decoding")] = None
    guided_choice: Annotated[Any, _neutral_only(what="guided decoding")] = None
    guided_grammar: Annotated[Any, _neutral_only(what="guided decoding")] = None
    structured_outputs: Annotated[Any, _neutral_only(what="structured output")] = None
    allowed_token_ids: Annotated[Any, _neutral_only([])] = None
    bad_words: Annotated[Any, _neutral_only([])] = None
    logits_processors: Annotated[Any, _neutral_only([])] = None
    include_stop_str_in_output: Annotated[Any, _neutral_only(False)] = None
    skip_special_tokens: Annotated[Any, _neutral_only(True)] = None
    truncate_prompt_tokens: Annotated[Any, _neutral_only()] = None
    use_beam_search: Annotated[Any, _neutral_only(False)] = None
    length_penalty: Annotated[Any, _neutral_only(1)] = None
    prompt_logprobs: Annotated[Any, _neutral_only(0)] = None

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """The request in a decoded JSON body, or ProtocolError(400) naming the first bad field."""
        if not isinstance(data, dict):
            raise ProtocolError(400, f"request body must be a JSON object, got {type(data).__name__}")
        try:
            # Clients send "temperature": null for the default: dropped, pydantic fills the default in.
            return cls.model_validate({k: v for k, v in data.items() if v is not None})
        except ValidationError as e:
            raise _from_validation_error(e) from None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, stream_options: StreamOptions | None, info: ValidationInfo) -> Any:
        if stream_options is not None and info.data.get("stream") is False:   # absent when stream itself failed
            raise _invalid("only allowed when stream is true")
        return stream_options

    @property
    def include_usage(self) -> bool:
        """stream_options.include_usage: end the stream with a usage chunk."""
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def to_sampling_params(self, max_tokens: int | None = None) -> SamplingParams:
        """SamplingParams for the engine; `max_tokens` overrides (the server fills it from the model length)."""
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else self.max_tokens,
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                stop=list(self.stop), stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos)
        except ValueError as e:   # "field: reason", see SamplingParams.validate
            raise ProtocolError(400, str(e), str(e).split(":", 1)[0]) from None


class CompletionRequest(_Request):
    """POST /v1/completions. `prompt` is text or token ids, exactly one prompt."""
    max_tokens: Optional[TokenCount] = Field(16, validation_alias=AliasChoices("max_completion_tokens",
                                                                               "max_tokens"))   # OpenAI's default
    prompt: Prompt
    # a count of alternatives here, and 0 still asks for the sampled token's logprob
    logprobs: Annotated[Any, _neutral_only(False, what="logprobs")] = None
    echo: Annotated[StrictBool, AfterValidator(_refuse_echo)] = False
    suffix: Annotated[Any, _neutral_only("")] = None


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions. Message content is text or a list of text parts (joined by newlines)."""
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: TemplateKwargs = Field(default_factory=dict)
    chat_template: Annotated[Any, PlainValidator(_refuse_custom_template)] = None
    echo: Annotated[Any, _neutral_only(False)] = None   # vLLM's: the last message's text in the answer
    continue_final_message: Annotated[Any, _neutral_only(False)] = None

    @model_validator(mode="after")
    def _content_as_the_template_reads_it(self) -> Self:
        for i, message in enumerate(self.messages):
            if message["role"] == "developer":   # OpenAI's newer name for the system message
                message["role"] = "system"   # (a template that does not know it would render a literal turn)
            if message.get("content") is None:
                if message["role"] != "assistant":   # an assistant turn may be only tool calls
                    # Raised as is (pydantic passes it through): only this names the field inside the message.
                    raise _bad(f"messages[{i}].content", "is required")
                message["content"] = ""
            if "name" in message and message["name"] is None:
                del message["name"]
        return self


# ----------------------------------------------------------------------------- responses

def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def new_chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def _transfer(kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """A P's answer carries its kv_transfer_params for the router; every other answer leaves the field out
    (it is no part of OpenAI's schema, and strict clients need not see it)."""
    return {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else {}


def _choice(choice: dict[str, Any], token_ids: list[int] | None) -> dict[str, Any]:
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def completion_response(response_id: str, model: str, text: str, finish_reason: str | None,
                        usage: dict[str, Any], *, created: int | None = None,
                        kv_transfer_params: dict[str, Any] | None = None,
                        token_ids: list[int] | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": "text_completion", "created": created or int(time.time()),
            "model": model,
            "choices": [_choice({"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason},
                                token_ids)],
            "usage": usage, **_transfer(kv_transfer_params)}


def completion_chunk(response_id: str, model: str, created: int, text: str,
                     finish_reason: str | None = None, token_ids: list[int] | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [_choice({"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason},
                                token_ids)]}


def chat_response(response_id: str, model: str, text: str, finish_reason: str | None,
                  usage: dict[str, Any], *, created: int | None = None,
                  kv_transfer_params: dict[str, Any] | None = None,
                  token_ids: list[int] | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": "chat.completion", "created": created or int(time.time()),
            "model": model,
            "choices": [_choice({"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": finish_reason}, token_ids)],
            "usage": usage, **_transfer(kv_transfer_params)}


def chat_chunk(response_id: str, model: str, created: int, delta: dict[str, Any],
               finish_reason: str | None = None, token_ids: list[int] | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [_choice({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason},
                                token_ids)]}


def usage_chunk(response_id: str, model: str, created: int, usage: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices, only usage."""
    return {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage}


def model_card(model: str, max_model_len: int, created: int | None = None) -> dict[str, Any]:
    """GET /v1/models/{model}: the one model an instance serves."""
    return {"id": model, "object": "model", "created": created or int(time.time()), "owned_by": "pdserve",
            "root": model, "max_model_len": max_model_len}


def models_response(model: str, max_model_len: int, created: int | None = None) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, max_model_len, created)]}


# ----------------------------------------------------------------------------- SSE

def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def parse_sse_data(line: bytes | str) -> dict[str, Any] | None:
    """One SSE line → its JSON payload; None for blank lines, comments, other fields and [DONE]."""
    if isinstance(line, bytes):
        line = line.decode()
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return None
    return json.loads(data)


def is_sse_done(line: bytes | str) -> bool:
    if isinstance(line, bytes):
        line = line.decode()
    return line.strip() == "data: [DONE]"
