"""The router's calls to its instances: one POST and its failures as BackendError, the prefill hop (steps 3-4
of the request lifecycle in proxy.py) and the release of P's blocks no D took (step 8)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp

from pdserve.http_guard import INLINE_PARSE_BYTES, RETRY_AFTER_S
from pdserve.router.errors import NETWORK_ERRORS, BackendError, describe, error_message_of, public_detail

if TYPE_CHECKING:
    from pdserve.router.instances import Instance, Ticket
    from pdserve.router.proxy import Proxy

logger = logging.getLogger(__name__)

T = TypeVar("T")


JSON = "application/json"
# The size of the client's body, set by the proxy for the request's task: a large one is encoded off the
# event loop (28 MB of emoji took 0.09 s to encode, 0.32 s with json's default ASCII escapes, 3x larger).
BODY_BYTES: ContextVar[int] = ContextVar("BODY_BYTES", default=0)


def _encode(body: Any) -> bytes:
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:   # a lone surrogate ("\\ud800" in the client's JSON): escaped, as it came
        return json.dumps(body, separators=(",", ":")).encode()


async def encode_json(body: Any) -> bytes:
    """UTF-8 JSON, characters as they are (no \\u escapes); off the event loop for a large body."""
    return _encode(body) if BODY_BYTES.get() <= INLINE_PARSE_BYTES else await asyncio.to_thread(_encode, body)


def kv_transfer_params_of(data: bytes) -> dict | None:
    """The top-level kv_transfer_params of a P's JSON answer; None if missing."""
    try:
        answer = json.loads(data)
    except ValueError:
        return None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return params if isinstance(params, dict) else None


async def read(role: str, url: str, resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.read()
    except NETWORK_ERRORS as e:
        raise BackendError(role, url, describe(e), public_detail=public_detail(e)) from e
    finally:
        resp.close()


async def post(proxy: Proxy, role: str, inst: Instance, path: str, body: dict,
               headers: dict, unlimited_read: bool = False) -> aiohttp.ClientResponse:
    """POST body to the instance's path; return the 2xx response still unread, or raise BackendError. An
    instance that refuses the connection, or does not accept it within the connect timeout, never took the
    request, and counts as a failed health check (the monitor may eject it). unlimited_read: no limit on
    reading (the session's is --timeout between two bytes): the caller bounds the wait for the first byte
    with while_heard, and a stream's reads itself."""
    url = inst.url
    proxy.metrics.backend_request(role, inst.name)
    data = await encode_json(body)
    try:
        # (no timeout argument at all for a stream: aiohttp takes timeout=None for "no limit")
        timeout = {"timeout": proxy.hop_timeout} if unlimited_read else {}
        resp = await proxy.session.post(url + path, data=data, headers={**headers, "Content-Type": JSON}, **timeout)
    except NETWORK_ERRORS as e:
        never_took = isinstance(e, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))
        if never_took:
            proxy.monitor.connect_failed(inst, e)
        raise BackendError(role, url, describe(e), public_detail=public_detail(e),
                           never_took_request=never_took) from e
    if resp.status < 400:
        return resp
    data = await read(role, url, resp)
    if resp.status in (401, 403):  # the backend refused the router itself: a deployment error
        raise BackendError(role, url, f"HTTP {resp.status}: {data[:300].decode(errors='replace')} (do the "
                                      f"router and the instances share one router key?)",
                           public_detail="refused the router", never_took_request=True)
    if resp.status < 500:  # the client's mistake: its own status and body
        raise BackendError(role, url, f"HTTP {resp.status}: {error_message_of(data) or ''}", resp.status, data,
                           resp.headers.get("Content-Type", "application/json"), never_took_request=True)
    if resp.status == 503:  # at capacity: the client should back off as the backend says (another P first)
        retry_after = resp.headers.get("Retry-After", str(RETRY_AFTER_S))
        inst.mark_full(time.monotonic(), retry_after)
        raise BackendError(role, url, "HTTP 503 (at capacity)", 503, data,
                           resp.headers.get("Content-Type", "application/json"), never_took_request=True,
                           retry_after=retry_after)
    message = error_message_of(data)  # a pdserve instance words its errors for clients already
    raise BackendError(role, url, f"HTTP {resp.status}: {data[:300].decode(errors='replace')}",
                       public_detail=f"failed: {message}" if message else f"failed (HTTP {resp.status})",
                       never_took_request=True)


