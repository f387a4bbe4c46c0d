"""What the instances' server and the router share at the door: keys, bodies, connections, logs.

A leaf module (aiohttp and protocol.py only), so both server/ and router/ import it.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import sys
from typing import Any

from aiohttp import HttpVersion11, http_exceptions, web

from pdserve.protocol import ProtocolError, error_body

ROUTER_KEY_HEADER = "X-PDServe-Router-Key"   # the router's secret, which the instances check
RETRY_AFTER_S = 1                 # what a 503 at capacity tells the client to wait
INLINE_PARSE_BYTES = 64 << 10     # larger bodies are parsed on a thread, off the event loop
# A connection idle this long (aiohttp's default is an hour), or never done sending its headers, is
# closed: connections that never make a request must not pile up.
IDLE_CONNECTION_TIMEOUT_S = 60.0


def use_fast_event_loop() -> str:
    """uvloop's event loop for what runs next (the router, an instance's API server) unless
    PDSERVE_UVLOOP=0: on mock instances at rate inf the router spent 414 us of CPU per request with it,
    516 with asyncio's (327 vs 353 in a shorter run; benchmarks/cpu_router_overhead.py). Returns the
    loop's name, for the log."""
    if os.environ.get("PDSERVE_UVLOOP", "1") == "0":
        return "asyncio"
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def runner_args() -> dict[str, Any]:
    """How the server and the router run their aiohttp app (web.AppRunner / web.run_app keywords):
    - handler_cancellation: a client that goes away cancels its handler, which aborts its request;
    - keepalive_timeout: see IDLE_CONNECTION_TIMEOUT_S (looked up at call time, so tests may shorten it);
    - auto_decompress off: OpenAI clients do not compress requests, and aiohttp's decoder answers a body
      that lies about its Content-Encoding in text, or with a 500; read_body refuses compressed bodies."""
    return {"handler_cancellation": True, "keepalive_timeout": IDLE_CONNECTION_TIMEOUT_S,
            "auto_decompress": False}


def bearer_token(request: web.Request) -> str | None:
    """The credentials of "Authorization: Bearer <token>" (the scheme is case-insensitive, RFC 7235)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" else None


def secret_matches(given: str | None, expected: str | None) -> bool:
    """Constant-time comparison of a header with a secret. aiohttp hands over non-UTF-8 header bytes as
    surrogate escapes: they are a wrong key (401), not an encoding error (500)."""
    if given is None or expected is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
        if "integer string conversion" in str(e):   # Python's own limit: its message names sys internals
            raise ProtocolError(400, f"the request body has an integer of more than "
                                     f"{sys.get_int_max_str_digits()} digits") from None
        raise ProtocolError(400, f"the request body is not valid JSON: {e}") from None


async def read_body(request: web.Request, timeout_s: float, max_bytes: int) -> bytes:
    """The raw body within timeout_s (408: a slow upload holds a connection, not the server) and at
    most max_bytes (413); a compressed body is a 415, one that cannot be read a 400."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ProtocolError(415, "compressed request bodies are not accepted (Content-Encoding must be identity)")
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise ProtocolError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise ProtocolError(413, f"the request body is larger than {max_bytes} bytes") from None
    except web.RequestPayloadError:
        raise ProtocolError(400, "the request body could not be read (does it match its "
                                 "Content-Length or chunked encoding?)") from None


async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` as aiohttp answers it; any other expectation a JSON 417 (aiohttp's own
    answer is text, and a 500 when the value is not UTF-8)."""
    if request.headers.get("Expect", "").lower() == "100-continue":
        if request.version == HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0   # the body's response has not started yet
        return None
    return web.json_response(error_body("only 'Expect: 100-continue' is supported", status=417), status=417)


class _QuietMalformedRequests(logging.Filter):
    """aiohttp logs every malformed HTTP request (a header too long, control bytes, a bad encoding) as an
    ERROR with a traceback that quotes the bytes, a key's first bytes among them: a client could fill the
    log, with secrets. One line without the bytes instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        # (RequestPayloadError: the unread rest of a refused request's body that aiohttp drains)
        if not isinstance(exc, (http_exceptions.HttpProcessingError, web.RequestPayloadError)):
            return True
        record.msg, record.args = "malformed HTTP request refused (%s)", (type(exc).__name__,)
        record.exc_info, record.exc_text, record.levelno, record.levelname = None, None, logging.INFO, "INFO"
        return True


def quiet_malformed_requests() -> None:
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _QuietMalformedRequests) for f in logger.filters):
        logger.addFilter(_QuietMalformedRequests())
