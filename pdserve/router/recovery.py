"""The decode (or colocated) hop and its recovery: steps 4-6 of the request lifecycle in proxy.py.

The hop's answer goes to the client as D's JSON or, streaming, as D's events relayed whole (relay.py).
When the instance serving the request fails, the request is resumed on another instance of the pool
with the tokens the client has already received, and the client reads one ordinary stream. An instance
that answers 503 at capacity has not failed: the request waits for room (as a new one waits in
proxy.wait_for_route, at most --queue-timeout) and goes to whichever instance has it then.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from pdserve.protocol import SSE_DONE, error_body, sse_event
from pdserve.router.errors import NETWORK_ERRORS, BackendError, describe, public_detail
from pdserve.router.hops import post, read, while_heard
from pdserve.router.instances import Instance, Ticket
from pdserve.router.policy import RouteRequest
from pdserve.router.relay import MalformedStream, StreamRelay

if TYPE_CHECKING:
    from pdserve.router.proxy import Proxy

logger = logging.getLogger(__name__)


async def final_hop(proxy: Proxy, request: web.Request, req: RouteRequest, inst: Instance, body: dict,
                    headers: dict, start: float, *, kv_transfer_params: dict | None = None,
                    release: Callable[[], None] | None = None) -> web.StreamResponse:
    """The decode (or colocated, or direct) hop on `inst`: the client's body, with P's kv_transfer_params
    when disaggregated. When the instance serving it fails (no answer, a 5xx, a dropped or broken stream),
    the request is resumed on another decode or colocated instance the router picks, at most
    max_recoveries times: resubmitted without kv_transfer_params (that instance computes the prompt itself)
    and, for a stream that has begun, with the tokens the client has received (`resume`), so the client's
    stream goes on where it stopped. `release`: P's blocks are not needed after all (the first hop never
    reached a D)."""
    is_stream = bool(body.get("stream"))
    relay = StreamRelay() if is_stream else None
    hop_body = dict(body, router_token_ids=True) if is_stream else dict(body)
    if kv_transfer_params is not None:
        hop_body["kv_transfer_params"] = kv_transfer_params
    out: web.StreamResponse | None = None   # the client's stream, once begun
    failed: list[str] = []
    room_deadline: float | None = None   # waiting for room after a 503 at capacity, until then
    computes_prompt = kv_transfer_params is None
    while True:
        role = inst.role
        ticket = proxy.begin(inst, req, computes_prompt=computes_prompt)
        try:
            try:
                # until its first byte the instance computes the prompt (a stream's headers come with the
                # first token): bounded by its load reports; after it, by --timeout between two bytes
                resp = await while_heard(proxy, role, inst, post(proxy, role, inst, request.path, hop_body,
                                                                 headers, unlimited_read=True))
            except BackendError as e:
                if e.never_took_request and release is not None:
                    release()
                raise
            finally:
                release = None   # P's blocks concern the first hop only
            try:
                if not is_stream:
                    data = await while_heard(proxy, role, inst, read(role, inst.url, resp))
                    proxy.metrics.ttft.observe(time.monotonic() - start)
                    return web.Response(status=resp.status, body=data, headers={
                        "Content-Type": resp.headers.get("Content-Type", "application/json"),
                        "X-Request-Id": headers["X-Request-Id"]})
                if out is None:
                    out = web.StreamResponse(status=resp.status, headers={
                        "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                        "Cache-Control": "no-cache", "X-Request-Id": headers["X-Request-Id"]})
                    await out.prepare(request)
                relay.start_hop(is_resumed=bool(failed))
                start = await stream(proxy, out, role, inst, resp, relay, start, ticket)
                await out.write_eof()
                return out
            finally:
                resp.close()  # unread: drops the connection, so the backend aborts the request
        except BackendError as e:
            error = e
        except ConnectionResetError:  # the client went away; D's connection is closed, so D aborts
            proxy.metrics.num_client_disconnects.inc()
            return out
        finally:
            proxy.end(inst, ticket)
        if error.body is None:
            proxy.metrics.backend_error(role, inst.name)
        if error.is_at_capacity:   # full, not broken: it may serve the request once it has room again
            room_deadline = room_deadline or time.monotonic() + proxy.queue_timeout
            reason, inst = await wait_for_room(proxy, error, relay, req, failed, room_deadline)
        else:
            failed.append(inst.name)
            reason, inst = why_not_resume(proxy, error, relay, req, failed)
        if reason is None:
            if error.is_at_capacity:   # (not a failure: the instance had no room, and one has now)
                logger.info("request %s: %s; serving it on %s", headers["X-Request-Id"], error, inst.name)
            else:
                logger.warning("request %s: %s; resuming on %s after %d tokens", headers["X-Request-Id"], error,
                               inst.name, relay.num_tokens if relay else 0)
                proxy.metrics.num_recoveries.inc()
            computes_prompt = True
            hop_body = dict(body, router_token_ids=True) if is_stream else dict(body)
            if relay is not None and relay.num_tokens:
                hop_body["resume"] = {"token_ids": relay.resume_token_ids(), "num_tokens": relay.num_tokens}
            continue
        if reason != "not_recoverable":
            proxy.metrics.num_recovery_failures.labels(reason=reason).inc()
        if out is None:
            raise error
        await end_with_error(proxy, out, error, relay, headers)
        return out


def why_not(proxy: Proxy, error: BackendError, relay: StreamRelay | None, failed: list[str]) -> str | None:
    if not error.is_retryable or (relay is not None and relay.error_event is not None
                                  and not relay.error_is_recoverable):
        return "not_recoverable"   # the client's 4xx, or its own deadline: the same anywhere
    if relay is not None and relay.is_finished:
        return "after_finish"
    if relay is not None and not relay.is_tracked:
        return "untracked"
    if len(failed) > proxy.max_recoveries:
        return "limit"
    return None


def why_not_resume(proxy: Proxy, error: BackendError, relay: StreamRelay | None, req: RouteRequest,
                   failed: list[str]) -> tuple[str | None, Instance | None]:
    """(None, the instance to resume on), or (why not, None)."""
    if (reason := why_not(proxy, error, relay, failed)) is not None:
        return reason, None
    inst = proxy.router.replacement(req, exclude=failed, now=time.monotonic())
    return ("no_backend", None) if inst is None else (None, inst)


async def wait_for_room(proxy: Proxy, error: BackendError, relay: StreamRelay | None, req: RouteRequest,
                        failed: list[str], deadline: float) -> tuple[str | None, Instance | None]:
    """After a 503 at capacity: (None, an instance under the router's caps) once one is, looking again at
    each capacity pulse (a hop's end, a poll round), never at once (the instance that just said it is full
    would be asked again before anything changed); ("no_room", None) at the deadline."""
    if (reason := why_not(proxy, error, relay, failed)) is not None:
        return reason, None
    while (left := deadline - time.monotonic()) > 0:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proxy.capacity.wait(), left)
        if not any(i.is_available and i.role != "prefill" and i.name not in failed for i in proxy.router.instances):
            return "no_backend", None
        inst = proxy.router.replacement(req, exclude=failed, now=time.monotonic(), within_caps=True)
        if inst is not None:
            return None, inst
    return "no_room", None


async def end_with_error(proxy: Proxy, out: web.StreamResponse, error: BackendError, relay: StreamRelay,
                         headers: dict) -> None:
    """The stream began and cannot go on: the instance's own error event if it sent one, else an SSE
    error event naming it, then [DONE]."""
    logger.warning("request %s: %s", headers["X-Request-Id"], error)
    proxy.metrics.num_errors.inc()
    event = relay.error_event or sse_event(error_body(error.public_message(proxy.names), status=502,
                                                      type="backend_error"))
    with contextlib.suppress(ConnectionError):
        await out.write(event + SSE_DONE)
        await out.write_eof()


async def stream(proxy: Proxy, out: web.StreamResponse, role: str, inst: Instance, resp: aiohttp.ClientResponse,
                 relay: StreamRelay, start: float | None, ticket: Ticket) -> float | None:
    """Relay one hop's events to the client until its [DONE]; BackendError when the hop fails first
    (the connection dropped or timed out, the stream ended early or is malformed, or the instance sent
    an error event). Returns `start`, None once the first bytes went out (time to first token: the
    instance's prompt work is done, which the router's load accounting learns then)."""
    url = inst.url
    while True:
        try:
            async with asyncio.timeout(proxy.silence_s):   # (the hop's own timeout has no read limit)
                chunk = await resp.content.readany()
        except NETWORK_ERRORS as e:   # (asyncio's TimeoutError among them)
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
                proxy.metrics.ttft.observe(time.monotonic() - start)
                inst.prompt_done(ticket)
                start = None
            await out.write(data)
