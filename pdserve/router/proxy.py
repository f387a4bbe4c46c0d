"""The router: an OpenAI-compatible front that decides, per request, whether to disaggregate, which prefill (P)
instance computes the prompt and which decode (D) or colocated instance generates (docs/router.md).

Lifecycle of one `POST /v1/completions` or `POST /v1/chat/completions`:
1. Admission: past --max-in-flight requests a 503 with Retry-After. Check the api key (if set); read the
   client's JSON object within the body timeout (parsed off the event loop when large), else 400/408/413.
   Drop any kv_transfer_params, resume or router_token_ids the client sent: those are the router's alone.
   Take the client's X-Request-Id or make one: every hop carries it, and the router key, never the client's
   Authorization. Check the body against the OpenAI schema (protocol.py) before any backend works on it: a
   request D would refuse must not cost a prefill first (400 naming the field).
2. Route (policy.py): the prompt's token ids (tokenized here with the instances' tokenizer when the policy
   or the PD decider needs them) and block hashes, matched against the instances' cached blocks
   (prefix_index.py, fed by monitor.py), give a Route: a P and a D, or a D (or colocated instance) alone
   that prefills the request itself. No instance under its caps: the request waits for one, up to
   --queue-timeout, with at most --max-queued others; then a 503 with Retry-After.
3. Prefill hop (disaggregated): POST the P the body with `kv_transfer_params: {do_remote_decode: true}`,
   `stream: false`, no `stream_options`, and the client's own max_tokens: P checks prompt + max_tokens against
   its context, as D will, then generates one token (a prefill for a remote decode always does).
   A 4xx from P (validation) goes to the client as is. A 503 (P at capacity), a 401/403 (P refused the
   router's key), a connection error, a timeout or a 5xx routes the request again without that P: to another
   P once, then (or when no P is left) straight to a D or colocated instance, which prefills it itself. The
   client sees an error only when no instance can serve it: a 503 with Retry-After, or the decode hop's
   error (step 7), naming instances by pool and index ("decode-0"); URLs and backend error text stay in
   the log.
4. Take `kv_transfer_params` from P's JSON answer; missing: 502 naming the P. They carry P's first token
   (first_token_ids), which D sends at once, before it reads the KV.
5. Decode hop: POST the D the original body plus those `kv_transfer_params` (and, streaming,
   `router_token_ids`: each chunk also carries its tokens, for step 7). Before any byte of the answer: a 4xx
   goes to the client as is; anything else is a failure of D (step 7).
6. Answer: streaming, relay D's events to the client as they come, whole events only, less the router's token
   ids (relay.py); else return D's JSON. D saw the whole prompt, so its usage is the client's. The first bytes
   from D end time to first token.
7. D fails (no answer, a 5xx, the connection dropped or timed out mid-stream, an error event other than the
   request's own deadline): the request is resumed on another D or colocated instance, at most
   --max-recoveries times, without kv_transfer_params (that instance computes the prompt itself) and with
   `resume: {token_ids, num_tokens}`, the tokens the client has already received; the new instance goes on
   from there and its events reach the client as the same stream (the first one's id, created and model).
   Nothing to resume on (or the limit reached, or a stream without token ids): before any byte a 502 naming
   the D, after it an SSE error event, then `data: [DONE]`. A D that answers 503 at capacity has not
   failed: the request waits for room on any D or colocated instance (at most --queue-timeout), then the
   503 and its Retry-After go to the client.
8. Client disconnect: the handler is cancelled (handler_cancellation) or its write fails; closing the upstream
   response closes D's connection, or P's during step 3, and that backend aborts the request.
9. D never took the request (no connection, or it answered with an error status): POST P /v1/kv/release with
   the kv_transfer_params, in the background, so P frees the blocks now instead of when its lease runs out.
   Not on a timeout or a client disconnect: D may be reading P's blocks then, and it releases or finishes
   the read itself once its connection closes.
POST /tokenize and /detokenize, GET /v1/models go to an available decode (or colocated) instance as they are;
GET /v1/models/{model} is answered from its /v1/models (a client's name never goes into a path the router sends).
GET /cluster: every instance with its state, load and learned rates, and the routing counters (JSON).
This module admits requests and serves the routes; hops.py runs steps 3-4 and 9, recovery.py steps 5-7,
monitor.py keeps the instances' view, and errors.py words what a client learns of a failure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import contextlib
import copy
import logging
import os
import sys
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.cli_types import port as port_type
from pdserve.config import API_KEY_ENV, ROUTER_KEY_ENV
from pdserve.http_guard import (INLINE_PARSE_BYTES, RETRY_AFTER_S, ROUTER_KEY_HEADER, bearer_token,
                                expect_handler, parse_json, quiet_malformed_requests, read_body, runner_args,
                                secret_matches, use_fast_event_loop)
from pdserve.metrics import CONTENT_TYPE
from pdserve.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, error_body
from pdserve.router.errors import (NETWORK_ERRORS, BackendError, ClientError, describe, json_error, json_errors,
                                   public_detail)
from pdserve.router.hops import BODY_BYTES, JSON, encode_json, prefill_hop, push_params, release_transfer
from pdserve.router.instances import Instance, Ticket
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.monitor import (DEFAULT_EJECT_AFTER, DEFAULT_MAX_POLLS_PER_S, DEFAULT_POLL_INTERVAL_S, Monitor,
                                    StartupError)
from pdserve.router.policy import (DEFAULT_COST_TOLERANCE, DEFAULT_DIRECT_PREFILL_HEADROOM_S, DEFAULT_MAX_CANDIDATES,
                                   DEFAULT_MAX_HELD_FRACTION, DEFAULT_PD_MIN_PROMPT_TOKENS, POLICIES, Route, Router,
                                   RouterConfig, RouteRequest)
from pdserve.router.recovery import final_hop
from pdserve.stop_signals import stop_handler, stop_signals
from pdserve.tokenization import apply_chat_template, tokenize

logger = logging.getLogger(__name__)

ROUTER_FIELDS = ("kv_transfer_params", "resume", "router_token_ids")   # dropped from client bodies
DEFAULT_MAX_RECOVERIES = 2
MAX_PREFILL_ATTEMPTS = 2   # prefill hops one request may fail before it goes to a D (or colocated) alone
# Measured better than round-robin where prompts share prefixes and level where they do not (CPU, 2P2D:
# docs/benchmarks.md, "the router's policies", 2026-12-03 and 2026-12-07), as issue 14 asked of a default.
DEFAULT_POLICY = "cost"
DEFAULT_QUEUE_TIMEOUT_S = 30.0
MAX_CONNECT_TIMEOUT_S = 3600.0
MAX_FIRST_BYTE_S = 3600.0
DEFAULT_MAX_QUEUED = 1024


def parse_body(data: bytes, schema=None) -> tuple[dict, Any]:
    """The client's JSON object, and its parsed form when `schema` (a protocol request class) is given."""
    try:
        body = parse_json(data)
        if not isinstance(body, dict):
            raise ProtocolError(400, "request body must be a JSON object")
        parsed = schema.from_json(body) if schema is not None else None
    except ProtocolError as e:
        raise ClientError(e.status, e.message, e.param) from None
    return body, parsed


