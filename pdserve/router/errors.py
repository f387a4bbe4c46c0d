"""The router's errors and their public wording: what a client may learn of a failure (the backend by its
pool and index, the kind of failure) and what stays in the log (URLs, exceptions, backend error text)."""
from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from aiohttp import web

from pdserve.protocol import error_body

logger = logging.getLogger(__name__)

NETWORK_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def json_error(message: str, status: int, error_type: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status=status, type=error_type), status=status)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class ClientError(Exception):
    """The client's request is refused before any backend sees it."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = status, message, param, retry_after

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        headers = dict(headers or {})
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return web.json_response(error_body(self.message, status=self.status, param=self.param),
                                 status=self.status, headers=headers)


def error_message_of(data: bytes) -> str | None:
    """The message of an OpenAI-style error body, cut to 500 characters; None if there is none."""
    try:
        error = json.loads(data).get("error")
    except (ValueError, AttributeError, RecursionError):
        return None
    message = error.get("message") if isinstance(error, dict) else None
    return message[:500] if isinstance(message, str) and message else None


class BackendError(Exception):
    """A hop failed. `body` set: the backend's own 4xx, passed through; else a 502 naming the backend by its
    pool and index. str(e) (for the log) has the URL and detail; the client's message has neither."""

    def __init__(self, role: str, url: str, detail: str, status: int = 502, body: bytes | None = None,
                 content_type: str = "application/json", never_took_request: bool = False,
                 public_detail: str = "failed", retry_after: str | None = None) -> None:
        # a 4xx is the client's doing: the backend refused the request, it did not fail
        refused = body is not None and retry_after is None and 400 <= status < 500 and status != 429
        super().__init__(f"{role} backend {url} {'refused the request' if refused else 'failed'}: {detail}")
        self.is_client_error = refused
        self.role, self.url, self.public_detail = role, url, public_detail
        self.status, self.body, self.content_type, self.retry_after = status, body, content_type, retry_after
        # connection error, timeout, 5xx, 503 at capacity; never the client's 4xx
        self.is_retryable = body is None or retry_after is not None
        # Certain only where no connection was made or the backend answered with an error status.
        self.never_took_request = never_took_request

    @property
    def is_at_capacity(self) -> bool:
        """The backend refused the request because it is full: healthy, and worth asking again later."""
        return self.status == 503 and self.retry_after is not None

    def public_message(self, names: dict[str, str]) -> str:
        return f"the {names.get(self.url, self.role)} instance {self.public_detail}"

    def response(self, names: dict[str, str]) -> web.Response:
        if self.body is not None:
            headers = {"Content-Type": self.content_type}
            if self.retry_after is not None:
                headers["Retry-After"] = self.retry_after
            return web.Response(status=self.status, body=self.body, headers=headers)
        return json_error(self.public_message(names), self.status, "backend_error")


def public_detail(e: BaseException) -> str:
    """What a client may learn of a network failure: its kind, not the address or the exception."""
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    if isinstance(e, aiohttp.ClientConnectorError):
        return "is unreachable"
    return "dropped the connection"


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own 404 / 405 / 413 as OpenAI-style JSON, like every other answer; anything unexpected a
    JSON 500 whose details stay in the log."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        return web.json_response(error_body(f"{e.reason}: {request.method} {request.path}", status=e.status),
                                 status=e.status, headers=headers)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:  # noqa: BLE001 - nothing a client sends may take the router down
        logger.exception("%s %s failed", request.method, request.path)
        return web.json_response(error_body("internal server error", status=500), status=500)
