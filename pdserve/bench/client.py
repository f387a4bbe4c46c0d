"""Streaming OpenAI-compatible client: one request in, one RequestRecord out, never an exception.

Each request streams (`stream: true`, `stream_options.include_usage`) and every chunk that arrives is
timestamped with time.perf_counter(). Token counts come from the server's `usage`, not from
counting chunks (a chunk may carry several tokens). A request fails, with its error message kept, on
an HTTP error, a connection error or timeout, an error event in the stream, or a stream that ends
without `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from pdserve.bench.workloads import RequestSpec

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class RequestRecord:
    """What one request measured. Times are seconds: `start_time` and `scheduled_time` from the
    start of the benchmark, the others from `start_time` (ttft) or between chunks (itls)."""
    index: int
    success: bool
    error: str | None = None
    scheduled_time: float = 0.0          # when the arrival process wanted it sent
    start_time: float = 0.0              # when it was sent (later under --max-concurrency)
    ttft: float | None = None            # to the first chunk carrying output
    e2e: float | None = None             # to the end of the stream (or the failure)
    itls: list[float] = field(default_factory=list)  # gaps between chunks carrying output
    prompt_tokens: int | None = None     # from usage
    output_tokens: int | None = None     # from usage
    finish_reason: str | None = None
    conversation: int | None = None      # multi-turn: the user whose conversation this turn is
    turn: int | None = None              # multi-turn: the turn's index in its conversation, from 0
    # the streamed text, kept only when asked (a conversation's next turn resends it); not in to_dict
    output_text: str | None = field(default=None, repr=False)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if not self.success or self.ttft is None or self.e2e is None or not self.output_tokens \
                or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["output_text"]
        for key in ("conversation", "turn"):  # independent requests keep their JSON as before
            if data[key] is None:
                del data[key]
        return {**data, "tpot": self.tpot}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RequestRecord":
        """Back from to_dict() (e.g. a saved --out file); derived fields such as tpot are dropped."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def normalize_base_url(base_url: str) -> str:
    """"http://h:8000", "http://h:8000/" and "http://h:8000/v1" all name the same server."""
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_first_model(session: aiohttp.ClientSession, base_url: str, api_key: str | None = None) -> str:
    """The first model id from GET /v1/models; ValueError saying why when there is none."""
    url = normalize_base_url(base_url) + "/v1/models"
    try:
        async with session.get(url, headers=auth_headers(api_key)) as resp:
            if resp.status != 200:
                body = (await resp.text())[:MAX_ERROR_CHARS]
                raise ValueError(f"model: GET {url} returned HTTP {resp.status}: {body}")
            data = await resp.json(content_type=None)
    except aiohttp.ClientError as e:
        raise ValueError(f"model: GET {url} failed: {type(e).__name__}: {e}") from None
    models = data.get("data") if isinstance(data, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise ValueError(f"model: GET {url} listed no models; pass --model")
    return str(models[0]["id"])


def build_payload(spec: RequestSpec, *, endpoint: str, model: str, ignore_eos: bool = False,
                  temperature: float = 0.0, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "max_tokens": spec.output_len, "temperature": temperature,
                               "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        payload["messages"] = spec.messages if spec.messages is not None else \
            [{"role": "user", "content": spec.prompt}]
    else:
        payload["prompt"] = spec.prompt
    if ignore_eos:
        payload["ignore_eos"] = True   # vLLM's extension, also understood by pdserve
    if extra_body:
        payload.update(extra_body)
    return payload


def _chunk_output(data: dict[str, Any]) -> tuple[bool, str | None, str]:
    """(does this chunk carry output, its finish_reason, its answer text)."""
    has_output, finish_reason, answer = False, None, ""
    for choice in data.get("choices") or ():
        delta = choice.get("delta")
        text = (delta.get("content") or delta.get("reasoning_content")) if isinstance(delta, dict) \
            else choice.get("text")
        has_output = has_output or bool(text) or bool(choice.get("token_ids"))
        finish_reason = choice.get("finish_reason") or finish_reason
        # reasoning is not part of the answer a chat client sends back with its history
        answer += (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
    return has_output, finish_reason, answer


def _error_message(data: Any) -> str:
    err = data.get("error") if isinstance(data, dict) else data
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict[str, Any], *,
                       index: int = 0, bench_start: float | None = None, scheduled_time: float = 0.0,
                       headers: dict[str, str] | None = None, collect_text: bool = False) -> RequestRecord:
    """Send one streaming request to `url` and measure it; failures come back as records.
    collect_text: keep the answer's text in the record's output_text."""
    bench_start = time.perf_counter() if bench_start is None else bench_start
    start = time.perf_counter()
    ttft: float | None = None
    last_output: float | None = None
    itls: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    finish_reason: str | None = None
    is_done = False
    error: str | None = None

    def record(success: bool, error: str | None, end: float) -> RequestRecord:
        return RequestRecord(
            index=index, success=success, error=error, scheduled_time=scheduled_time,
            start_time=start - bench_start, ttft=ttft, e2e=end - start, itls=itls,
            prompt_tokens=usage.get("prompt_tokens"), output_tokens=usage.get("completion_tokens"),
            finish_reason=finish_reason, output_text="".join(pieces) if collect_text else None)

    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.text())[:MAX_ERROR_CHARS]
                return record(False, f"HTTP {resp.status}: {body}", time.perf_counter())
            buffer = b""
            event = ""
            async for raw in resp.content.iter_any():
                now = time.perf_counter()  # one arrival time for every event in this read
                buffer += raw
                *lines, buffer = buffer.split(b"\n")
                for line_bytes in lines:
                    line = line_bytes.decode("utf-8", errors="replace").rstrip("\r")
                    if not line:            # the blank line that ends an SSE event
                        event = ""
                        continue
                    if line.startswith("event:"):
                        event = line[6:].strip()
                        continue
                    if not line.startswith("data:"):
                        continue            # SSE comments (": ping") and fields we do not use
                    text = line[5:].strip()
                    if text == "[DONE]":
                        is_done = True
                        continue
                    try:
                        data = json.loads(text)
                    except json.JSONDecodeError:
                        error = f"bad JSON in stream: {text[:MAX_ERROR_CHARS]}"
                        break
                    if not isinstance(data, dict):
                        error = f"stream chunk is not a JSON object: {text[:MAX_ERROR_CHARS]}"
                        break
                    if event == "error" or data.get("error"):
                        error = f"error event in stream: {_error_message(data)}"[:MAX_ERROR_CHARS]
                        break
                    if data.get("usage"):
                        usage = data["usage"]
                    has_output, reason, text = _chunk_output(data)
                    finish_reason = reason or finish_reason
                    if collect_text:
                        pieces.append(text)
                    if has_output:
                        if ttft is None:
                            ttft = now - start
                        else:
                            itls.append(now - last_output)
                        last_output = now
                if error is not None:
                    break
            end = time.perf_counter()
    except asyncio.TimeoutError:
        return record(False, "timeout", time.perf_counter())
    except aiohttp.ClientError as e:
        return record(False, f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS], time.perf_counter())
    except OSError as e:
        return record(False, f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS], time.perf_counter())
    if error is not None:
        return record(False, error, end)
    if not is_done:
        return record(False, "stream ended without [DONE]", end)
    return record(True, None, end)
