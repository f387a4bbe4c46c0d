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
This module admits requests and serves the routes; hops.py runs steps 2-3 and 8, recovery.py steps 4-6, and
errors.py words what a client learns of a failure.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
import uuid
from collections.abc import Sequence

import aiohttp
from aiohttp import web

from pdserve.config import API_KEY_ENV, ROUTER_KEY_ENV
from pdserve.http_guard import (INLINE_PARSE_BYTES, RETRY_AFTER_S, ROUTER_KEY_HEADER, bearer_token,
                                expect_handler, parse_json, quiet_malformed_requests, read_body, runner_args,
                                secret_matches)
from pdserve.metrics import CONTENT_TYPE
from pdserve.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, error_body
from pdserve.router.errors import (NETWORK_ERRORS, BackendError, ClientError, describe, json_error, json_errors,
                                   public_detail)
from pdserve.router.hops import prefill_hop, release_on_prefill
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.policy import Policy, RoundRobin
from pdserve.router.recovery import final_hop

logger = logging.getLogger(__name__)

ROUTER_FIELDS = ("kv_transfer_params", "resume", "router_token_ids")   # dropped from client bodies
DEFAULT_MAX_RECOVERIES = 2


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
                return await final_hop(self, request, "colocated", self.colocated, body, headers, start)
            prefill_url, kv_transfer_params = await prefill_hop(self, request.path, body, headers, is_chat)
            return await final_hop(
                self, request, "decode", self.decode, body, headers, start, kv_transfer_params=kv_transfer_params,
                release=lambda: release_on_prefill(self, prefill_url, kv_transfer_params, headers))
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