async def while_heard(proxy: Proxy, role: str, inst: Instance, hop: Awaitable[T]) -> T:
    """Await `hop`, a step of a hop before the instance's first byte: a whole answer (not streamed; the prefill
    hop) or a stream's headers, which a pdserve instance sends with its first token. The instance is silent
    until its prompt is computed, so the --timeout of silence applies to its healthy load reports instead
    (Instance.why_silent), and never to less than a poll round can take. BackendError (timed out) when it
    stops sending them for that long, restarts, or sends none of its answer within proxy.first_byte_cap_s
    however healthy it says it is; the hop is cancelled then (its connection closed, so the instance aborts
    the request). The hop runs in the caller's task (a watchdog on the loop cancels it), so
    it resumes as soon as it is done, and a cancellation of the caller is its own."""
    began, restarts = time.monotonic(), inst.num_restarts
    silence_s = max(proxy.silence_s, proxy.monitor.round_seconds() + proxy.monitor.timeout)
    period = min(1.0, silence_s / 4)
    loop = asyncio.get_running_loop()
    why: str | None = None
    try:
        async with asyncio.timeout(None) as deadline:
            def look() -> None:
                nonlocal why, watchdog
                now = time.monotonic()
                why = inst.why_silent(began, restarts, silence_s, now)
                if why is None and now - began > proxy.first_byte_cap_s:   # healthy, yet never answering
                    why = f"no first byte within {proxy.first_byte_cap_s:g} s"
                if why is None:
                    watchdog = loop.call_later(period, look)
                else:
                    deadline.reschedule(loop.time())   # now: the hop is cancelled, the block raises TimeoutError
            watchdog = loop.call_later(period, look)
            try:
                return await hop
            finally:
                watchdog.cancel()
    except TimeoutError:
        if why is None:   # (not the watchdog's: the hop's own, which post and read turn into BackendError)
            raise
        raise BackendError(role, inst.url, f"timed out: {why}", public_detail="timed out") from None


async def prefill_hop(proxy: Proxy, inst: Instance, ticket: Ticket, path: str, body: dict,
                      headers: dict, kv_transfer_params: dict | None = None) -> dict:
    """P's kv_transfer_params for this request; BackendError when P fails or answers without them. One
    attempt: the caller routes the request again (to another P, or straight to a D) on a retryable failure.
    Ends `ticket` (the router's count of P's work) whatever happens. kv_transfer_params: what P is sent
    (default: pull's {"do_remote_decode": true})."""
    prefill_body = dict(body, kv_transfer_params=kv_transfer_params or {"do_remote_decode": True}, stream=False)
    prefill_body.pop("stream_options", None)
    start = time.monotonic()
    try:
        resp = await while_heard(proxy, "prefill", inst, post(proxy, "prefill", inst, path, prefill_body,
                                                              headers, unlimited_read=True))
        data = await while_heard(proxy, "prefill", inst, read("prefill", inst.url, resp))
    except BackendError as e:
        if e.body is None:  # the backend's fault (not a 4xx, not a 503 at capacity)
            proxy.metrics.backend_error("prefill", inst.name)
        raise
    finally:
        proxy.end(inst, ticket)
    if (params := kv_transfer_params_of(data)) is None:
        proxy.metrics.backend_error("prefill", inst.name)
        raise BackendError("prefill", inst.url, "no kv_transfer_params in its answer (is it a KV producer?)",
                           public_detail="answered without kv_transfer_params (is it a KV producer?)")
    proxy.metrics.prefill_seconds.observe(time.monotonic() - start)
    return params


def push_params(prefill: Instance, decode: Instance) -> tuple[dict, dict, dict, dict] | None:
    """The push handoff (kv_transfer/push.py), one transfer id for both hops: (P's kv_transfer_params, D's,
    what releases the transfer on P, on D), or None while P's side channel is not known (not polled yet, or
    it restarted): the caller takes that P for a failed one."""
    side, d_side = prefill.kv_connector, decode.kv_connector
    if side is None or "port" not in side:
        return None
    transfer_id = uuid.uuid4().hex
    d_params = {"do_remote_prefill": True, "transfer_id": transfer_id, "remote_engine_id": side["engine_id"],
                "remote_request_id": transfer_id, "remote_host": side["host"], "remote_port": side["port"]}
    if side.get("boot_id") is not None:
        d_params["remote_boot_id"] = side["boot_id"]
    p_release = {"remote_engine_id": side["engine_id"], "remote_request_id": transfer_id}
    d_release = {"remote_engine_id": d_side["engine_id"], "remote_request_id": transfer_id} if d_side else {}
    return {"do_remote_decode": True, "transfer_id": transfer_id}, d_params, p_release, d_release


def release_transfer(proxy: Proxy, url: str, kv_transfer_params: dict, headers: dict) -> None:
    """Free what an instance holds for a transfer no one will complete (P's blocks no D took; with push, also
    D's blocks for a P whose hop failed), in the background."""
    async def release() -> None:
        try:
            async with proxy.session.post(url + "/v1/kv/release", json={"kv_transfer_params": kv_transfer_params},
                                          headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status >= 400:
                    logger.info("request %s: release on %s: HTTP %d", headers["X-Request-Id"], url, resp.status)
        except (*NETWORK_ERRORS, RuntimeError) as e:  # (a closed session); P frees at lease expiry
            logger.info("request %s: release on %s failed: %s", headers["X-Request-Id"], url, describe(e))
    proxy.metrics.num_kv_releases.inc()
    task = asyncio.get_running_loop().create_task(release())
    proxy.releases.add(task)
    task.add_done_callback(proxy.releases.discard)
