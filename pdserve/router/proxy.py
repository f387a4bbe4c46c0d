"""The proxy: an OpenAI-compatible front that pairs a prefill (P) instance with a decode (D) instance.

Lifecycle of one `POST /v1/completions` or `POST /v1/chat/completions` in P/D mode:
1. Admission: past --max-in-flight requests a 503 with Retry-After. Check the api key (if set); read the
   client's JSON object within the body timeout (parsed off the event loop when large), else 400/408/413.
   Drop any kv_transfer_params, resume or router_token_ids the client sent: those are the router's alone.
   Take the client's X-Request-Id or make one: both hops carry it, and the router key, never the client's
   Authorization. Check the body against the OpenAI schema (protocol.py) before any backend works on it: a
   request D would refuse must not cost a prefill first (400 naming the field).
2. Prefill hop: pick a P (round-robin) and POST it the body with `kv_transfer_params: {do_remote_decode: true}`,
   `stream: false`, no `stream_options`, and the client's own max_tokens: P checks prompt + max_tokens against
   its context, as D will, then generates one token (a prefill for a remote decode always does).
   A 503 from a backend (at capacity) goes to the client as a 503 with its Retry-After, after the other P.
   A 4xx from P (validation) goes to the client as is, except 401/403 (the router's own key was refused: a
   502). A connection error, timeout or 5xx is retried once on another P when there is one, then becomes a
   502 naming the P by its pool and index ("prefill-0"); URLs and backend error text stay in the log.
3. Take `kv_transfer_params` from P's JSON answer; missing: 502 naming the P.
4. Decode hop: pick a D and POST it the original body plus those `kv_transfer_params` (and, streaming,
   `router_token_ids`: each chunk also carries its tokens, for step 6). Before any byte of the answer: a 4xx
   goes to the client as is; anything else is a failure of D (step 6).
5. Answer: streaming, relay D's events to the client as they come, whole events only, less the router's token
   ids (relay.py); else return D's JSON. D saw the whole prompt, so its usage is the client's. The first bytes
   from D end time to first token.
6. D fails (no answer, a 5xx, the connection dropped or timed out mid-stream, an error event other than the
   request's own deadline): the request is resumed on another D (or, colocated, another instance), at most
   --max-recoveries times, without kv_transfer_params (that D computes the prompt itself) and with
   `resume: {token_ids, num_tokens}`, the tokens the client has already received; the new D goes on from
   there and its events reach the client as the same stream (the first one's id, created and model). Nothing
   to resume on (or the limit reached, or a stream without token ids): before any byte a 502 naming the D
   (a 503 with its Retry-After), after it an SSE error event, then `data: [DONE]`.
7. Client disconnect: the handler is cancelled (handler_cancellation) or its write fails; closing the upstream
   response closes D's connection, or P's during step 2, and that backend aborts the request.
8. D never took the request (no connection, or it answered with an error status): POST P /v1/kv/release with
   the kv_transfer_params, in the background, so P frees the blocks now instead of when its lease runs out.
   Not on a timeout or a client disconnect: D may be reading P's blocks then, and it releases or finishes
   the read itself once its connection closes.
Colocated mode skips steps 2-3: step 4 sends the body to a round-robin colocated instance.
POST /tokenize and /detokenize go to a decode (or colocated) instance as they are.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence

import aiohttp
from aiohttp import web

from pdserve.config import API_KEY_ENV, ROUTER_KEY_ENV
from pdserve.http_guard import (INLINE_PARSE_BYTES, RETRY_AFTER_S, ROUTER_KEY_HEADER, bearer_token,
                                expect_handler, parse_json, quiet_malformed_requests, read_body, runner_args,
                                secret_matches)
from pdserve.metrics import CONTENT_TYPE
from pdserve.protocol import SSE_DONE, ChatCompletionRequest, CompletionRequest, ProtocolError, error_body, sse_event
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.policy import Policy, RoundRobin
from pdserve.router.relay import MalformedStream, StreamRelay

logger = logging.getLogger(__name__)

NETWORK_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
ROUTER_FIELDS = ("kv_transfer_params", "resume", "router_token_ids")   # dropped from client bodies
DEFAULT_MAX_RECOVERIES = 2


def json_error(message: str, status: int, error_type: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status=status, type=error_type), status=status)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def parse_body(data: bytes, schema=None) -> dict:
    """The client's JSON object, checked against `schema` (a protocol request class) when given."""
    try:
        body = parse_json(data)
        if not isinstance(body, dict):
            raise ProtocolError(400, "request body must be a JSON object")
        if schema is not None:
            schema.from_json(body)
    except ProtocolError as e:
        raise ClientError(e.status, e.message, e.param) from None
    return body


