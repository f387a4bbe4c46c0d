"""What the fuzz tests share: an event loop in a thread with an HTTP driver (aiohttp and raw sockets), the
properties every answer must have, an engine stand-in that checks kv_transfer_params as the real one does,
and a log watcher.

The properties (check_answer): no exception escapes (the client gets an answer), no 5xx but a 503 with
Retry-After or a 504, every non-2xx body OpenAI-style JSON whose code is the status, no internals in any
message (tracebacks, exception class names, pydantic's URLs, backend addresses), and every 2xx a valid
answer of its route (a completion, or an SSE stream of chunks that ends with `data: [DONE]`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from hypothesis import HealthCheck, settings

from pdserve.kv_transfer.base import KVTransferParams
from tests.server.fake_engine import FakeEngine, GenerateCall, make_tiny_tokenizer

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
# The fast layer's instances: the tiny tokenizer, a short context, a small body limit (an over-limit
# body is then cheap to send).
TOKENIZER = make_tiny_tokenizer()
VOCAB_SIZE = len(TOKENIZER)            # 17: <unk> <s> </s> and the tiny tokenizer's words
MAX_MODEL_LEN = 64
MAX_PROMPT_CHARS = 32 * MAX_MODEL_LEN  # the server's default for this context
MAX_BODY_BYTES = 256 << 10
# Internals that must never reach a client. A match that the client itself wrote (an echoed field name
# or value) is not a leak: check_answer skips those.
INTERNALS = re.compile(r"Traceback|pydantic\.dev|pydantic_core|errors\.pydantic|File \"|line \d+, in |<class '|"
                       r"object at 0x|\w\.py\b|\b[A-Z][A-Za-z]*(?:Error|Exception)\b|\b(?:aiohttp|asyncio|"
                       r"concurrent|multiprocessing)\.")
# Multiplies every test's max_examples: the default keeps tests/fuzz within about 90 s on 2 shared CPU
# cores; PDSERVE_FUZZ_SCALE=10 runs a deeper (and still seeded) search.
FUZZ_SCALE = float(os.environ.get("PDSERVE_FUZZ_SCALE", "1"))


def fuzz_settings(max_examples: int) -> settings:
    """Seeded and bounded: the same examples on every run, no example database, no per-example deadline
    (the machine is shared); the health checks that only say "slow" or "large" are off."""
    return settings(derandomize=True, database=None, deadline=None, print_blob=True,
                    max_examples=max(1, int(max_examples * FUZZ_SCALE)),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.large_base_example,
                                           HealthCheck.function_scoped_fixture])


# ----------------------------------------------------------------------------- the loop and the driver

class LoopThread:
    """An event loop in a daemon thread: servers and the HTTP client live there; tests call run()."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="fuzz-loop")
        self.thread.start()
        self.session: aiohttp.ClientSession | None = None

        async def make_session() -> aiohttp.ClientSession:
            # force_close: a server that closes after an error answer never hands us a dead connection
            return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                         auto_decompress=False)

        self.session = self.run(make_session())

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.session.close(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    # -- HTTP ------------------------------------------------------------------------------------
    def request(self, method: str, url: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = 30.0) -> "Answer":
        return self.run(self._request(method, url, body, headers or {}, timeout), timeout + 10)

    def requests_at_once(self, requests: list[tuple[str, str, bytes | None, dict]],
                         timeout: float = 30.0) -> list["Answer"]:
        """(method, url, body, headers) each, all in flight together; the answers in the same order."""
        async def all_at_once() -> list[Answer]:
            return await asyncio.gather(*(self._request(m, u, b, h, timeout) for m, u, b, h in requests))
        return self.run(all_at_once(), timeout + 10)

    async def _request(self, method: str, url: str, body: bytes | None, headers: dict, timeout: float) -> "Answer":
        try:
            async with self.session.request(method, url, data=body, headers=headers,
                                            skip_auto_headers=("Content-Type",),
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                data = await resp.read()
                return Answer(resp.status, {k.lower(): v for k, v in resp.headers.items()}, data)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return Answer(0, {}, b"", error=f"{type(e).__name__}: {e}")

    def raw(self, port: int, data: bytes, timeout: float = 20.0, *, half_close: bool = False) -> "Answer | None":
        """Send bytes as they are on a fresh socket; None when the server closed without answering."""
        return self.run(self._raw(port, data, timeout, half_close), timeout + 10)

    async def _raw(self, port: int, data: bytes, timeout: float, half_close: bool) -> "Answer | None":
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(data)
            await writer.drain()
            if half_close:
                writer.write_eof()
            received = await asyncio.wait_for(reader.read(), timeout)
        except (ConnectionError, OSError):
            received = b""
        except asyncio.TimeoutError:
            return Answer(0, {}, b"", error="no answer within the timeout (the server hung?)")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        return parse_http_response(received) if received else None


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    error: str | None = None     # the client's own failure: no answer came back

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip().lower()


def parse_http_response(data: bytes) -> Answer:
    while True:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        if status != 100:
            break
        data = rest   # 100 Continue, then the answer
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            body += rest[:size]
            rest = rest[size + 2:]
        return Answer(status, headers, bytes(body))
    if "content-length" in headers:
        return Answer(status, headers, rest[:int(headers["content-length"])])
    return Answer(status, headers, rest)


def raw_request(method: str, path: str, body: bytes, header_lines: list[tuple[bytes, bytes]],
                content_length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
    lines += [name + b": " + value for name, value in header_lines]
    if content_length is not None:
        lines.append(b"Content-Length: %d" % content_length)
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


# ----------------------------------------------------------------------------- the properties

class Finding(AssertionError):
    pass


def check_answer(answer: Answer | None, route: str, request: bytes = b"", *,
                 secrets: tuple[str, ...] = (), backend_addresses: tuple[str, ...] = (),
                 allow_no_answer: bool = False) -> None:
    """Every property an answer to one request must have; raises Finding naming the broken one."""
    where = f"{route} <- {request[:300]!r}{'...' if len(request) > 300 else ''}"
    if answer is None:
        if allow_no_answer:
            return
        raise Finding(f"{where}: the server closed the connection without answering")
    if answer.error is not None:
        raise Finding(f"{where}: no answer: {answer.error}")
    status = answer.status
    text = answer.body.decode("utf-8", "replace")
    if status >= 500 and not (status == 503 and "retry-after" in answer.headers) and status != 504:
        raise Finding(f"{where}: HTTP {status}: {text[:500]}")
    for address in backend_addresses:
        if address in text:
            raise Finding(f"{where}: HTTP {status} names a backend address {address}: {text[:500]}")
    for secret in secrets:
        if secret in text:
            raise Finding(f"{where}: HTTP {status} echoes a secret: {text[:500]}")
    if status >= 400:
        _check_error_body(answer, where, request)
    elif route in GENERATION_ROUTES:
        if answer.content_type == "text/event-stream":
            _check_stream(answer, where, request, is_chat=route.endswith("chat/completions"))
        else:
            _check_completion(_json(answer, where), where, is_chat=route.endswith("chat/completions"))
    else:
        _check_small_route(answer, route, where)


def _json(answer: Answer, where: str) -> Any:
    try:
        return json.loads(answer.body)
    except ValueError:
        raise Finding(f"{where}: HTTP {answer.status} with a body that is not JSON: {answer.body[:300]!r}") from None


def _check_message(message: str, where: str, request: bytes) -> None:
    for match in INTERNALS.finditer(message):
        if match.group(0).encode() not in request:   # not the client's own words echoed back
            raise Finding(f"{where}: an error message shows internals ({match.group(0)!r}): {message[:500]}")


def _check_error(error: Any, status: int, where: str, request: bytes) -> None:
    if not (isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]
            and isinstance(error.get("type"), str) and "param" in error
            and type(error.get("code")) is int and error["code"] == status):
        raise Finding(f"{where}: HTTP {status}: not an OpenAI-style error with code {status}: {error!r:.500}")
    _check_message(error["message"], where, request)


def _check_error_body(answer: Answer, where: str, request: bytes) -> None:
    if answer.content_type != "application/json":
        raise Finding(f"{where}: HTTP {answer.status} with Content-Type {answer.content_type!r}: "
                      f"{answer.body[:300]!r}")
    body = _json(answer, where)
    if not isinstance(body, dict) or set(body) != {"error"}:
        raise Finding(f"{where}: HTTP {answer.status}: not {{'error': ...}}: {body!r:.500}")
    _check_error(body["error"], answer.status, where, request)


def _check_usage(usage: Any, where: str) -> None:
    if not (isinstance(usage, dict) and all(type(usage.get(k)) is int and usage[k] >= 0
                                            for k in ("prompt_tokens", "completion_tokens", "total_tokens"))):
        raise Finding(f"{where}: bad usage {usage!r}")


def _check_completion(body: Any, where: str, *, is_chat: bool) -> None:
    ok = (isinstance(body, dict) and body.get("object") == ("chat.completion" if is_chat else "text_completion")
          and isinstance(body.get("id"), str) and isinstance(body.get("choices"), list)
          and len(body["choices"]) == 1 and isinstance(body["choices"][0], dict))
    if not ok:
        raise Finding(f"{where}: 200 that is not a completion: {body!r:.500}")
    choice = body["choices"][0]
    text = choice.get("message", {}).get("content") if is_chat else choice.get("text")
    if not isinstance(text, str) or choice.get("finish_reason") not in ("stop", "length"):
        raise Finding(f"{where}: 200 with a bad choice: {choice!r:.500}")
    _check_usage(body.get("usage"), where)


def _check_stream(answer: Answer, where: str, request: bytes, *, is_chat: bool) -> None:
    if not answer.body.endswith(b"data: [DONE]\n\n"):
        raise Finding(f"{where}: a stream that does not end with data: [DONE]: ...{answer.body[-300:]!r}")
    events = [e for e in answer.body.split(b"\n\n") if e.strip()]
    finish_reasons = []
    for i, event in enumerate(events):
        if not event.startswith(b"data: "):
            raise Finding(f"{where}: an SSE event that is not data: {event[:300]!r}")
        data = event[len(b"data: "):]
        if data == b"[DONE]":
            if i != len(events) - 1:
                raise Finding(f"{where}: data: [DONE] before the end of the stream")
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            raise Finding(f"{where}: an SSE event that is not JSON: {data[:300]!r}") from None
        if isinstance(chunk, dict) and "error" in chunk:
            _check_error(chunk["error"], chunk["error"].get("code") if isinstance(chunk["error"], dict) else None,
                         where, request)
            if chunk["error"]["code"] != 504:
                raise Finding(f"{where}: an error event in a stream: {chunk!r:.500}")
            continue
        ok = (isinstance(chunk, dict) and isinstance(chunk.get("choices"), list)
              and chunk.get("object") == ("chat.completion.chunk" if is_chat else "text_completion"))
        if not ok:
            raise Finding(f"{where}: an SSE chunk that is not a completion chunk: {chunk!r:.500}")
        if not chunk["choices"]:
            _check_usage(chunk.get("usage"), where)
            continue
        choice = chunk["choices"][0]
        piece = choice.get("delta", {}).get("content", "") if is_chat else choice.get("text")
        if not isinstance(piece, str):
            raise Finding(f"{where}: a chunk without text: {chunk!r:.500}")
        finish_reasons.append(choice.get("finish_reason"))
    if [r for r in finish_reasons if r is not None] not in ([], ["stop"], ["length"]):
        raise Finding(f"{where}: finish reasons {finish_reasons}")


def _check_small_route(answer: Answer, route: str, where: str) -> None:
    if route == "/metrics":
        if answer.status != 200 or b"pdserve:" not in answer.body:
            raise Finding(f"{where}: /metrics answered {answer.status}: {answer.body[:200]!r}")
        return
    if route == "/health":
        if answer.status != 200:
            raise Finding(f"{where}: /health answered {answer.status}")
        return
    body = _json(answer, where)
    ok = {
        "/v1/models": lambda b: b.get("object") == "list" and isinstance(b.get("data"), list),
        "/tokenize": lambda b: isinstance(b.get("tokens"), list) and b.get("count") == len(b["tokens"]),
        "/detokenize": lambda b: isinstance(b.get("prompt"), str),
        "/v1/kv/release": lambda b: answer.status == 202 and b == {"status": "accepted"},
    }[route]
    if not (isinstance(body, dict) and ok(body)):
        raise Finding(f"{where}: HTTP {answer.status} that is not a {route} answer: {body!r:.500}")


# ----------------------------------------------------------------------------- the engine stand-in

@dataclass
class FuzzEngine(FakeEngine):
    """FakeEngine that, like AsyncEngine, refuses malformed kv_transfer_params (ValueError before the
    first output) and takes POST /v1/kv/release; an inner stream the caller drops is closed at once."""
    engine_id: str = "fuzz-engine"
    refused: set[str] = field(default_factory=set)
    released: list[dict] = field(default_factory=list)

    def generate(self, request_id, prompt_token_ids, params, kv_transfer_params=None):
        self.calls.append(GenerateCall(request_id, list(prompt_token_ids), params, kv_transfer_params))
        return self._checked(request_id, prompt_token_ids, params, kv_transfer_params)

    async def _checked(self, request_id, prompt_token_ids, params, kv_transfer_params):
        try:
            KVTransferParams.from_dict(kv_transfer_params)   # as AsyncEngine.generate does
        except ValueError:
            self.refused.add(request_id)
            raise
        async with contextlib.aclosing(self._generate(request_id, prompt_token_ids, params)) as outputs:
            async for output in outputs:
                yield output

    def release_kv(self, kv_transfer_params: dict) -> None:   # AsyncEngine.release_kv's contract
        params = KVTransferParams.from_dict(kv_transfer_params)
        if params is None or params.remote_request_id is None:
            raise ValueError("kv_transfer_params: remote_request_id is missing")
        if params.remote_engine_id != self.engine_id:
            raise LookupError(f"these KV blocks are not held here (engine {self.engine_id!r})")
        self.released.append(kv_transfer_params)

    def leaks(self) -> list[str]:
        """What the engine still holds, or requests that neither finished nor were aborted nor refused."""
        seen = {call.request_id for call in self.calls}
        unaccounted = seen - self.finished - self.aborted - self.refused
        return ([f"running: {sorted(self.running)}"] if self.running else []) + \
               ([f"neither finished nor aborted: {sorted(unaccounted)}"] if unaccounted else [])


# ----------------------------------------------------------------------------- logs

class ErrorLog(logging.Handler):
    """Collects ERROR records: an exception the server only logged is a finding too. aiohttp's own
    complaints about bytes that are not HTTP (a bad header) are not: they never reach the app."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def findings(self, since: int = 0) -> list[str]:
        """The records from index `since` on that are findings."""
        out = []
        for r in self.records[since:]:   # (aiohttp's malformed-request errors: INFO, http_guard.py)
            exc = r.exc_info[1] if r.exc_info else None
            out.append(f"{r.name}: {r.getMessage()[:300]}" + (f" ({type(exc).__name__}: {exc})" if exc else ""))
        return out

    @contextlib.contextmanager
    def installed(self):
        root = logging.getLogger()
        root.addHandler(self)
        try:
            yield self
        finally:
            root.removeHandler(self)


class Tally:
    """Statuses per route, to show (and check) what the fuzzer reached."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = {}

    def add(self, route: str, answer: Answer | None) -> None:
        self.counts.setdefault(route, Counter())[answer.status if answer else None] += 1

    def num_ok(self, route: str) -> int:
        return sum(n for s, n in self.counts.get(route, Counter()).items() if s is not None and 200 <= s < 300)

    def __str__(self) -> str:
        return "; ".join(f"{route}: {dict(c)}" for route, c in sorted(self.counts.items()))