class Proxy:
    def __init__(self, router: Router, monitor: Monitor, api_key: str | None, timeout: float,
                 connect_timeout: float, router_key: str | None = None, max_in_flight: int = 4096,
                 body_timeout: float = 30.0, max_body_bytes: int = 32 << 20,
                 max_recoveries: int = DEFAULT_MAX_RECOVERIES, tokenizer: Any = None,
                 queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S, max_queued: int = DEFAULT_MAX_QUEUED,
                 startup_timeout: float | None = None) -> None:
        self.router, self.monitor = router, monitor
        self.max_recoveries = max_recoveries
        self.api_key, self.router_key = api_key, router_key
        self.max_in_flight, self.body_timeout, self.max_body_bytes = max_in_flight, body_timeout, max_body_bytes
        self.queue_timeout, self.max_queued, self.startup_timeout = queue_timeout, max_queued, startup_timeout
        self.num_in_flight = self.num_queued = 0
        # total=None: a long stream is fine; a backend silent for `timeout` seconds is not.
        # sock_connect, not connect: the latter would also count waiting for a pool slot as the backend's.
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=timeout)
        # A hop's own: until its first byte the instance computes the prompt, bounded by its load reports
        # (hops.while_heard); after it, a stream's reads by `timeout` each (recovery.stream).
        self.hop_timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=None)
        self.silence_s = timeout
        # A peer that reports itself healthy but never answers must not hold a request for ever: the bound
        # is the instances' own default request deadline (`serve --request-timeout`).
        self.first_byte_cap_s = MAX_FIRST_BYTE_S
        self.session: aiohttp.ClientSession | None = None
        self.metrics = ProxyMetrics(router)
        self.releases: set[asyncio.Task] = set()  # in the background: the client's answer does not wait
        # What clients (and metric labels) call each backend: its pool and index, never its address.
        self.names = {inst.url: inst.name for inst in router.instances}
        self.departed: dict[str, Instance] = {}   # left the cluster with hops still open (set_members)
        self.tokenizers = RouterTokenizers(tokenizer) if tokenizer is not None else None
        self.capacity = asyncio.Event()   # pulsed when a hop ends or a poll round lands: waiters look again
        self.next_passthrough = 0

    async def session_ctx(self, app: web.Application):
        # Admission bounds the hops: a request holds one backend connection at a time, plus a release in
        # the background. A smaller pool would make requests past it wait for a slot and time out as if
        # the backend had (a 502 blaming a healthy instance) instead of the 503 admission gives. The
        # monitor's polls share it: one connection per instance.
        connector = aiohttp.TCPConnector(limit=2 * self.max_in_flight + max(len(self.router.instances),
                                                                            MAX_POLLED_INSTANCES), limit_per_host=0)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        if self.startup_timeout:
            try:
                await self.monitor.check_at_start(self.session, self.startup_timeout)
            except BaseException:   # the app never starts, so no cleanup would close the session
                await self.session.close()
                raise
        self.monitor.on_round = self.pulse_capacity
        monitor = asyncio.get_running_loop().create_task(self.monitor.run(self.session))
        yield
        monitor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await monitor
        if self.tokenizers is not None:
            self.tokenizers.shutdown()
        await self.session.close()

    def set_members(self, members: Sequence[tuple[str, str, str]]) -> tuple[list[str], list[str]]:
        """Follow a cluster whose instances come and go (docs/ray.md): `members` is every instance that should
        take requests now, as (name, url, role). New ones are routed to at once, the others leave routing (their
        hops in flight end on their own). Returns the names (added, removed). ValueError on a malformed or
        inconsistent list, with nothing changed."""
        wanted: dict[str, tuple[str, str]] = {}
        urls: dict[str, str] = {}
        for name, url, role in members:
            url = normalize_url(url)
            if role not in ("prefill", "decode", "colocated"):
                raise ValueError(f"members: {name}: role {role!r}")
            if name in wanted or url in urls:
                raise ValueError(f"members: {name} ({url}) given twice")
            wanted[name], urls[url] = (url, role), name
        # Those that left earlier and whose hops have all ended: nothing will ask about them again.
        self.departed = {name: inst for name, inst in self.departed.items() if inst.own_in_flight}
        current = {inst.name: inst for inst in self.router.instances}
        removed = [name for name, inst in current.items() if (inst.url, inst.role) != wanted.get(name)]
        for name in removed:
            inst = self.router.remove(name)
            self.monitor.forget(name)
            self.names.pop(inst.url, None)
            self.departed[name] = inst
        added = [name for name in wanted if name not in self.router.by_name]
        for name in added:
            url, role = wanted[name]
            self.router.add(Instance(name, url, role))
            self.names[url] = name
        if added:
            self.pulse_capacity()   # requests waiting for an instance with room look again
        return added, removed

    def num_in_flight_on(self, name: str) -> int:
        """Hops still open on an instance that left (what its drain should wait for); 0 once none, and the
        record is dropped then."""
        inst = self.departed.get(name)
        if inst is None or inst.own_in_flight == 0:
            self.departed.pop(name, None)
            return 0
        return inst.own_in_flight

    def pulse_capacity(self) -> None:
        self.capacity.set()
        self.capacity = asyncio.Event()

    def begin(self, inst: Instance, req: RouteRequest, *, computes_prompt: bool) -> Ticket:
        return self.router.begin(inst, req, time.monotonic(), computes_prompt=computes_prompt)

    def end(self, inst: Instance, ticket: Ticket) -> None:
        self.router.end(inst, ticket)
        self.pulse_capacity()

    def is_authorized(self, request: web.Request) -> bool:
        return self.api_key is None or secret_matches(bearer_token(request), self.api_key)

    def backend_headers(self, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        if self.router_key is not None:
            headers[ROUTER_KEY_HEADER] = self.router_key
        return headers

    async def read_body(self, request: web.Request, schema=None) -> tuple[dict, Any]:
        try:
            data = await read_body(request, self.body_timeout, self.max_body_bytes)
        except ProtocolError as e:
            raise ClientError(e.status, e.message) from None
        BODY_BYTES.set(len(data))
        if len(data) <= INLINE_PARSE_BYTES:
            return parse_body(data, schema)
        return await asyncio.to_thread(parse_body, data, schema)

    def check_prompt_size(self, parsed: Any, num_chars: int) -> None:
        """ClientError 400 for a prompt no instance would take (longer than every instance's context, or
        than every instance's character limit), before the router tokenizes or hashes it: a prompt of
        megabytes would hold the tokenizer thread, or the event loop, for seconds. A limit is not checked
        while some instance has not reported it (not polled yet, an older pdserve, another server)."""
        reports = [inst.report for inst in self.router.instances if not inst.removed]

        def largest(field: str) -> int | None:   # None while any instance has not said (it may take more)
            values = [getattr(r, field) if r is not None else None for r in reports]
            return max(values) if values and None not in values else None
        max_model_len = largest("max_model_len")
        prompt = getattr(parsed, "prompt", None)
        if isinstance(prompt, list) and max_model_len is not None and len(prompt) >= max_model_len:
            raise ClientError(400, f"prompt: {len(prompt)} tokens; this model's maximum context length is "
                                   f"{max_model_len} tokens", "prompt")
        max_chars = largest("max_prompt_chars")
        if max_chars is not None and num_chars > max_chars:
            param = "messages" if isinstance(parsed, ChatCompletionRequest) else "prompt"
            raise ClientError(400, f"{param}: {num_chars} characters, more than the instances take "
                                   f"({max_chars})", param)

    async def route_request(self, parsed: Any, num_chars: int) -> RouteRequest:
        """What the router needs to know of the prompt: its token ids when the policy or the decider look
        at cached prefixes (tokenized as the instances do), else its length (exact for token ids, about a
        token per 4 characters for text)."""
        max_tokens = getattr(parsed, "max_tokens", None)
        prompt = getattr(parsed, "prompt", None)
        if isinstance(prompt, list):
            return self.router.request(len(prompt), max_tokens, prompt if self.router.needs_tokens else None)
        if self.tokenizers is None or not self.router.needs_tokens:
            return self.router.request(max(1, num_chars // 4), max_tokens)
        token_ids = await self.tokenizers.tokenize(parsed, num_chars)
        return self.router.request(len(token_ids), max_tokens, token_ids)

    async def wait_for_route(self, req: RouteRequest, failed: set[str]) -> Route:
        """A route now, or once an instance has room again (backpressure: requests wait here, bounded in
        number and time, instead of piling onto instances); ClientError 503 when none comes."""
        route = self.router.route(req, exclude=failed, now=time.monotonic())
        if route is not None:
            return route
        if not any(inst.is_available and inst.name not in failed for inst in self.router.instances):
            raise ClientError(503, "no instance is available to serve the request (every one is down or "
                                   "failed it); retry later", retry_after=RETRY_AFTER_S)
        if self.num_queued >= self.max_queued or self.queue_timeout <= 0:
            self.metrics.num_rejected.inc()
            raise ClientError(503, f"every instance is at capacity and {self.num_queued} requests wait for one; "
                                   f"retry later", retry_after=RETRY_AFTER_S)
        deadline = time.monotonic() + self.queue_timeout
        self.num_queued += 1
        self.metrics.num_queued.inc()
        try:
            while (left := deadline - time.monotonic()) > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.capacity.wait(), left)
                route = self.router.route(req, exclude=failed, now=time.monotonic())
                if route is not None:
                    return route
        finally:
            self.num_queued -= 1
            self.metrics.num_queued.dec()
        self.metrics.num_rejected.inc()
        raise ClientError(503, f"no instance had room for the request within {self.queue_timeout:g} s; retry "
                               f"later", retry_after=RETRY_AFTER_S)

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
            body, parsed = await self.read_body(request, ChatCompletionRequest if is_chat else CompletionRequest)
            for field in ROUTER_FIELDS:   # the router's to set, never the client's
                body.pop(field, None)
            start, headers = time.monotonic(), self.backend_headers(request_id)
            num_chars = prompt_chars(parsed)
            self.check_prompt_size(parsed, num_chars)
            req = await self.route_request(parsed, num_chars)
            return await self.serve(request, req, body, headers, start)
        except ClientError as e:
            self.metrics.num_errors.inc()
            if 400 <= e.status < 500 and e.status != 429:   # not the router's own 503 at capacity
                self.metrics.num_client_errors.inc()
            return e.response()
        except BackendError as e:
            level = logging.INFO if e.body is not None else logging.WARNING  # a 4xx is the client's doing
            logger.log(level, "request %s: %s", request_id, e)
            self.metrics.num_errors.inc()
            if e.is_client_error:
                self.metrics.num_client_errors.inc()
            return e.response(self.names)
        except asyncio.CancelledError:
            self.metrics.num_client_disconnects.inc()
            raise
        finally:
            self.num_in_flight -= 1
            self.metrics.num_in_flight.dec()

    async def serve(self, request: web.Request, req: RouteRequest, body: dict, headers: dict,
                    start: float) -> web.StreamResponse:
        """Steps 2-7: route, then the prefill hop (routed once more without a P that failed it) and the
        decode hop, or the direct hop alone."""
        failed: set[str] = set()
        while True:
            route = await self.wait_for_route(req, failed)
            if route.prefill is None:
                return await final_hop(self, request, req, route.decode, body, headers, start)
            prefill = route.prefill
            if prefill.handoff != route.decode.handoff:  # (one restarted with another connector since start-up)
                logger.warning("request %s: %s and %s hand KV over in different ways; routing it again without %s",
                               headers["X-Request-Id"], prefill.name, route.decode.name, prefill.name)
                failed.add(prefill.name)
                continue
            if prefill.is_push:
                pushed = push_params(prefill, route.decode)
                if pushed is not None:
                    return await self.serve_pushed(request, req, route, body, headers, start, pushed)
                failed.add(prefill.name)  # its side channel is not known yet: another P, or straight to a D
                continue
            ticket = self.begin(prefill, req, computes_prompt=True)
            try:
                params = await prefill_hop(self, prefill, ticket, request.path, body, headers)
            except BackendError as e:
                if not e.is_retryable:
                    raise
                failed.add(prefill.name)
                if len(failed) >= MAX_PREFILL_ATTEMPTS:   # enough P tried: a D computes the prompt itself
                    failed.update(inst.name for inst in self.router.instances if inst.role == "prefill")
                logger.warning("request %s: %s; routing it again without %s", headers["X-Request-Id"], e,
                               prefill.name)
                self.metrics.num_prefill_retries.inc()
                continue
            decode = route.decode
            if decode.removed:   # it left the cluster during the prefill: another D reads the KV instead
                decode = self.router.another_decode(req, prefill.handoff, exclude=failed,
                                                    now=time.monotonic()) or decode
            return await final_hop(
                self, request, req, decode, body, headers, start, kv_transfer_params=params,
                release=lambda: release_transfer(self, prefill.url, params, headers))

    async def serve_pushed(self, request: web.Request, req: RouteRequest, route: Route, body: dict, headers: dict,
                           start: float, pushed: tuple[dict, dict, dict, dict]) -> web.StreamResponse:
        """The push handoff: the prefill hop and the decode hop at once, one transfer id; P writes into D's
        blocks as soon as its prefill is done and D never waits for P's answer. P's hop failing releases the
        transfer on D, whose load then fails (kv_load_failure_policy; a failed D hop is recovered as any)."""
        p_params, d_params, p_release, d_release = pushed
        prefill, decode = route.prefill, route.decode
        ticket = self.begin(prefill, req, computes_prompt=True)
        task = asyncio.create_task(prefill_hop(self, prefill, ticket, request.path, body, headers, p_params))

        def prefill_done(task: asyncio.Task) -> None:
            error = None if task.cancelled() else task.exception()
            if error is None:
                return
            logger.warning("request %s: push prefill on %s failed: %s", headers["X-Request-Id"], prefill.name, error)
            if d_release:
                release_transfer(self, decode.url, d_release, headers)
        task.add_done_callback(prefill_done)
        try:
            return await final_hop(
                self, request, req, decode, body, headers, start, kv_transfer_params=d_params,
                release=lambda: release_transfer(self, prefill.url, p_release, headers))
        finally:
            if not task.done():  # the client left (or D's answer came first): P's hop is not needed
                task.cancel()

    def passthrough_instance(self) -> Instance | None:
        """The next available decode or colocated instance, round-robin."""
        pool = [inst for inst in self.router.instances if inst.role != "prefill" and inst.is_available]
        if not pool:
            return None
        inst = pool[self.next_passthrough % len(pool)]
        self.next_passthrough += 1
        return inst

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}, answered from an instance's GET /v1/models: the name is never put in a
        path the router sends (decoded, "..%2F..%2Fv1%2Fload" reached an instance's router-only load report
        with the router's key)."""
        resp = await self.passthrough(request, path="/v1/models")
        if resp.status != 200:
            return resp
        name = request.match_info["model"]
        try:
            cards = json.loads(resp.body)["data"]
            card = next((c for c in cards if isinstance(c, dict) and c.get("id") == name), None)
        except (ValueError, KeyError, TypeError):
            return json_error("an instance answered GET /v1/models with no model list", 502, "backend_error")
        if card is None:
            return web.json_response(error_body(f"the model {name!r} does not exist", status=404, param="model"),
                                     status=404)
        return web.json_response(card)

    async def passthrough(self, request: web.Request, path: str | None = None) -> web.Response:
        """GET /v1/models, POST /tokenize, /detokenize (or `path`): asked of one available decode (or
        colocated) instance, the next one when it cannot be reached."""
        if not self.is_authorized(request):
            return json_error("invalid or missing API key (Authorization: Bearer <key>)", 401)
        headers = self.backend_headers(request.headers.get("X-Request-Id") or f"pdserve-{uuid.uuid4().hex}")
        try:
            data = None if request.method == "GET" else (await self.read_body(request))[0]
        except ClientError as e:
            return json_error(e.message, e.status)
        tried: set[str] = set()
        while (inst := self.passthrough_instance()) is not None and inst.name not in tried:
            tried.add(inst.name)
            try:
                payload = None if data is None else await encode_json(data)
                async with self.session.request(request.method, inst.url + (path or request.path), data=payload,
                                                headers={**headers, "Content-Type": JSON},
                                                timeout=aiohttp.ClientTimeout(total=60)) as resp:
                    if resp.status in (401, 403):
                        raise BackendError(inst.role, inst.url, f"HTTP {resp.status}",
                                           public_detail="refused the router")
                    return web.Response(status=resp.status, body=await resp.read(), headers={
                        "Content-Type": resp.headers.get("Content-Type", "application/json")})
            except NETWORK_ERRORS as e:
                logger.warning("%s %s on %s failed: %s", request.method, request.path, inst.url, describe(e))
                if isinstance(e, aiohttp.ClientConnectorError):
                    self.monitor.connect_failed(inst, e)
                error = json_error(f"the {inst.name} instance {public_detail(e)}", 502, "backend_error")
            except BackendError as e:
                logger.warning("%s %s: %s", request.method, request.path, e)
                return e.response(self.names)
        if not tried:
            return json_error("no decode or colocated instance is available; retry later", 503, "unavailable")
        return error

    def backends(self) -> dict[str, list[dict]]:
        backends: dict[str, list[dict]] = {}
        for inst in self.router.instances:
            backends.setdefault(inst.role, []).append(
                {"name": inst.name, "healthy": inst.is_available, "detail": inst.detail or "ok"})
        return backends

    async def health(self, request: web.Request) -> web.Response:
        """200 while some decode or colocated instance is available (with no P left, those prefill requests
        themselves); else 503. Each instance's state as the monitor sees it, named by pool and index."""
        can_serve = any(inst.is_available for inst in self.router.instances if inst.role != "prefill")
        return web.json_response({"status": "ok" if can_serve else "unavailable", "mode": self.router.mode,
                                  "backends": self.backends()}, status=200 if can_serve else 503)

    async def cluster(self, request: web.Request) -> web.Response:
        """GET /cluster: every instance with its role, state, load and learned rates, the routing counters."""
        if not self.is_authorized(request):
            return json_error("invalid or missing API key (Authorization: Bearer <key>)", 401)
        status = self.router.cluster_status()
        status.update(num_in_flight=self.num_in_flight, num_queued=self.num_queued,
                      pd_min_prompt_tokens=self.router.config.pd_min_prompt_tokens)
        return web.json_response(status)

    async def render_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def prompt_chars(parsed: Any) -> int:
    """Characters the tokenizer would read: what picks the inline or the worker path (the body's length
    is unknown for a chunked upload, and counts JSON escapes and other fields)."""
    if isinstance(parsed, ChatCompletionRequest):
        return sum(len(str(message.get("content") or "")) for message in parsed.messages)
    prompt = getattr(parsed, "prompt", None)
    return len(prompt) if isinstance(prompt, str) else 0


class RouterTokenizers:
    """The instances' tokenizer, for routing only: small prompts tokenized on the event loop (well under a
    millisecond), larger ones on one worker thread with its own copy (a tokenizer is not safe to share
    between threads), so a long prompt never holds up the loop."""

    INLINE_CHARS = 2048

    def __init__(self, tokenizer: Any) -> None:
        self.inline = tokenizer
        self.worker = copy.deepcopy(tokenizer)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-tokenizer")

    async def tokenize(self, parsed: Any, num_chars: int) -> list[int]:
        try:
            if num_chars <= self.INLINE_CHARS:
                return self._tokenize(self.inline, parsed)
            return await asyncio.get_running_loop().run_in_executor(self.executor, self._tokenize, self.worker,
                                                                    parsed)
        except ProtocolError as e:
            raise ClientError(e.status, e.message, e.param) from None

    @staticmethod
    def _tokenize(tokenizer: Any, parsed: Any) -> list[int]:
        if isinstance(parsed, ChatCompletionRequest):
            return apply_chat_template(tokenizer, parsed)
        return tokenize(tokenizer, parsed.prompt)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


PROXY_KEY = web.AppKey("proxy", Proxy)
MAX_POLLED_INSTANCES = 1024   # room in the connection pool for polls of instances that join later


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def build_instances(prefill_urls: Sequence[str], decode_urls: Sequence[str],
                    colocated_urls: Sequence[str]) -> list[Instance]:
    """One Instance per URL, named by pool and index; ValueError naming a duplicate URL."""
    instances, seen = [], {}
    for role, urls in (("prefill", prefill_urls), ("decode", decode_urls), ("colocated", colocated_urls)):
        for i, raw in enumerate(urls or ()):
            url = normalize_url(raw)
            if url in seen:
                raise ValueError(f"{raw}: given twice (as {seen[url]} and as {role}-{i}); each instance once")
            seen[url] = f"{role}-{i}"
            instances.append(Instance(f"{role}-{i}", url, role))
    return instances


def build_proxy_app(prefill_urls: Sequence[str], decode_urls: Sequence[str],
                    colocated_urls: Sequence[str] | None = None, api_key: str | None = None,
                    timeout: float = 600.0, connect_timeout: float = 10.0,
                    *, router_key: str | None = None, max_in_flight: int = 4096,
                    max_body_bytes: int = 32 << 20, body_timeout: float = 30.0,
                    max_recoveries: int = DEFAULT_MAX_RECOVERIES, policy: str = DEFAULT_POLICY,
                    router_config: RouterConfig | None = None, tokenizer: Any = None,
                    poll_interval: float = DEFAULT_POLL_INTERVAL_S, eject_after: int = DEFAULT_EJECT_AFTER,
                    max_polls_per_s: float = DEFAULT_MAX_POLLS_PER_S,
                    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S, max_queued: int = DEFAULT_MAX_QUEUED,
                    startup_timeout: float | None = None, dynamic: bool = False) -> web.Application:
    """Prefill and decode instances (P/D), colocated instances, or all three (the router may then send a
    request to a colocated instance instead of splitting it).

    timeout: seconds a backend may stay silent (between bytes) before the hop fails.
    startup_timeout: when given, the app's start waits for every instance to answer its /v1/load with the
    role of its pool, and fails (StartupError naming it) when one does not within that many seconds.
    dynamic: the pools follow `Proxy.set_members` (a Ray cluster's registry); the URL lists may be empty.
    """
    if dynamic:
        if prefill_urls or decode_urls or colocated_urls:
            raise ValueError("dynamic: the instances come from set_members, not URL lists")
    elif bool(prefill_urls) != bool(decode_urls):
        raise ValueError("prefill_urls/decode_urls: P/D needs at least one of each (prefill instances hand their "
                         "KV to decode instances)")
    elif not (prefill_urls or colocated_urls):
        raise ValueError("prefill_urls/decode_urls/colocated_urls: give P and D instances, colocated ones, or both")
    for name, value, low in (("max_in_flight", max_in_flight, 1), ("max_recoveries", max_recoveries, 0),
                             ("eject_after", eject_after, 1), ("max_queued", max_queued, 0)):
        if value < low:
            raise ValueError(f"{name}: must be >= {low}, got {value}")
    if not poll_interval > 0:
        raise ValueError(f"poll_interval: must be > 0 seconds, got {poll_interval}")
    instances = build_instances(prefill_urls, decode_urls, colocated_urls or ())
    router = Router(instances, policy, router_config or RouterConfig(), dynamic=dynamic)
    headers = {ROUTER_KEY_HEADER: router_key} if router_key is not None else {}
    monitor = Monitor(router.instances, router.index, headers=headers, interval=poll_interval, eject_after=eject_after,
                      max_polls_per_s=max_polls_per_s)
    proxy = Proxy(router, monitor, api_key, timeout, connect_timeout, router_key=router_key,
                  max_in_flight=max_in_flight, body_timeout=body_timeout, max_body_bytes=max_body_bytes,
                  max_recoveries=max_recoveries, tokenizer=tokenizer, queue_timeout=queue_timeout,
                  max_queued=max_queued, startup_timeout=startup_timeout)
    quiet_malformed_requests()
    app = web.Application(client_max_size=max_body_bytes, middlewares=[json_errors])
    app[PROXY_KEY] = proxy
    app.cleanup_ctx.append(proxy.session_ctx)
    for path, handler in (("/v1/completions", proxy.completions), ("/v1/chat/completions", proxy.completions),
                          ("/tokenize", proxy.passthrough), ("/detokenize", proxy.passthrough)):
        app.router.add_post(path, handler, expect_handler=expect_handler)
    for path, handler in (("/v1/models", proxy.passthrough), ("/v1/models/{model:.+}", proxy.model),
                          ("/health", proxy.health),
                          ("/cluster", proxy.cluster), ("/metrics", proxy.render_metrics)):
        app.router.add_get(path, handler, expect_handler=expect_handler)
    return app


async def _take_stop_signals(app: web.Application) -> None:
    """aiohttp's own handlers take a second signal during the shutdown as an abort, which cut the streams
    when systemd and `pdserve up` both sent SIGTERM: the same stop now (stop_signals.py)."""
    def graceful_exit() -> None:
        raise web.GracefulExit()   # a SystemExit: it leaves the loop, and run_app shuts the app down
    loop = asyncio.get_running_loop()
    on_signal = stop_handler(graceful_exit)
    for sig in stop_signals():
        loop.add_signal_handler(sig, on_signal)


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    """The routing flags `pdserve proxy` and `pdserve up` share."""
    g = parser.add_argument_group("routing (docs/router.md)")
    g.add_argument("--policy", default=DEFAULT_POLICY, choices=list(POLICIES),
                   help="how an instance is chosen in each pool: round-robin; least-load (fewest prompt tokens "
                        "queued on a P, fewest requests on a D); prefix-affinity (the longest cached prefix "
                        "unless that instance is far busier than the least loaded); cost (the least estimated "
                        f"time to first token: queue + uncached prompt / learned prefill rate + KV transfer). "
                        f"Default: {DEFAULT_POLICY}")
    g.add_argument("--pd-min-prompt-tokens", type=int, default=DEFAULT_PD_MIN_PROMPT_TOKENS, metavar="T",
                   help="conditional disaggregation: a request whose uncached prompt is shorter than T tokens "
                        "(or that a D holds all but T tokens of) goes straight to a decode or colocated instance, "
                        "which prefills it itself; 0: always disaggregate while a P can take it "
                        f"(default {DEFAULT_PD_MIN_PROMPT_TOKENS})")
    g.add_argument("--direct-prefill-headroom", type=float, default=DEFAULT_DIRECT_PREFILL_HEADROOM_S, metavar="S",
                   help="when every P has more than S seconds of prompts queued (or is at a cap), a decode "
                        "instance whose own prefill work, queued and this prompt's, stays under S seconds "
                        "computes the prompt itself; its running streams stall meanwhile, which S bounds "
                        f"(default {DEFAULT_DIRECT_PREFILL_HEADROOM_S:g}; 0: a D never prefills while a P is up)")
    g.add_argument("--cost-tolerance", type=float, default=DEFAULT_COST_TOLERANCE, metavar="F",
                   help="cost: instances whose estimated time to first token is within this fraction of the best "
                        "one's count as equal, since the learned rates are noisy: the one with the longest cached "
                        "prefix among them wins, equal ones take turns "
                        f"(default {DEFAULT_COST_TOLERANCE:g}; 0: always the lowest estimate)")
    g.add_argument("--max-candidates", type=int, default=DEFAULT_MAX_CANDIDATES, metavar="K",
                   help="past K instances in a pool, a request under a load-aware policy (least-load, "
                        "prefix-affinity, cost) considers K of them: those holding more of its prompt than most "
                        "(up to half), then a window of the pool from a random place, so that the router's work "
                        "per request stays flat at hundreds of instances; all of them when none of the K can take "
                        f"it (default {DEFAULT_MAX_CANDIDATES}; 0: always all); round-robin looks at the K after "
                        "its cursor, which gives a full scan's answer")


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill instances (--kv-role producer)")
    parser.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode instances (--kv-role consumer)")
    parser.add_argument("--colocated", nargs="+", default=[], metavar="URL",
                        help="colocated instances (no KV connector): alone a load-balanced pool; beside P and D a "
                             "pool the router may send whole requests to")
    parser.add_argument("--host", default="127.0.0.1", help="address the router listens on")
    parser.add_argument("--port", type=port_type, default=8000, help="port of the router's OpenAI-compatible API")
    parser.add_argument("--model", default=None,
                        help="the instances' model (as given to `pdserve serve --model`): the router loads its "
                             "tokenizer to match prompts against cached KV blocks (prefix-affinity, cost, "
                             "--pd-min-prompt-tokens); without it, prompts given as text count ~4 characters a "
                             "token and only token-id prompts match cached prefixes")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"clients must send 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; prefer the "
                             f"variable, a flag is visible to every local user in ps)")
    parser.add_argument("--router-key", default=os.environ.get(ROUTER_KEY_ENV),
                        help=f"the secret the instances expect from the router (default: ${ROUTER_KEY_ENV}); "
                             f"the client's own Authorization is never forwarded")
    add_routing_arguments(parser)
    g = parser.add_argument_group("limits and health")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a backend may stay silent: no byte once it answered; before its first byte "
                        "(computing the prompt, or a non-streamed answer) no healthy load report either, "
                        "however long the computation itself takes")
    g.add_argument("--connect-timeout", type=float, default=10.0,
                   help="seconds a backend has to accept a connection; past it the request goes elsewhere as "
                        "one the backend never took (and P's blocks are released at once)")
    g.add_argument("--max-in-flight", type=int, default=4096,
                   help="requests served at once; more get a 503 with Retry-After")
    g.add_argument("--max-per-instance", type=int, default=None,
                   help="requests in flight on one instance (a hot prefix then spreads over replicas); past it on "
                        "every instance, requests wait (default: no cap beyond the instances' own admission)")
    g.add_argument("--max-held-fraction", type=float, default=DEFAULT_MAX_HELD_FRACTION,
                   help="a P whose KV cache is this much held for D to read takes no new prompt (backpressure "
                        f"from slow handoffs; default {DEFAULT_MAX_HELD_FRACTION})")
    g.add_argument("--queue-timeout", type=float, default=DEFAULT_QUEUE_TIMEOUT_S,
                   help="seconds a request may wait for an instance with room before its 503 "
                        f"(default {DEFAULT_QUEUE_TIMEOUT_S:g})")
    g.add_argument("--max-queued", type=int, default=DEFAULT_MAX_QUEUED,
                   help=f"requests that may wait so at once; more get a 503 at once (default {DEFAULT_MAX_QUEUED})")
    g.add_argument("--max-body-bytes", type=int, default=32 << 20, help="largest request body")
    g.add_argument("--max-recoveries", type=int, default=DEFAULT_MAX_RECOVERIES,
                   help="times one request may be resumed on another decode (or colocated) instance after "
                        "the one serving it failed; 0: never")
    g.add_argument("--poll-interval", type=float, default=DEFAULT_POLL_INTERVAL_S,
                   help=f"seconds between two load reports asked of each instance (default {DEFAULT_POLL_INTERVAL_S:g}), "
                        f"or longer past --max-polls-per-second")
    g.add_argument("--max-polls-per-second", type=float, default=DEFAULT_MAX_POLLS_PER_S,
                   help="load reports the router asks for per second, all instances together: past it each "
                        "instance is polled less often, the polls spread over the round (at 500 instances every "
                        f"0.1 s took 75 %% of the router's core on CPU; default {DEFAULT_MAX_POLLS_PER_S:g})")
    g.add_argument("--eject-after", type=int, default=DEFAULT_EJECT_AFTER,
                   help="failed checks in a row (polls, refused connections) that take an instance out of routing; "
                        f"it comes back on its first good poll (default {DEFAULT_EJECT_AFTER})")
    g.add_argument("--startup-timeout", type=float, default=60.0,
                   help="seconds every instance has to answer with the role of its pool before the router gives "
                        "up at start; 0: serve at once (an instance that does not answer is ejected by the polls)")


