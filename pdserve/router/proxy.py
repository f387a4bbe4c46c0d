"""The proxy: an OpenAI-compatible front that pairs a prefill (P) instance with a decode (D) instance.

Lifecycle of one `POST /v1/completions` or `POST /v1/chat/completions` in P/D mode:
1. Check the api key (if set); read the client's JSON object, else 400. Take the client's X-Request-Id or make
   one: both hops carry it, and the client's Authorization header, as is.
2. Prefill hop: pick a P (round-robin) and POST it the body with `kv_transfer_params: {do_remote_decode: true}`,
   `max_tokens: 1` (and `max_completion_tokens: 1` for chat), `stream: false`, no `stream_options`.
   A 4xx from P (validation) goes to the client as is. A connection error, timeout or 5xx is retried once on
   another P when there is one, then becomes a 502 naming the P.
3. Take `kv_transfer_params` from P's JSON answer; missing: 502 naming the P.
4. Decode hop: pick a D and POST it the original body plus those `kv_transfer_params`. Before any byte of the
   answer: a 4xx goes to the client as is, anything else becomes a 502 naming the D.
5. Answer: streaming, copy D's bytes to the client as they come (SSE passthrough); else return D's JSON. D saw
   the whole prompt, so its usage is the client's. The first bytes from D end time to first token.
6. D fails after streaming began: an SSE error event, then `data: [DONE]`.
7. Client disconnect: the handler is cancelled (handler_cancellation) or its write fails; closing the upstream
   response closes D's connection, or P's during step 2, and that backend aborts the request.
8. D never took the request (no connection, or it answered with an error status): POST P /v1/kv/release with
   the kv_transfer_params, in the background, so P frees the blocks now instead of when its lease runs out.
   Not on a timeout or a client disconnect: D may be reading P's blocks then, and it releases or finishes
   the read itself once its connection closes.
Colocated mode skips steps 2-3: step 4 sends the body as is to a round-robin colocated instance.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import sys
import time
import uuid
from collections.abc import Sequence

import aiohttp
from aiohttp import web

from pdserve.metrics import CONTENT_TYPE
from pdserve.protocol import SSE_DONE, error_body, sse_event
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.policy import Policy, RoundRobin

logger = logging.getLogger(__name__)

NETWORK_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def json_error(message: str, status: int, error_type: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status=status, type=error_type), status=status)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def forwarded_headers(request: web.Request) -> dict[str, str]:
    return {"Authorization": request.headers["Authorization"]} if "Authorization" in request.headers else {}


def kv_transfer_params_of(data: bytes) -> dict | None:
    """The top-level kv_transfer_params of a P's JSON answer; None if missing."""
    try:
        answer = json.loads(data)
    except ValueError:
        return None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return params if isinstance(params, dict) else None


class BackendError(Exception):
    """A hop failed. `body` set: the backend's own 4xx, passed through; else a 502 naming the backend."""

    def __init__(self, role: str, url: str, detail: str, status: int = 502, body: bytes | None = None,
                 content_type: str = "application/json", never_took_request: bool = False) -> None:
        super().__init__(f"{role} backend {url} failed: {detail}")
        self.status, self.body, self.content_type = status, body, content_type
        self.is_retryable = body is None  # connection error, timeout, 5xx; never the client's 4xx
        # Certain only where no connection was made or the backend answered with an error status.
        self.never_took_request = never_took_request

    def response(self) -> web.Response:
        if self.body is not None:
            return web.Response(status=self.status, body=self.body, headers={"Content-Type": self.content_type})
        return json_error(str(self), self.status, "backend_error")