class ClientError(Exception):
    """The client's request is refused before any backend sees it."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return web.json_response(error_body(self.message, status=self.status, param=self.param),
                                 status=self.status, headers=headers)


def kv_transfer_params_of(data: bytes) -> dict | None:
    """The top-level kv_transfer_params of a P's JSON answer; None if missing."""
    try:
        answer = json.loads(data)
    except ValueError:
        return None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return params if isinstance(params, dict) else None


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
        super().__init__(f"{role} backend {url} failed: {detail}")
        self.role, self.url, self.public_detail = role, url, public_detail
        self.status, self.body, self.content_type, self.retry_after = status, body, content_type, retry_after
        # connection error, timeout, 5xx, 503 at capacity; never the client's 4xx
        self.is_retryable = body is None or retry_after is not None
        # Certain only where no connection was made or the backend answered with an error status.
        self.never_took_request = never_took_request

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


class Proxy:
    def __init__(self, prefill: Policy | None, decode: Policy | None, colocated: Policy | None,
                 api_key: str | None, timeout: float, connect_timeout: float,
                 router_key: str | None = None, max_in_flight: int = 4096, body_timeout: float = 30.0,
                 max_body_bytes: int = 32 << 20, max_recoveries: int = DEFAULT_MAX_RECOVERIES) -> None:
        self.prefill, self.decode, self.colocated = prefill, decode, colocated
        self.max_recoveries = max_recoveries
        self.api_key, self.router_key = api_key, router_key
        self.max_in_flight, self.body_timeout, self.max_body_bytes = max_in_flight, body_timeout, max_body_bytes
        self.num_in_flight = 0
        # total=None: a long stream is fine; a backend silent for `timeout` seconds is not.
        # sock_connect, not connect: the latter would also count waiting for a pool slot as the backend's.
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=timeout)
        self.session: aiohttp.ClientSession | None = None
        self.metrics = ProxyMetrics()
        self.releases: set[asyncio.Task] = set()  # in the background: the client's answer does not wait
        # What clients (and metric labels) call each backend: its pool and index, never its address.
        self.names = {url: f"{role}-{i}" for role, pool in (("prefill", prefill), ("decode", decode),
                                                            ("colocated", colocated)) if pool is not None
                      for i, url in enumerate(pool.urls)}

    async def session_ctx(self, app: web.Application):
        # Admission bounds the hops: a request holds one backend connection at a time, plus a release in
        # the background. A smaller pool would make requests past it wait for a slot and time out as if
        # the backend had (a 502 blaming a healthy instance) instead of the 503 admission gives.
        connector = aiohttp.TCPConnector(limit=2 * self.max_in_flight, limit_per_host=0)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        yield
        await self.session.close()

    def is_authorized(self, request: web.Request) -> bool:
        return self.api_key is None or secret_matches(bearer_token(request), self.api_key)

    def backend_headers(self, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        if self.router_key is not None:
            headers[ROUTER_KEY_HEADER] = self.router_key
        return headers

    async def read_body(self, request: web.Request, schema=None) -> dict:
        try:
            data = await read_body(request, self.body_timeout, self.max_body_bytes)
        except ProtocolError as e:
            raise ClientError(e.status, e.message) from None
        if len(data) <= INLINE_PARSE_BYTES:
            return parse_body(data, schema)
        return await asyncio.to_thread(parse_body, data, schema)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.metrics.num_requests.inc()
        if self.num_in_flight >= self.max_in_flight:
            self.metrics.num_rejected.inc()
            return web.json_response(error_body(f"the router is at capacity ({self.max_in_flight} requests in "
                                                 f"flight); retry later", status=503), status=503,
                                     headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_in_flight += 1
        self.metrics.num_in_flight.inc()
        request_id = request.headers.get("X-Request-Id") or f"pdserve-{uuid.uuid4().hex}"
        try:
            if not self.is_authorized(request):
                raise ClientError(401, "invalid or missing API key (Authorization: Bearer <key>)")
            is_chat = request.path.endswith("/chat/completions")
            body = await self.read_body(request, ChatCompletionRequest if is_chat else CompletionRequest)
            for field in ROUTER_FIELDS:   # the router's to set, never the client's
                body.pop(field, None)
            start, headers = time.monotonic(), self.backend_headers(request_id)
            if self.colocated is not None:  # colocated: no prefill hop
                return await self.final_hop(request, "colocated", self.colocated, body, headers, start)
            prefill_url, kv_transfer_params = await self.prefill_hop(request.path, body, headers, is_chat)
            return await self.final_hop(
                request, "decode", self.decode, body, headers, start, kv_transfer_params=kv_transfer_params,
                release=lambda: self.release_on_prefill(prefill_url, kv_transfer_params, headers))
        except ClientError as e:
            self.metrics.num_errors.inc()
            return e.response()
        except BackendError as e:
            level = logging.INFO if e.body is not None else logging.WARNING  # a 4xx is the client's doing
            logger.log(level, "request %s: %s", request_id, e)
            self.metrics.num_errors.inc()
            return e.response(self.names)
        except asyncio.CancelledError:
            self.metrics.num_client_disconnects.inc()
            raise
        finally:
            self.num_in_flight -= 1
            self.metrics.num_in_flight.dec()

    async def read(self, role: str, url: str, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except NETWORK_ERRORS as e:
            raise BackendError(role, url, describe(e), public_detail=public_detail(e)) from e
        finally:
            resp.close()

    async def post(self, role: str, url: str, path: str, body: dict, headers: dict) -> aiohttp.ClientResponse:
        """POST body to url+path; return the 2xx response still unread, or raise BackendError."""
        self.metrics.backend_request(role, self.names[url])
        try:
            resp = await self.session.post(url + path, json=body, headers=headers)
        except NETWORK_ERRORS as e:
            raise BackendError(role, url, describe(e), public_detail=public_detail(e),
                               never_took_request=isinstance(e, aiohttp.ClientConnectorError)) from e
        if resp.status < 400:
            return resp
        data = await self.read(role, url, resp)
        if resp.status in (401, 403):  # the backend refused the router itself: a deployment error
            raise BackendError(role, url, f"HTTP {resp.status}: {data[:300].decode(errors='replace')} (do the "
                                          f"router and the instances share one router key?)",
                               public_detail="refused the router", never_took_request=True)
        if resp.status < 500:  # the client's mistake: its own status and body
            raise BackendError(role, url, f"HTTP {resp.status}", resp.status, data,
                               resp.headers.get("Content-Type", "application/json"), never_took_request=True)
        if resp.status == 503:  # at capacity: the client should back off as the backend says (another P first)
            raise BackendError(role, url, "HTTP 503 (at capacity)", 503, data,
                               resp.headers.get("Content-Type", "application/json"), never_took_request=True,
                               retry_after=resp.headers.get("Retry-After", str(RETRY_AFTER_S)))
        message = error_message_of(data)  # a pdserve instance words its errors for clients already
        raise BackendError(role, url, f"HTTP {resp.status}: {data[:300].decode(errors='replace')}",
                           public_detail=f"failed: {message}" if message else f"failed (HTTP {resp.status})",
                           never_took_request=True)

    async def prefill_hop(self, path: str, body: dict, headers: dict, is_chat: bool) -> tuple[str, dict]:
        """(the P that answered, its kv_transfer_params)."""
        prefill_body = dict(body, kv_transfer_params={"do_remote_decode": True}, stream=False)
        prefill_body.pop("stream_options", None)
        start, failed_urls = time.monotonic(), []
        while (url := self.prefill.pick(exclude=failed_urls)) is not None:
            try:
                data = await self.read("prefill", url, await self.post("prefill", url, path, prefill_body, headers))
            except BackendError as e:
                if e.body is None:  # the backend's fault (not a 4xx, not a 503 at capacity)
                    self.metrics.backend_error("prefill", self.names[url])
                failed_urls.append(url)
                if not e.is_retryable or len(failed_urls) == 2 or len(self.prefill.urls) == 1:
                    raise
                logger.warning("request %s: %s; retrying on another P", headers["X-Request-Id"], e)
                self.metrics.num_prefill_retries.inc()
                error = e
                continue
            finally:
                self.prefill.release(url)
            if (params := kv_transfer_params_of(data)) is None:
                self.metrics.backend_error("prefill", self.names[url])
                raise BackendError("prefill", url, "no kv_transfer_params in its answer (is it a KV producer?)",
                                   public_detail="answered without kv_transfer_params (is it a KV producer?)")
            self.metrics.prefill_seconds.observe(time.monotonic() - start)
            return url, params
        raise error  # every P failed (with one P: no retry)

    def release_on_prefill(self, url: str, kv_transfer_params: dict, headers: dict) -> None:
        async def release() -> None:
            try:
                async with self.session.post(url + "/v1/kv/release", json={"kv_transfer_params": kv_transfer_params},
                                             headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    if resp.status >= 400:
                        logger.info("request %s: release on %s: HTTP %d", headers["X-Request-Id"], url, resp.status)
            except (*NETWORK_ERRORS, RuntimeError) as e:  # (a closed session); P frees at lease expiry
                logger.info("request %s: release on %s failed: %s", headers["X-Request-Id"], url, describe(e))
        self.metrics.num_kv_releases.inc()
        task = asyncio.get_running_loop().create_task(release())
        self.releases.add(task)
        task.add_done_callback(self.releases.discard)

    async def final_hop(self, request: web.Request, role: str, pool: Policy, body: dict, headers: dict,
                        start: float, *, kv_transfer_params: dict | None = None,
                        release: Callable[[], None] | None = None) -> web.StreamResponse:
        """The decode (or colocated) hop: the client's body, with P's kv_transfer_params in P/D mode. When the
        instance serving it fails (no answer, a 5xx, a dropped or broken stream), the request is resumed on
        another instance of the pool, at most max_recoveries times: resubmitted without kv_transfer_params
        (that instance computes the prompt itself) and, for a stream that has begun, with the tokens the
        client has received (`resume`), so the client's stream goes on where it stopped. `release`: P's
        blocks are not needed after all (the first hop never reached a D)."""
        is_stream = bool(body.get("stream"))
        relay = StreamRelay() if is_stream else None
        hop_body = dict(body, router_token_ids=True) if is_stream else dict(body)
        if kv_transfer_params is not None:
            hop_body["kv_transfer_params"] = kv_transfer_params
        out: web.StreamResponse | None = None   # the client's stream, once begun
        failed: list[str] = []
        url = pool.pick()
        while True:
            try:
                try:
                    resp = await self.post(role, url, request.path, hop_body, headers)
                except BackendError as e:
                    if e.never_took_request and release is not None and not failed:
                        release()
                    raise
                try:
                    if not is_stream:
                        data = await self.read(role, url, resp)
                        self.metrics.ttft.observe(time.monotonic() - start)
                        return web.Response(status=resp.status, body=data, headers={
                            "Content-Type": resp.headers.get("Content-Type", "application/json"),
                            "X-Request-Id": headers["X-Request-Id"]})
                    if out is None:
                        out = web.StreamResponse(status=resp.status, headers={
                            "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                            "Cache-Control": "no-cache", "X-Request-Id": headers["X-Request-Id"]})
                        await out.prepare(request)
                    relay.start_hop(is_resumed=bool(failed))
                    start = await self.stream(out, role, url, resp, relay, start)
                    await out.write_eof()
                    return out
                finally:
                    resp.close()  # unread: drops the connection, so the backend aborts the request
            except BackendError as e:
                error = e
            except ConnectionResetError:  # the client went away; D's connection is closed, so D aborts
                self.metrics.num_client_disconnects.inc()
                return out
            finally:
                pool.release(url)
            if error.body is None:
                self.metrics.backend_error(role, self.names[url])
            failed.append(url)
            reason, url = self.why_not_resume(error, relay, pool, failed)
            if reason is None:
                logger.warning("request %s: %s; resuming on %s after %d tokens", headers["X-Request-Id"], error,
                               self.names[url], relay.num_tokens if relay else 0)
                self.metrics.num_recoveries.inc()
                hop_body = dict(body, router_token_ids=True) if is_stream else dict(body)
                if relay is not None and relay.num_tokens:
                    hop_body["resume"] = {"token_ids": relay.resume_token_ids(), "num_tokens": relay.num_tokens}
                continue
            if reason != "not_recoverable":
                self.metrics.num_recovery_failures.labels(reason=reason).inc()
            if out is None:
                raise error
            await self.end_with_error(out, error, relay, headers)
            return out

    def why_not_resume(self, error: BackendError, relay: StreamRelay | None, pool: Policy,
                       failed: list[str]) -> tuple[str | None, str | None]:
        """(None, the instance to resume on), or (why not, None)."""
        if not error.is_retryable or (relay is not None and relay.error_event is not None
                                      and not relay.error_is_recoverable):
            return "not_recoverable", None   # the client's 4xx, or its own deadline: the same anywhere
        if relay is not None and relay.is_finished:
            return "after_finish", None
        if relay is not None and not relay.is_tracked:
            return "untracked", None
        if len(failed) > self.max_recoveries:
            return "limit", None
        url = pool.pick(exclude=failed)
        return ("no_backend", None) if url is None else (None, url)

    async def end_with_error(self, out: web.StreamResponse, error: BackendError, relay: StreamRelay,
                             headers: dict) -> None:
        """The stream began and cannot go on: the instance's own error event if it sent one, else an SSE
        error event naming it, then [DONE]."""
        logger.warning("request %s: %s", headers["X-Request-Id"], error)
        self.metrics.num_errors.inc()
        event = relay.error_event or sse_event(error_body(error.public_message(self.names), status=502,
                                                          type="backend_error"))
        with contextlib.suppress(ConnectionError):
            await out.write(event + SSE_DONE)
            await out.write_eof()

    async def stream(self, out: web.StreamResponse, role: str, url: str, resp: aiohttp.ClientResponse,
                     relay: StreamRelay, start: float | None) -> float | None:
        """Relay one hop's events to the client until its [DONE]; BackendError when the hop fails first
        (the connection dropped or timed out, the stream ended early or is malformed, or the instance sent
        an error event). Returns `start`, None once the first bytes went out (time to first token)."""
        while True:
            try:
                chunk = await resp.content.readany()
            except NETWORK_ERRORS as e:
                raise BackendError(role, url, f"{describe(e)} (mid-stream)",
                                   public_detail=f"{public_detail(e)} mid-stream") from e
            if not chunk:
                if relay.error_event is not None:
                    raise BackendError(role, url, f"error event mid-stream: {relay.error_event[:300]!r}",
                                       public_detail="failed mid-stream")
                if not relay.is_done:
                    raise BackendError(role, url, "the stream ended before [DONE]",
                                       public_detail="dropped the connection mid-stream")
                return start
            try:
                data = relay.feed(chunk)
            except MalformedStream as e:
                raise BackendError(role, url, str(e), public_detail="sent a malformed stream") from e
            if data:
                if start is not None:  # the first bytes
                    self.metrics.ttft.observe(time.monotonic() - start)
                    start = None
                await out.write(data)

    async def passthrough(self, request: web.Request) -> web.Response:
        """GET /v1/models, POST /tokenize, /detokenize: asked of one decode (or colocated) instance."""
        if not self.is_authorized(request):
            return json_error("invalid or missing API key (Authorization: Bearer <key>)", 401)
        pool = self.colocated or self.decode
        url = pool.pick()
        headers = self.backend_headers(request.headers.get("X-Request-Id") or f"pdserve-{uuid.uuid4().hex}")
        try:
            data = None if request.method == "GET" else await self.read_body(request)
            async with self.session.request(request.method, url + request.path, json=data, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=60)) as resp:
                if resp.status in (401, 403):
                    raise BackendError("decode", url, f"HTTP {resp.status}", public_detail="refused the router")
                return web.Response(status=resp.status, body=await resp.read(),
                                    headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
        except ClientError as e:
            return json_error(e.message, e.status)
        except NETWORK_ERRORS as e:
            logger.warning("%s %s on %s failed: %s", request.method, request.path, url, describe(e))
            return json_error(f"the {self.names[url]} instance {public_detail(e)}", 502, "backend_error")
        except BackendError as e:
            logger.warning("%s %s: %s", request.method, request.path, e)
            return e.response(self.names)
        finally:
            pool.release(url)

    async def health(self, request: web.Request) -> web.Response:
        """200 while the proxy is up; each backend's own /health, probed with a short timeout, as detail.
        Backends are named by pool and index, as everywhere a client can see."""
        pools = {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}
        backends = {role: [{"name": self.names[url]} for url in pool.urls]
                    for role, pool in pools.items() if pool is not None}
        urls = [url for pool in pools.values() if pool is not None for url in pool.urls]
        entries = [entry for role_entries in backends.values() for entry in role_entries]
        for entry, (is_healthy, detail) in zip(entries, await asyncio.gather(*(self.probe(url) for url in urls))):
            entry.update(healthy=is_healthy, detail=detail)
        return web.json_response({"status": "ok", "mode": "colocated" if self.colocated else "pd",
                                  "backends": backends})

    async def probe(self, url: str) -> tuple[bool, str]:
        try:
            async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                return resp.status == 200, f"HTTP {resp.status}"
        except NETWORK_ERRORS as e:
            return False, public_detail(e)

    async def render_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


PROXY_KEY = web.AppKey("proxy", Proxy)


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


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def build_proxy_app(prefill_urls: Sequence[str], decode_urls: Sequence[str],
                    colocated_urls: Sequence[str] | None = None, api_key: str | None = None,
                    timeout: float = 600.0, connect_timeout: float = 10.0,
                    *, router_key: str | None = None, max_in_flight: int = 4096,
                    max_body_bytes: int = 32 << 20, body_timeout: float = 30.0,
                    max_recoveries: int = DEFAULT_MAX_RECOVERIES) -> web.Application:
    """P/D mode needs prefill_urls and decode_urls; colocated mode needs only colocated_urls.

    timeout: seconds a backend may stay silent (between bytes) before the hop fails.
    """
    pools = [[normalize_url(u) for u in urls or ()] for urls in (prefill_urls, decode_urls, colocated_urls)]
    if pools[2] and (pools[0] or pools[1]):
        raise ValueError("colocated_urls: use either colocated backends or prefill+decode backends, not both")
    if not pools[2] and not (pools[0] and pools[1]):
        raise ValueError("prefill_urls/decode_urls: P/D mode needs at least one of each (or use colocated_urls)")
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight: must be >= 1, got {max_in_flight}")
    if max_recoveries < 0:
        raise ValueError(f"max_recoveries: must be >= 0, got {max_recoveries}")
    prefill, decode, colocated = (RoundRobin(urls) if urls else None for urls in pools)
    proxy = Proxy(prefill, decode, colocated, api_key, timeout, connect_timeout,
                  router_key=router_key, max_in_flight=max_in_flight, body_timeout=body_timeout,
                  max_body_bytes=max_body_bytes, max_recoveries=max_recoveries)
    quiet_malformed_requests()
    app = web.Application(client_max_size=max_body_bytes, middlewares=[json_errors])
    app[PROXY_KEY] = proxy
    app.cleanup_ctx.append(proxy.session_ctx)
    for path, handler in (("/v1/completions", proxy.completions), ("/v1/chat/completions", proxy.completions),
                          ("/tokenize", proxy.passthrough), ("/detokenize", proxy.passthrough)):
        app.router.add_post(path, handler, expect_handler=expect_handler)
    for path, handler in (("/v1/models", proxy.passthrough), ("/health", proxy.health),
                          ("/metrics", proxy.render_metrics)):
        app.router.add_get(path, handler, expect_handler=expect_handler)
    return app


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill instances (P/D mode)")
    parser.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode instances (P/D mode)")
    parser.add_argument("--colocated", nargs="+", default=[], metavar="URL",
                        help="colocated instances: round-robin, no P/D")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"clients must send 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; prefer the "
                             f"variable, a flag is visible to every local user in ps)")
    parser.add_argument("--router-key", default=os.environ.get(ROUTER_KEY_ENV),
                        help=f"the secret the instances expect from the router (default: ${ROUTER_KEY_ENV}); "
                             f"the client's own Authorization is never forwarded")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a backend may stay silent")
    parser.add_argument("--max-in-flight", type=int, default=4096,
                        help="requests served at once; more get a 503 with Retry-After")
    parser.add_argument("--max-body-bytes", type=int, default=32 << 20, help="largest request body")
    parser.add_argument("--max-recoveries", type=int, default=DEFAULT_MAX_RECOVERIES,
                        help="times one request may be resumed on another decode (or colocated) instance after "
                             "the one serving it failed; 0: never")


def main_proxy(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_proxy_app(args.prefill, args.decode, args.colocated, api_key=args.api_key,
                              timeout=args.timeout, router_key=args.router_key, max_in_flight=args.max_in_flight,
                              max_body_bytes=args.max_body_bytes, max_recoveries=args.max_recoveries)
    except ValueError as e:
        print(f"pdserve proxy: {e}", file=sys.stderr)
        return 2
    # handler_cancellation: a client disconnect cancels the handler, which closes the hop in progress.
    web.run_app(app, host=args.host, port=args.port, access_log=None, **runner_args())
    return 0