def proxy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """build_proxy_app's keyword arguments from `pdserve proxy`'s flags (not the pools, not the tokenizer):
    shared with the Ray router actor, which takes the same flags. ValueError on a bad value."""
    config = RouterConfig(pd_min_prompt_tokens=args.pd_min_prompt_tokens,
                          max_per_instance=args.max_per_instance, max_held_fraction=args.max_held_fraction,
                          cost_tolerance=args.cost_tolerance, max_candidates=args.max_candidates,
                          direct_prefill_headroom_s=args.direct_prefill_headroom)
    for name, upper in (("timeout", math.inf), ("connect_timeout", MAX_CONNECT_TIMEOUT_S)):
        if not 0 < getattr(args, name) <= upper:   # (also NaN; inf is no limit for --timeout, an aiohttp crash
            # for --connect-timeout, whose deadline it rounds to an integer)
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds"
                             + (f" up to {upper:g}" if upper < math.inf else "") + f", got {getattr(args, name)}")
    return dict(api_key=args.api_key, timeout=args.timeout, connect_timeout=args.connect_timeout,
                router_key=args.router_key,
                max_in_flight=args.max_in_flight, max_body_bytes=args.max_body_bytes,
                max_recoveries=args.max_recoveries, policy=args.policy, router_config=config,
                poll_interval=args.poll_interval, eject_after=args.eject_after,
                max_polls_per_s=args.max_polls_per_second,
                queue_timeout=args.queue_timeout, max_queued=args.max_queued)


def main_proxy(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        tokenizer = None
        if args.model is not None:
            from pdserve.model.loader import load_tokenizer
            tokenizer = load_tokenizer(args.model)
        app = build_proxy_app(args.prefill, args.decode, args.colocated, tokenizer=tokenizer,
                              startup_timeout=args.startup_timeout, **proxy_kwargs(args))
    except (ValueError, OSError) as e:
        print(f"pdserve proxy: {e}", file=sys.stderr)
        return 2
    # handler_cancellation: a client disconnect cancels the handler, which closes the hop in progress.
    logger.info("event loop: %s", use_fast_event_loop())
    app.on_startup.append(_take_stop_signals)
    try:
        web.run_app(app, host=args.host, port=args.port, access_log=None, handle_signals=False, **runner_args())
    except StartupError as e:
        print(f"pdserve proxy: {e}", file=sys.stderr)
        return 2
    return 0
