"""OpenAI-compatible request and response schemas, shared by server, proxy and bench.

Requests are parsed from decoded JSON into plain dataclasses; anything a client can get wrong raises
`ProtocolError(status, message, param)`, which the server turns into an OpenAI-style error body.
Unknown fields are accepted and ignored, so clients that send vendor extras keep working.
`kv_transfer_params` travels as an opaque dict with vLLM's field names (see kv_transfer/base.py).

Pure Python: no torch, no aiohttp, so the proxy and the benchmark client can import it anywhere.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.sampling_params import SamplingParams

SSE_DONE = b"data: [DONE]\n\n"

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
                503: "service_unavailable"}


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


# ----------------------------------------------------------------------------- field readers
# Each reads one field of a JSON object, checks its type and range, and names it when it fails.
# bool is a subclass of int in Python, so every numeric reader rejects it explicitly.

def _bad(param: str, message: str) -> ProtocolError:
    return ProtocolError(400, f"{param}: {message}", param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(data: dict, key: str, default: int | None, *, lo: int | None = None,
         hi: int | None = None) -> int | None:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():   # some clients send 16.0
        value = int(value)
    if not _is_int(value):
        raise _bad(key, f"expected an integer, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise _bad(key, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise _bad(key, f"must be <= {hi}, got {value}")
    return value


def _float(data: dict, key: str, default: float, *, lo: float, hi: float, lo_open: bool = False) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(key, f"expected a number, got {type(value).__name__}")
    value = float(value)
    in_range = (lo < value if lo_open else lo <= value) and value <= hi   # False for NaN
    if not in_range:
        raise _bad(key, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")
    return value


def _bool(data: dict, key: str, default: bool) -> bool:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(key, f"expected a boolean, got {type(value).__name__}")
    return value


def _optional_dict(data: dict, key: str) -> dict | None:
    value = data.get(key)
    if value is not None and not isinstance(value, dict):
        raise _bad(key, f"expected an object, got {type(value).__name__}")
    return value


def _stop(data: dict) -> list[str]:
    value = data.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise _bad("stop", "expected a non-empty string or a list of non-empty strings")
    return value


def _token_ids(value: Any, param: str) -> list[int] | None:
    """`value` as a list of token ids, or None when it is not a list of ints."""
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        return None
    if any(t < 0 for t in value):
        raise _bad(param, "token ids must be >= 0")
    return value


@dataclass
class _Common:
    """Fields both endpoints share: sampling, streaming, P/D."""
    model: str | None = None
    max_tokens: int | None = None         # None: up to the model's length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False           # stream_options.include_usage
    kv_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool = False        # extension (as vLLM's): choices carry "token_ids"

    def _read_common(self, data: dict, default_max_tokens: int | None) -> None:
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("model", f"expected a string, got {type(model).__name__}")
        self.model = model
        # max_completion_tokens is the newer name; it wins when both are given.
        max_tokens = _int(data, "max_completion_tokens", None, lo=1)
        self.max_tokens = max_tokens if max_tokens is not None else _int(data, "max_tokens", default_max_tokens, lo=1)
        self.temperature = _float(data, "temperature", 1.0, lo=0.0, hi=100.0)
        self.top_p = _float(data, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
        self.top_k = _int(data, "top_k", 0, lo=-1)
        self.seed = _int(data, "seed", None, lo=-2**63, hi=2**64 - 1)   # what a torch generator takes
        self.stop = _stop(data)
        stop_token_ids = data.get("stop_token_ids")
        self.stop_token_ids = [] if stop_token_ids is None else _token_ids(stop_token_ids, "stop_token_ids")
        if self.stop_token_ids is None:
            raise _bad("stop_token_ids", "expected a list of integers")
        self.ignore_eos = _bool(data, "ignore_eos", False)
        self.return_token_ids = _bool(data, "return_token_ids", False)
        self.stream = _bool(data, "stream", False)
        stream_options = _optional_dict(data, "stream_options")
        if stream_options is not None:
            if not self.stream:
                raise _bad("stream_options", "only allowed when stream is true")
            self.include_usage = _bool(stream_options, "include_usage", False)
        n = _int(data, "n", 1)
        if n != 1:
            raise _bad("n", f"only n=1 is supported, got {n}")
        best_of = _int(data, "best_of", 1)
        if best_of != 1:
            raise _bad("best_of", f"only best_of=1 is supported, got {best_of}")
        if data.get("logprobs") not in (None, False) or data.get("top_logprobs") not in (None, 0):
            raise _bad("logprobs", "logprobs are not supported")
        self.kv_transfer_params = _optional_dict(data, "kv_transfer_params")

    def to_sampling_params(self, max_tokens: int | None = None) -> SamplingParams:
        """SamplingParams for the engine; `max_tokens` overrides (the server fills it from the model length)."""
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else self.max_tokens,
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                stop=list(self.stop), stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos)
        except ValueError as e:   # "field: reason", see SamplingParams.validate
            raise ProtocolError(400, str(e), str(e).split(":", 1)[0]) from None


def _require_object(data: Any) -> dict:
    if not isinstance(data, dict):
        raise ProtocolError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


@dataclass
class CompletionRequest(_Common):
    """POST /v1/completions. `prompt` is text or token ids, exactly one prompt."""
    prompt: str | list[int] = ""
    echo: bool = False

    @classmethod
    def from_json(cls, data: Any) -> "CompletionRequest":
        data = _require_object(data)
        req = cls()
        req._read_common(data, default_max_tokens=16)   # OpenAI's default for completions
        req.prompt = _prompt(data.get("prompt"))
        if _bool(data, "echo", False):
            raise _bad("echo", "echo is not supported")
        return req


def _prompt(value: Any) -> str | list[int]:
    if value is None:
        raise _bad("prompt", "is required")
    # A batch of one ([str] or [[int]]) is unwrapped; larger batches are refused.
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) != 1:
            raise _bad("prompt", f"only one prompt per request is supported, got {len(value)}")
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise _bad("prompt", "must not be empty")
        return value
    token_ids = _token_ids(value, "prompt")
    if token_ids is None:
        raise _bad("prompt", "expected a string, a list of token ids, or a list of one of these")
    if not token_ids:
        raise _bad("prompt", "must not be empty")
    return token_ids


@dataclass
class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions. Message content is text or a list of text parts (joined by newlines)."""
    messages: list[dict[str, Any]] = field(default_factory=list)   # [{"role", "content": str}, ...]
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> "ChatCompletionRequest":
        data = _require_object(data)
        req = cls()
        req._read_common(data, default_max_tokens=None)   # chat: up to the model's length
        req.messages = _messages(data.get("messages"))
        req.add_generation_prompt = _bool(data, "add_generation_prompt", True)
        req.chat_template_kwargs = _optional_dict(data, "chat_template_kwargs") or {}
        return req


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "expected a non-empty list of messages")
    messages = []
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(param, "expected an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or not role:   # any role the chat template understands
            raise _bad(f"{param}.role", f"expected a non-empty string, got {role!r}")
        content = _content(message.get("content"), f"{param}.content")
        if content is None and role != "assistant":
            raise _bad(f"{param}.content", "is required")
        out = {"role": role, "content": content if content is not None else ""}
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        messages.append(out)
    return messages


def _content(value: Any, param: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(param, "expected a string or a list of content parts")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{j}]", "only parts of the form {\"type\": \"text\", \"text\": str} are supported")
        texts.append(part["text"])
    return "\n".join(texts)


# ----------------------------------------------------------------------------- responses

def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def new_chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


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
            "usage": usage, "kv_transfer_params": kv_transfer_params}


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
            "usage": usage, "kv_transfer_params": kv_transfer_params}


def chat_chunk(response_id: str, model: str, created: int, delta: dict[str, Any],
               finish_reason: str | None = None, token_ids: list[int] | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [_choice({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason},
                                token_ids)]}


def usage_chunk(response_id: str, model: str, created: int, usage: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices, only usage."""
    return {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage}


def models_response(model: str, max_model_len: int, created: int | None = None) -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": model, "object": "model", "created": created or int(time.time()),
                      "owned_by": "pdserve", "root": model, "max_model_len": max_model_len}]}


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
