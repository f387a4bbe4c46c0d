"""OpenAI-compatible HTTP server over an AsyncEngine: routes, SSE, /health, /metrics, /tokenize, /v1/load.

One generation request (POST /v1/completions or /v1/chat/completions), step by step:
  1. middleware: the router key (X-PDServe-Router-Key) or the Bearer API key when one is set (every
     path but /health and /metrics); every error leaves as OpenAI-style JSON with its HTTP status, and an
     unexpected exception as a 500 whose details stay in the log
  2. admission: past max_num_seqs + max_queued_requests in flight, a 503 with Retry-After
  3. read the body within body_timeout_s (408) and at most max_body_bytes (413); parse it (off the event
     loop when large) into a CompletionRequest / ChatCompletionRequest (protocol.py; 400 naming the field);
     kv_transfer_params and resume (the router's stream recovery: tokens another instance generated
     for this request, to go on from) only from the router (403)
  4. check the model name, the prompt's characters before tokenizing (400), then tokenize (or apply the
     chat template) on a lane thread: small prompts and large ones on separate threads, each with its own
     tokenizer, so the event loop keeps streaming and one large prompt never holds up small ones; check
     the length against max_model_len (400)
  5. engine.generate(request_id, prompt_token_ids, params, kv_transfer_params); the first output is
     awaited before any byte is sent, so an engine that refuses the request (ValueError) gives a 400
  6. stream: one SSE chunk per output with text, the finish reason on the last, then an optional usage
     chunk and [DONE]; an engine error becomes an error event. Non-stream: collect, answer one JSON
     body that also carries the engine's final kv_transfer_params (the P/D proxy reads them). The whole
     request runs under request_timeout_s: a 504 before the first byte, an error event after it
  7. always: if the request did not finish (client gone, error, deadline, cancellation), close the
     engine's output stream and engine.abort(request_id), so its blocks are freed

A client that goes away cancels the handler: start_server turns on aiohttp's handler_cancellation; under
a runner without it, a watcher task polls the transport and cancels the handler itself, and a failed SSE
write ends a stream. docs/security.md has the threat model and every limit.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from pdserve import protocol
from pdserve.config import ServerConfig
from pdserve.http_guard import (INLINE_PARSE_BYTES, RETRY_AFTER_S, ROUTER_KEY_HEADER, bearer_token,
                                expect_handler, parse_json, quiet_malformed_requests, read_body, runner_args,
                                secret_matches)
from pdserve.metrics import CONTENT_TYPE
from pdserve.outputs import FinishReason, RequestOutput
from pdserve.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from pdserve.server.metrics import ServerMetrics
from pdserve.tokenization import apply_chat_template, detokenize, tokenize

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5
OPEN_PATHS = frozenset({"/health", "/metrics"})   # probes and scrapers need no key
SMALL_INPUT_CHARS = 16 << 10          # prompts up to this many characters take the small lane
MAX_SEQ_DIGITS = 20                   # GET /v1/load's events_after: no seq grows past this
IS_ROUTER_KEY = web.RequestKey("pdserve_is_router", bool)


class _Generation:
    """One request's outputs from the engine, timed for the metrics. close() aborts it in the engine
    unless it finished."""

    def __init__(self, engine: Any, metrics: ServerMetrics, request_id: str, prompt_token_ids: list[int],
                 params: Any, kv_transfer_params: dict | None, resumed_token_ids: list[int] | None = None) -> None:
        self.engine, self.metrics, self.request_id = engine, metrics, request_id
        self.arrival = time.monotonic()
        self.last_token_time: float | None = None
        self.num_outputs = 0
        self.is_finished = False       # the engine is done with it: nothing to abort
        self._is_counted = False       # counted as a success, failure or abort
        resume = {"resumed_token_ids": resumed_token_ids} if resumed_token_ids else {}
        self._outputs = engine.generate(request_id, prompt_token_ids, params, kv_transfer_params, **resume)

    async def next(self) -> RequestOutput:
        """The next output; an engine failure comes back as an output with `error` set (and the request
        still counts as unfinished, so close() makes sure the engine lets go of it)."""
        try:
            output = await self._outputs.__anext__()
        except StopAsyncIteration:
            output = _error_output(self.request_id, "the engine ended the request without a finish reason")
        except ValueError as e:
            if self.num_outputs == 0:   # the engine refused the request up front: the client's fault
                self._is_counted = True
                raise ProtocolError(400, str(e)) from None
            output = _error_output(self.request_id, f"engine error: {e}")
        except Exception:   # noqa: BLE001 - an engine failure ends this request, not the server
            logger.exception("request %s: engine failed", self.request_id)
            output = _error_output(self.request_id, "internal engine error")   # details: the log above
        else:
            self.is_finished = output.finished
        self.num_outputs += 1
        self._observe(output)
        return output

    def _observe(self, output: RequestOutput) -> None:
        now, m = time.monotonic(), self.metrics
        num_new = len(output.new_token_ids)
        if num_new:
            if self.last_token_time is None:
                m.ttft.observe(now - self.arrival)
                m.prompt_tokens.inc(output.num_prompt_tokens)
                num_new_after_first, dt = num_new - 1, 0.0
            else:
                num_new_after_first, dt = num_new, now - self.last_token_time
            for _ in range(num_new_after_first):   # a delta of k tokens counts as k gaps of dt/k
                m.itl.observe(dt / num_new_after_first)
            m.generation_tokens.inc(num_new)
            self.last_token_time = now
        if (output.finished or output.error is not None) and not self._is_counted:
            self._is_counted = True
            m.e2e.observe(now - self.arrival)
            (m.request_failure if error_message(output) else m.request_success).inc()

    @property
    def is_done(self) -> bool:
        """The outcome is known (finished, failed or refused): a client leaving now changes nothing."""
        return self._is_counted

    async def close(self) -> None:
        if not self._is_counted:
            self._is_counted = True
            self.metrics.request_abort.inc()
        try:
            if self.is_finished:
                # Let the engine's generator run to its end now (its cleanup too), not when it is
                # garbage collected; closing it instead could read as an abort after the finish.
                async for _ in self._outputs:
                    logger.warning("request %s: output after the finish ignored", self.request_id)
                return
            self.is_finished = True
            aclose = getattr(self._outputs, "aclose", None)
            if aclose is not None:
                await aclose()     # the engine's generator aborts the request when closed
            await self.engine.abort(self.request_id)
        except Exception:   # noqa: BLE001 - best effort; the request is gone either way
            logger.exception("request %s: closing its output stream failed", self.request_id)


def _error_output(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, new_token_ids=[], new_text="", num_prompt_tokens=0,
                         num_output_tokens=0, finish_reason=FinishReason.ERROR, error=message)


def error_message(output: RequestOutput) -> str | None:
    """Why the request failed, or None when it is fine so far."""
    if output.error is not None:
        return output.error
    if output.finish_reason == FinishReason.ERROR:
        return "the engine failed the request"
    if output.finish_reason == FinishReason.ABORT:
        return "the request was aborted by the engine"
    return None


def _finish_reason(output: RequestOutput) -> str | None:
    reason = output.finish_reason
    return None if reason is None else getattr(reason, "value", reason)


GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def json_error(status: int, message: str, param: str | None = None,
               headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response(protocol.error_body(message, status=status, param=param), status=status,
                             headers=headers)


class OpenAIServer:
    """Route handlers over one engine."""

    def __init__(self, engine: Any, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config = config or ServerConfig()
        config.validate()
        self.metrics = ServerMetrics()
        self.max_body_bytes, self.max_prompt_chars = config.resolve_limits(engine.max_model_len)
        # Admission: what the engine can run at once plus a bounded queue; more is a 503, not a backlog.
        max_num_seqs = getattr(getattr(getattr(engine, "config", None), "scheduler", None), "max_num_seqs", 256)
        self.max_in_flight = max_num_seqs + config.max_queued_requests
        self.num_in_flight = 0
        # Two lanes, one thread each, each with its own tokenizer (a tokenizer is not safe to share
        # across threads): small inputs never wait behind a large one, and the event loop never parses
        # or tokenizes anything large itself.
        self._lanes = {lane: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pdserve-{lane}")
                       for lane in ("small", "large")}
        self._lane_tokenizers = threading.local()

    # ------------------------------------------------------------------ middleware

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            request[IS_ROUTER_KEY] = is_router = secret_matches(request.headers.get(ROUTER_KEY_HEADER),
                                                                self.config.router_key)
            if self.config.api_key is not None and request.path not in OPEN_PATHS and not is_router:
                if not secret_matches(bearer_token(request), self.config.api_key):
                    raise ProtocolError(401, "invalid or missing API key (Authorization: Bearer <key>)")
            draining = getattr(self.engine, "draining", None)
            if draining and request.method == "POST" and request.path in GENERATE_PATHS:
                raise ProtocolError(503, draining)   # with Retry-After: another instance may take it
            return await handler(request)
        except ProtocolError as e:
            headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
            response = json_error(e.status, e.message, e.param, headers=headers)
            if e.status == 408:   # the rest of a body that came too slowly must not be read as a request
                response.force_close()
            return response
        except web.HTTPException as e:   # 404, 405 (with its Allow header), 413 ...
            if e.status < 400:
                raise
            headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
            return json_error(e.status, f"{e.reason}: {request.method} {request.path}", headers=headers)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:   # noqa: BLE001 - nothing a client sends may take the server down
            logger.exception("%s %s failed", request.method, request.path)
            return json_error(500, "internal server error")   # the details are in the log, not for clients

    def _may_transfer_kv(self, request: web.Request) -> bool:
        """kv_transfer_params pin a P's blocks or make a D connect where they say: the router's to send.
        Without a router key, start-up allowed only a loopback address (see cli.py)."""
        return self.config.router_key is None or request[IS_ROUTER_KEY]

    # ------------------------------------------------------------------ small routes

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(protocol.models_response(self.engine.served_model_name,
                                                          self.engine.max_model_len))

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model} (the OpenAI clients' models.retrieve)."""
        name = request.match_info["model"]
        if name != self.engine.served_model_name:
            return json_error(404, f"the model {name!r} does not exist; this server serves "
                                   f"{self.engine.served_model_name!r}", "model")
        return web.json_response(protocol.model_card(name, self.engine.max_model_len))

    async def health(self, request: web.Request) -> web.Response:
        """200 while the engine steps; 503 with the reason when its process died, it reported itself
        broken or degraded (steps keep failing), or it has been silent past its stall bound."""
        try:
            is_healthy, reason = _engine_health(self.engine)
        except Exception:   # noqa: BLE001
            logger.exception("engine health check failed")
            is_healthy, reason = False, "the engine's health could not be read"
        return web.Response(status=200) if is_healthy else json_error(503, f"engine is not healthy: {reason}")

    async def release_kv(self, request: web.Request) -> web.Response:
        """POST /v1/kv/release {"kv_transfer_params": <what this P answered>}: the proxy's decode hop
        failed before a D took the request, so free the blocks held for it now, not at lease expiry."""
        if not self._may_transfer_kv(request):
            raise ProtocolError(403, "only the router may release KV blocks", "kv_transfer_params")
        body = await self._read_body(request)
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if not isinstance(params, dict):
            return json_error(400, "expected {\"kv_transfer_params\": {...}}", "kv_transfer_params")
        try:  # checked here: a malformed field must never reach the engine loop
            self.engine.release_kv(params)
        except LookupError as e:
            return json_error(404, str(e))
        except ValueError as e:
            return json_error(400, str(e), "kv_transfer_params")
        return web.json_response({"status": "accepted"}, status=202)

    async def load(self, request: web.Request) -> web.Response:
        """GET /v1/load?events_after=SEQ: the router's view of this instance (docs/router.md). Outside
        admission: the router polls it hardest when the instance is full. The router's alone when there
        is a router key, as kv_transfer_params are: the block hashes tell which prompts are cached here."""
        if not self._may_transfer_kv(request):
            raise ProtocolError(403, "only the router may read the load report")
        events_after = _events_after(request.query.getall("events_after", []))
        # the server's own limit too: the router refuses a longer prompt before it tokenizes it
        return web.json_response({**self.engine.load_report(events_after), "max_prompt_chars": self.max_prompt_chars})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(self.engine.stats), headers={"Content-Type": CONTENT_TYPE})

    # ------------------------------------------------------------------ generation routes

    async def completions(self, request: web.Request) -> web.StreamResponse:
        with self._admit():
            req = await self._parse(request, CompletionRequest)
            if isinstance(req.prompt, str):
                self._check_prompt_chars(len(req.prompt), "prompt")
                prompt_token_ids = await self._tokenize_in_lane(len(req.prompt), tokenize, req.prompt)
            else:
                prompt_token_ids = req.prompt
            return await self._generate(request, req, prompt_token_ids, is_chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        with self._admit():
            req = await self._parse(request, ChatCompletionRequest)
            num_chars = sum(len(m["content"]) for m in req.messages)
            self._check_prompt_chars(num_chars, "messages")
            prompt_token_ids = await self._tokenize_in_lane(num_chars, apply_chat_template, req)
            return await self._generate(request, req, prompt_token_ids, is_chat=True)

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize, as vLLM serves it: {"prompt": str} or {"messages": [...]} → the token ids."""
        with self._admit():   # it uses the tokenizer lanes as generation does
            return await self._tokenize_route(request)

    async def _tokenize_route(self, request: web.Request) -> web.Response:
        body = await self._read_body(request)
        is_chat = isinstance(body, dict) and "messages" in body
        req = ChatCompletionRequest.from_json(body) if is_chat else CompletionRequest.from_json(body)
        self._check_model(req.model)
        if is_chat:
            num_chars = sum(len(m["content"]) for m in req.messages)
            self._check_prompt_chars(num_chars, "messages")
            token_ids = await self._tokenize_in_lane(num_chars, apply_chat_template, req)
        elif isinstance(req.prompt, str):
            self._check_prompt_chars(len(req.prompt), "prompt")
            add_special_tokens = body.get("add_special_tokens", True)
            if not isinstance(add_special_tokens, bool):
                raise ProtocolError(400, "add_special_tokens: expected a boolean", "add_special_tokens")
            token_ids = await self._tokenize_in_lane(len(req.prompt), tokenize, req.prompt, add_special_tokens)
        else:
            token_ids = req.prompt
            self._check_token_ids(token_ids, "prompt")
        return web.json_response({"count": len(token_ids), "max_model_len": self.engine.max_model_len,
                                  "tokens": token_ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize {"tokens": [ids]} → {"prompt": text}."""
        with self._admit():
            return await self._detokenize_route(request)

    async def _detokenize_route(self, request: web.Request) -> web.Response:
        body = await self._read_body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(_is_token_id(t) for t in tokens):
            raise ProtocolError(400, "tokens: expected a list of token ids", "tokens")
        self._check_model(body.get("model"))
        self._check_token_ids(tokens, "tokens")
        text = await self._tokenize_in_lane(len(tokens), detokenize, tokens)
        return web.json_response({"prompt": text})

    # ------------------------------------------------------------------ the door

    @contextlib.contextmanager
    def _admit(self):
        """Count the request in flight from its first byte to its last; refuse it past the limit."""
        if self.num_in_flight >= self.max_in_flight:
            self.metrics.request_rejected.inc()
            raise ProtocolError(503, f"the server is at capacity ({self.max_in_flight} requests in flight); "
                                     f"retry later")
        self.num_in_flight += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1

    async def _read_body(self, request: web.Request) -> Any:
        """The JSON body (http_guard.read_body's limits), parsed off the event loop when large."""
        body = await read_body(request, self.config.body_timeout_s, self.max_body_bytes)
        if len(body) <= INLINE_PARSE_BYTES:
            return parse_json(body)
        return await asyncio.get_running_loop().run_in_executor(self._lanes["large"], parse_json, body)

    async def _parse(self, request: web.Request, schema: Any) -> Any:
        body = await self._read_body(request)
        req = schema.from_json(body)
        self._check_model(req.model)
        if req.kv_transfer_params is not None and not self._may_transfer_kv(request):
            raise ProtocolError(403, "kv_transfer_params are accepted only from the router", "kv_transfer_params")
        if req.resume is not None:
            # Whoever resumes a request puts words in the model's mouth under another request's name
            # (the router's stream recovery): the router's alone, like kv_transfer_params.
            if not self._may_transfer_kv(request):
                raise ProtocolError(403, "resume is accepted only from the router", "resume")
            if req.kv_transfer_params is not None:
                raise ProtocolError(400, "resume: a resumed request is computed here, without kv_transfer_params",
                                    "resume")
        return req

    def _check_token_ids(self, token_ids: list[int], param: str) -> None:
        if len(token_ids) > self.engine.max_model_len:
            raise ProtocolError(400, f"{param}: {len(token_ids)} tokens, more than the model's length "
                                     f"({self.engine.max_model_len})", param)
        vocab_size = getattr(self.engine, "vocab_size", None)
        if token_ids and vocab_size is not None and max(token_ids) >= vocab_size:
            raise ProtocolError(400, f"{param}: token id {max(token_ids)} is out of the vocabulary "
                                     f"(size {vocab_size})", param)

    def _check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Before tokenizing: a prompt far longer than the context would only keep a tokenizer busy."""
        if num_chars > self.max_prompt_chars:
            raise ProtocolError(400, f"{param}: {num_chars} characters, more than this server takes "
                                     f"({self.max_prompt_chars}, for a context of {self.engine.max_model_len} "
                                     f"tokens)", param)

    async def _tokenize_in_lane(self, size: int, fn: Any, *args: Any) -> Any:
        """fn(tokenizer, *args) on the small or the large lane's thread, with that thread's tokenizer."""
        self._require_tokenizer()
        lane = "small" if size <= SMALL_INPUT_CHARS else "large"
        return await asyncio.get_running_loop().run_in_executor(self._lanes[lane], self._in_lane, fn, args)

    def _in_lane(self, fn: Any, args: tuple) -> Any:
        tokenizer = getattr(self._lane_tokenizers, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._lane_tokenizers.tokenizer = copy.deepcopy(self.engine.tokenizer)
        return fn(tokenizer, *args)

    def _check_model(self, model: Any) -> None:
        if model is not None and not isinstance(model, str):
            raise ProtocolError(400, f"model: expected a string, got {type(model).__name__}", "model")
        if model is not None and model != self.engine.served_model_name:
            raise ProtocolError(404, f"the model {model!r} does not exist; this server serves "   # as OpenAI's
                                     f"{self.engine.served_model_name!r}", "model")

    def _require_tokenizer(self) -> Any:
        tokenizer = getattr(self.engine, "tokenizer", None)
        if tokenizer is None:
            raise ProtocolError(400, "this server has no tokenizer (dummy weights): only /v1/completions "
                                     "with a prompt of token ids is supported", "prompt")
        return tokenizer

    def _timeout_message(self) -> str:
        return f"the request did not finish within the server's limit of {self.config.request_timeout_s:g} s"

    def _with_token_ids(self, req: CompletionRequest | ChatCompletionRequest) -> bool:
        # Without a tokenizer (dummy weights) token ids are the only output there is to show.
        return req.return_token_ids or getattr(self.engine, "tokenizer", None) is None

    def _max_tokens(self, req: CompletionRequest | ChatCompletionRequest, prompt_token_ids: list[int]) -> int:
        """vLLM's rule: refuse what does not fit; an unset max_tokens fills the model's length."""
        num_prompt, max_model_len = len(prompt_token_ids), self.engine.max_model_len
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if num_prompt == 0:
            raise ProtocolError(400, "the prompt is empty after tokenization", param)
        vocab_size = getattr(self.engine, "vocab_size", None)
        if vocab_size is not None and max(prompt_token_ids) >= vocab_size:
            raise ProtocolError(400, f"token id {max(prompt_token_ids)} is out of the vocabulary "
                                     f"(size {vocab_size})", param)
        if num_prompt >= max_model_len:   # no room for even one generated token
            raise ProtocolError(400, f"this model's maximum context length is {max_model_len} tokens; "
                                     f"the prompt has {num_prompt} tokens", param)
        if req.max_tokens is None:
            return max_model_len - num_prompt
        if num_prompt + req.max_tokens > max_model_len:
            raise ProtocolError(400, f"this model's maximum context length is {max_model_len} tokens; you "
                                     f"requested {num_prompt + req.max_tokens} tokens ({num_prompt} in the "
                                     f"prompt, {req.max_tokens} in the completion)", "max_tokens")
        return req.max_tokens

    async def _generate(self, request: web.Request, req: CompletionRequest | ChatCompletionRequest,
                        prompt_token_ids: list[int], *, is_chat: bool) -> web.StreamResponse:
        params = req.to_sampling_params(self._max_tokens(req, prompt_token_ids))
        if (req.kv_transfer_params or {}).get("do_remote_decode") is True:
            # A prefill for a remote decode computes the prompt's KV and one token; the client's own
            # max_tokens (which the router passes on) was checked against the context just above, so a
            # request the decode instance would refuse is refused here, before the prefill is paid for.
            params.max_tokens = 1
        resumed = None
        if req.resume is not None:   # the router resumes a stream another instance began (see _parse)
            resumed = list(req.resume.token_ids)
            self._check_token_ids(resumed, "resume")
            if len(resumed) >= params.max_tokens:
                raise ProtocolError(400, f"resume: {len(resumed)} tokens already generated, max_tokens is "
                                         f"{params.max_tokens}", "resume")
        request_id = protocol.new_chat_completion_id() if is_chat else protocol.new_completion_id()
        try:
            generation = _Generation(self.engine, self.metrics, request_id, list(prompt_token_ids), params,
                                     req.kv_transfer_params, resumed)
        except ValueError as e:
            raise ProtocolError(400, str(e)) from None
        watcher = _watch_disconnect(request, generation)
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    first = await generation.next()
                    if not req.stream:
                        return await self._collect(req, generation, first, is_chat=is_chat)
            except TimeoutError:
                raise ProtocolError(504, self._timeout_message()) from None
            return await self._stream(request, req, generation, first, deadline, is_chat=is_chat)
        finally:
            if watcher is not None:
                watcher.cancel()
            await generation.close()

    async def _collect(self, req: CompletionRequest | ChatCompletionRequest, generation: _Generation,
                       output: RequestOutput, *, is_chat: bool) -> web.Response:
        texts, token_ids = [], []
        with_token_ids = self._with_token_ids(req)
        while True:
            if (message := error_message(output)) is not None:
                return json_error(500, message)
            texts.append(output.new_text)
            if with_token_ids:
                token_ids += output.new_token_ids
            if output.finished:
                break
            output = await generation.next()
        build = protocol.chat_response if is_chat else protocol.completion_response
        body = build(generation.request_id, self.engine.served_model_name, "".join(texts),
                     _finish_reason(output), _usage(output), kv_transfer_params=output.kv_transfer_params,
                     token_ids=token_ids if with_token_ids else None)
        return web.json_response(body)

    async def _stream(self, request: web.Request, req: CompletionRequest | ChatCompletionRequest,
                      generation: _Generation, output: RequestOutput, deadline: float, *,
                      is_chat: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        request_id, model, created = generation.request_id, self.engine.served_model_name, int(time.time())
        with_token_ids = self._with_token_ids(req)
        try:
            async with asyncio.timeout_at(deadline):
                if is_chat and req.resume is None:   # a resumed stream continues one that had its role chunk
                    await response.write(protocol.sse_event(protocol.chat_chunk(
                        request_id, model, created, {"role": "assistant", "content": ""})))
                while True:
                    if (message := error_message(output)) is not None:
                        await response.write(protocol.sse_event(protocol.error_body(message, status=500)))
                        break
                    finish_reason = _finish_reason(output)
                    token_ids = output.new_token_ids if with_token_ids else None
                    router_token_ids = output.new_token_ids if req.router_token_ids else None
                    if output.new_text or token_ids or router_token_ids or finish_reason is not None:
                        if is_chat:
                            delta = {"content": output.new_text} if output.new_text else {}
                            chunk = protocol.chat_chunk(request_id, model, created, delta, finish_reason, token_ids)
                        else:
                            chunk = protocol.completion_chunk(request_id, model, created, output.new_text,
                                                              finish_reason, token_ids)
                        if finish_reason is not None and output.kv_transfer_params is not None:
                            chunk["kv_transfer_params"] = output.kv_transfer_params
                        if router_token_ids:   # the last key: the router cuts it off the event's end
                            chunk["router_token_ids"] = router_token_ids
                        await response.write(protocol.sse_event(chunk))
                    if output.finished:
                        if req.include_usage:
                            await response.write(protocol.sse_event(protocol.usage_chunk(
                                request_id, model, created, _usage(output), chat=is_chat)))
                        break
                    output = await generation.next()
            await response.write(protocol.SSE_DONE)
            await response.write_eof()
        except TimeoutError:
            with contextlib.suppress(Exception):
                await response.write(protocol.sse_event(protocol.error_body(self._timeout_message(), status=504)))
                await response.write(protocol.SSE_DONE)
                await response.write_eof()
        except ConnectionError:   # the client went away mid-stream; _generate's finally aborts
            logger.debug("request %s: client disconnected", request_id)
        except Exception:   # noqa: BLE001 - headers are out: report in-band, then end the stream
            logger.exception("request %s: streaming failed", request_id)
            with contextlib.suppress(Exception):
                await response.write(protocol.sse_event(protocol.error_body("internal server error", status=500)))
                await response.write(protocol.SSE_DONE)
                await response.write_eof()
        return response


def _usage(output: RequestOutput) -> dict[str, Any]:
    return protocol.usage(output.num_prompt_tokens, output.num_output_tokens, output.num_cached_tokens)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def _events_after(values: list[str]) -> int | None:
    """The query's events_after: absent, or once as plain decimal digits (no sign, no spaces)."""
    if not values:
        return None
    if len(values) > 1:
        raise ProtocolError(400, "events_after: given more than once", "events_after")
    value = values[0]
    if not (value.isascii() and value.isdigit() and len(value) <= MAX_SEQ_DIGITS):
        raise ProtocolError(400, f"events_after: expected a non-negative integer, got {value[:40]!r}",
                            "events_after")
    return int(value)


def _engine_health(engine: Any) -> tuple[bool, str]:
    health = getattr(engine, "health", None)
    if health is not None:
        return health()
    return (True, "") if engine.is_healthy() else (False, "the engine process is not running")


def _watch_disconnect(request: web.Request, generation: _Generation) -> asyncio.Task | None:
    """Under a runner without handler_cancellation, cancel the handler when the client goes away."""
    manager = getattr(request.protocol, "_manager", None)   # aiohttp internals; fall back to watching
    if getattr(manager, "handler_cancellation", False):
        return None
    return asyncio.create_task(_cancel_when_gone(request, generation, asyncio.current_task()))


async def _cancel_when_gone(request: web.Request, generation: _Generation, handler: asyncio.Task) -> None:
    while not generation.is_done:
        await asyncio.sleep(DISCONNECT_POLL_S)
        transport = request.transport
        if not generation.is_done and (transport is None or transport.is_closing()):
            handler.cancel()
            return


SERVER_KEY = web.AppKey("pdserve_server", OpenAIServer)   # app[SERVER_KEY]: the handlers and their metrics


def build_app(engine: Any, config: ServerConfig | None = None) -> web.Application:
    """The aiohttp application. Run it with handler_cancellation=True (as start_server does) so a client
    that goes away aborts its request at once."""
    server = OpenAIServer(engine, config)
    quiet_malformed_requests()
    app = web.Application(middlewares=[server.middleware], client_max_size=server.max_body_bytes)
    for path, handler in (("/v1/completions", server.completions), ("/v1/chat/completions", server.chat_completions),
                          ("/tokenize", server.tokenize), ("/detokenize", server.detokenize),
                          ("/v1/kv/release", server.release_kv)):
        app.router.add_post(path, handler, expect_handler=expect_handler)
    for path, handler in (("/v1/models", server.models), ("/v1/models/{model:.+}", server.model),
                          ("/health", server.health),
                          ("/metrics", server.metrics_text), ("/v1/load", server.load)):
        app.router.add_get(path, handler, expect_handler=expect_handler)

    async def shutdown_lanes(app: web.Application) -> None:
        for lane in server._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(shutdown_lanes)
    app[SERVER_KEY] = server
    return app


async def start_server(engine: Any, host: str = "127.0.0.1", port: int = 0, config: ServerConfig | None = None,
                       *, access_log: bool = False) -> tuple[web.AppRunner, int]:
    """Start serving on the running loop; returns the runner (await runner.cleanup() to stop) and the
    bound port (useful with port=0)."""
    runner = web.AppRunner(build_app(engine, config), **runner_args(),
                           access_log=logging.getLogger("aiohttp.access") if access_log else None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = runner.addresses[0][1] if runner.addresses else port
    return runner, bound_port