class Proxy:
    def __init__(self, prefill: Policy | None, decode: Policy | None, colocated: Policy | None,
                 api_key: str | None, timeout: float, connect_timeout: float, max_connections: int) -> None:
        self.prefill, self.decode, self.colocated = prefill, decode, colocated
        self.api_key, self.max_connections = api_key, max_connections
        # total=None: a long stream is fine; a backend silent for `timeout` seconds is not.
        self.timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=timeout)
        self.session: aiohttp.ClientSession | None = None
        self.metrics = ProxyMetrics()
        self.releases: set[asyncio.Task] = set()  # in the background: the client's answer does not wait

    async def session_ctx(self, app: web.Application):
        connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        yield
        await self.session.close()

    def is_authorized(self, request: web.Request) -> bool:
        return self.api_key is None or hmac.compare_digest(
            request.headers.get("Authorization", "").encode(), f"Bearer {self.api_key}".encode())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.metrics.num_requests.inc()
        if not self.is_authorized(request):
            self.metrics.num_errors.inc()
            return json_error("invalid api key", 401)
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self.metrics.num_errors.inc()
            return json_error("request body must be a JSON object", 400)
        start, headers = time.monotonic(), forwarded_headers(request)
        headers["X-Request-Id"] = request.headers.get("X-Request-Id") or f"pdserve-{uuid.uuid4().hex}"
        self.metrics.num_in_flight.inc()
        try:
            if self.colocated is not None:  # colocated: no prefill hop
                return await self.final_hop(request, "colocated", self.colocated, body, headers, start)
            is_chat = request.path.endswith("/chat/completions")
            prefill_url, kv_transfer_params = await self.prefill_hop(request.path, body, headers, is_chat)
            try:
                return await self.final_hop(request, "decode", self.decode,
                                            dict(body, kv_transfer_params=kv_transfer_params), headers, start)
            except BackendError as e:
                if e.never_took_request:
                    self.release_on_prefill(prefill_url, kv_transfer_params, headers)
                raise
        except BackendError as e:
            level = logging.INFO if e.body is not None else logging.WARNING  # a 4xx is the client's doing
            logger.log(level, "request %s: %s", headers["X-Request-Id"], e)
            self.metrics.num_errors.inc()
            return e.response()
        except asyncio.CancelledError:
            self.metrics.num_client_disconnects.inc()
            raise
        finally:
            self.metrics.num_in_flight.dec()

    async def read(self, role: str, url: str, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except NETWORK_ERRORS as e:
            raise BackendError(role, url, describe(e)) from e
        finally:
            resp.close()

    async def post(self, role: str, url: str, path: str, body: dict, headers: dict) -> aiohttp.ClientResponse:
        """POST body to url+path; return the 2xx response still unread, or raise BackendError."""
        try:
            resp = await self.session.post(url + path, json=body, headers=headers)
        except NETWORK_ERRORS as e:
            raise BackendError(role, url, describe(e),
                               never_took_request=isinstance(e, aiohttp.ClientConnectorError)) from e
        if resp.status < 400:
            return resp
        data = await self.read(role, url, resp)
        if resp.status < 500:  # the client's mistake: its own status and body
            raise BackendError(role, url, f"HTTP {resp.status}", resp.status, data,
                               resp.headers.get("Content-Type", "application/json"), never_took_request=True)
        raise BackendError(role, url, f"HTTP {resp.status}: {data[:300].decode(errors='replace')}",
                           never_took_request=True)

    async def prefill_hop(self, path: str, body: dict, headers: dict, is_chat: bool) -> tuple[str, dict]:
        """(the P that answered, its kv_transfer_params)."""
        prefill_body = dict(body, kv_transfer_params={"do_remote_decode": True}, max_tokens=1, stream=False)
        if is_chat:
            prefill_body["max_completion_tokens"] = 1
        prefill_body.pop("stream_options", None)
        start, failed_urls = time.monotonic(), []
        while (url := self.prefill.pick(exclude=failed_urls)) is not None:
            try:
                data = await self.read("prefill", url, await self.post("prefill", url, path, prefill_body, headers))
            except BackendError as e:
                failed_urls.append(url)
                if not e.is_retryable or len(failed_urls) == 2:
                    raise
                logger.warning("request %s: %s; retrying on another P", headers["X-Request-Id"], e)
                self.metrics.num_prefill_retries.inc()
                error = e
                continue
            finally:
                self.prefill.release(url)
            if (params := kv_transfer_params_of(data)) is None:
                raise BackendError("prefill", url, "no kv_transfer_params in its answer (is it a KV producer?)")
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
                        start: float) -> web.StreamResponse:
        url = pool.pick()
        try:
            resp = await self.post(role, url, request.path, body, headers)
            try:
                if body.get("stream"):
                    return await self.stream(request, role, url, resp, headers, start)
                data = await self.read(role, url, resp)
                self.metrics.ttft.observe(time.monotonic() - start)
                return web.Response(status=resp.status, body=data, headers={
                    "Content-Type": resp.headers.get("Content-Type", "application/json"),
                    "X-Request-Id": headers["X-Request-Id"]})
            finally:
                resp.close()  # unread: drops the connection, so the backend aborts the request
        finally:
            pool.release(url)

    async def stream(self, request: web.Request, role: str, url: str, resp: aiohttp.ClientResponse,
                     headers: dict, start: float | None) -> web.StreamResponse:
        out = web.StreamResponse(status=resp.status, headers={
            "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache", "X-Request-Id": headers["X-Request-Id"]})
        try:
            await out.prepare(request)
            while True:
                try:
                    chunk = await resp.content.readany()
                except NETWORK_ERRORS as e:  # the status line went out already: an SSE error event
                    error = BackendError(role, url, f"{describe(e)} (mid-stream)")
                    logger.warning("request %s: %s", headers["X-Request-Id"], error)
                    self.metrics.num_errors.inc()
                    await out.write(sse_event(error_body(str(error), status=502, type="backend_error")) + SSE_DONE)
                    break
                if not chunk:
                    break
                if start is not None:  # the first bytes
                    self.metrics.ttft.observe(time.monotonic() - start)
                    start = None
                await out.write(chunk)
            await out.write_eof()
        except ConnectionResetError:  # the client went away; the caller closes resp, so D aborts
            self.metrics.num_client_disconnects.inc()
        return out

    async def models(self, request: web.Request) -> web.Response:
        if not self.is_authorized(request):
            return json_error("invalid api key", 401)
        url = (self.colocated or self.decode).urls[0]
        try:
            async with self.session.get(url + "/v1/models", headers=forwarded_headers(request)) as resp:
                return web.Response(status=resp.status, body=await resp.read(),
                                    headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
        except NETWORK_ERRORS as e:
            return json_error(f"models backend {url} failed: {describe(e)}", 502, "backend_error")

    async def health(self, request: web.Request) -> web.Response:
        """200 while the proxy is up; each backend's own /health, probed with a short timeout, as detail."""
        pools = {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}
        backends = {role: [{"url": url} for url in pool.urls] for role, pool in pools.items() if pool is not None}
        entries = [entry for role_entries in backends.values() for entry in role_entries]
        for entry, (is_healthy, detail) in zip(entries, await asyncio.gather(*(self.probe(e["url"]) for e in entries))):
            entry.update(healthy=is_healthy, detail=detail)
        return web.json_response({"status": "ok", "mode": "colocated" if self.colocated else "pd",
                                  "backends": backends})

    async def probe(self, url: str) -> tuple[bool, str]:
        try:
            async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                return resp.status == 200, f"HTTP {resp.status}"
        except NETWORK_ERRORS as e:
            return False, describe(e)

    async def render_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


PROXY_KEY = web.AppKey("proxy", Proxy)


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def build_proxy_app(prefill_urls: Sequence[str], decode_urls: Sequence[str],
                    colocated_urls: Sequence[str] | None = None, api_key: str | None = None,
                    timeout: float = 600.0, connect_timeout: float = 10.0,
                    max_connections: int = 1024) -> web.Application:
    """P/D mode needs prefill_urls and decode_urls; colocated mode needs only colocated_urls.

    timeout: seconds a backend may stay silent (between bytes) before the hop fails.
    """
    pools = [[normalize_url(u) for u in urls or ()] for urls in (prefill_urls, decode_urls, colocated_urls)]
    if pools[2] and (pools[0] or pools[1]):
        raise ValueError("colocated_urls: use either colocated backends or prefill+decode backends, not both")
    if not pools[2] and not (pools[0] and pools[1]):
        raise ValueError("prefill_urls/decode_urls: P/D mode needs at least one of each (or use colocated_urls)")
    prefill, decode, colocated = (RoundRobin(urls) if urls else None for urls in pools)
    proxy = Proxy(prefill, decode, colocated, api_key, timeout, connect_timeout, max_connections)
    app = web.Application()
    app[PROXY_KEY] = proxy
    app.cleanup_ctx.append(proxy.session_ctx)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.completions)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/metrics", proxy.render_metrics)
    return app


def run_proxy(prefill_urls: Sequence[str], decode_urls: Sequence[str], colocated_urls: Sequence[str] | None = None,
              host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, timeout: float = 600.0) -> None:
    app = build_proxy_app(prefill_urls, decode_urls, colocated_urls, api_key=api_key, timeout=timeout)
    # handler_cancellation: a client disconnect cancels the handler, which closes the hop in progress.
    web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None)


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill instances (P/D mode)")
    parser.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode instances (P/D mode)")
    parser.add_argument("--colocated", nargs="+", default=[], metavar="URL",
                        help="colocated instances: round-robin, no P/D")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="clients must send 'Authorization: Bearer KEY'")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a backend may stay silent")


def main_proxy(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_proxy(args.prefill, args.decode, args.colocated, host=args.host, port=args.port,
                  api_key=args.api_key, timeout=args.timeout)
    except ValueError as e:
        print(f"pdserve proxy: {e}", file=sys.stderr)
        return 2
    return 0
