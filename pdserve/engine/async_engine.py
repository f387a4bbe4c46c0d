"""The engine core in its own process, and the asyncio front that the HTTP server talks to.

The server process never runs model compute: it sends ("add" | "abort" | "release_kv" | "shutdown") messages
down a pipe and receives per-step RequestOutput batches and stats snapshots back. A sender thread
and a receiver thread keep pipe I/O off the event loop, so a long engine step never stalls HTTP.

Engine process loop:
  1. drain incoming messages (wait up to 100 ms when idle, not at all when busy). A message that
     raises fails alone: an "add" answers its request with an error output (a ValueError's message
     names the field; anything else says "engine could not add the request: <type>"), an "abort" or
     "release_kv" is logged.
  2. step() while there is work: requests to compute, or KV transfers to advance. A step that raises
     fails its requests (and with async scheduling those of the step in flight) with FinishReason.ERROR
     and frees their blocks; the engine serves on (EngineCore.step, engine/engine_core.py).
  3. send the step's outputs, and a stats snapshot at least every 100 ms between steps (and when
     going idle)
  4. when steps keep failing (MAX_CONSECUTIVE_FAILED_STEPS in a row, none computing in between), send
     ("degraded", reason) and serve on; ("degraded", None) once a step computes again. Only a broken
     engine (its scheduler failed while failing a step, or the loop itself raised) sends ("broken",
     reason) and exits with code 1, for a supervisor to restart `pdserve serve`.

The front hears from the engine process at least every 100 ms while it is between steps; health()
is false, with the reason, when the process is dead, reported itself broken or degraded, or has been
silent for longer than stall_timeout_s (default 60 s: one CPU step of a long prefill can take seconds).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator
from typing import Any

from pdserve.config import EngineConfig
from pdserve.kv_transfer.base import KVTransferParams
from pdserve.outputs import FinishReason, RequestOutput
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.1
IDLE_WAIT_S = 0.1
TRANSFER_POLL_S = 0.001  # while only KV transfers are in flight
# Silence from the engine process past this means it is stuck inside one step (it reports at least
# every STATS_INTERVAL_S between steps). Generous: one CPU step of a long prefill can take seconds.
DEFAULT_STALL_TIMEOUT_S = 60.0


def _error_output(request_id: str, message: str, num_prompt_tokens: int = 0) -> RequestOutput:
    return RequestOutput(request_id, [], "", num_prompt_tokens, 0, FinishReason.ERROR, error=message)


def run_engine_process(config: EngineConfig, in_conn, out_conn) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    try:
        from pdserve.engine.engine_core import EngineCore
        core = EngineCore(config)
    except Exception as e:  # report why start-up failed instead of dying silently
        out_conn.send(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    out_conn.send(("ready", {"max_model_len": core.max_model_len, "engine_id": core.engine_id,
                             "vocab_size": core.runner.info.vocab_size,
                             "num_blocks": core.runner.num_blocks}))
    broken = None
    try:
        broken = _engine_loop(core, in_conn, out_conn)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except Exception as e:  # a bug outside any one request: report it rather than vanish
        logger.exception("engine loop failed")
        broken = f"engine loop failed: {type(e).__name__}: {e}"
    try:
        if broken is not None:
            try:
                out_conn.send(("broken", broken))
            except (EOFError, BrokenPipeError, OSError):
                pass
    finally:
        core.shutdown()
    if broken is not None:
        raise SystemExit(1)


def _engine_loop(core, in_conn, out_conn) -> str | None:
    """Serve until told to shut down (returns None) or until the engine is broken (returns why)."""
    last_stats = 0.0
    was_busy = False
    degraded = None   # as last reported to the front
    while True:
        busy = core.has_work()
        timeout = 0.0 if busy else IDLE_WAIT_S
        while in_conn.poll(timeout):
            timeout = 0.0
            msg = in_conn.recv()
            if msg[0] == "shutdown":
                return None
            _handle_message(core, msg, out_conn)
        if core.has_work():
            outputs = core.step()  # a failed step comes back as its requests' error outputs
            if outputs:
                out_conn.send(("outputs", outputs))
            elif core.last_step_was_empty:
                # Only transfers in flight: poll them without spinning a core.
                in_conn.poll(TRANSFER_POLL_S)
            if core.broken is not None:
                return core.broken
            if core.degraded != degraded:
                degraded = core.degraded
                out_conn.send(("degraded", degraded))
        now = time.monotonic()
        busy = core.has_work()
        if now - last_stats >= STATS_INTERVAL_S or (was_busy and not busy):
            out_conn.send(("stats", core.stats()))
            last_stats = now
        was_busy = busy


def _handle_message(core, msg: tuple, out_conn) -> None:
    """Apply one message from the front; whatever it raises fails that message alone."""
    kind = msg[0]
    try:
        if kind == "add":
            _, request_id, prompt_token_ids, params, kv_params, resumed_token_ids = msg
            core.add_request(request_id, prompt_token_ids, params, kv_params, resumed_token_ids)
        elif kind == "abort":
            core.abort(msg[1])
        elif kind == "release_kv":
            core.release_kv(msg[1])
        else:
            logger.error("unknown message %r from the front", kind)
    except Exception as e:
        if kind != "add":
            logger.exception("%s failed", kind)
            return
        if isinstance(e, ValueError):  # what the engine cannot run: the message names the field
            message = str(e)
        else:
            logger.exception("add_request failed")
            message = f"engine could not add the request: {type(e).__name__}"
        try:
            num_prompt_tokens = len(msg[2])
        except Exception:
            num_prompt_tokens = 0
        out_conn.send(("outputs", [_error_output(msg[1], message, num_prompt_tokens)]))


class AsyncEngine:
    """The handle the HTTP server holds: generate(), abort(), stats(), health(), is_healthy()."""

    def __init__(self, config: EngineConfig, served_model_name: str | None = None,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        if isinstance(stall_timeout_s, bool) or not isinstance(stall_timeout_s, (int, float)) \
                or not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s: must be > 0 seconds, got {stall_timeout_s!r}")
        self.stall_timeout_s = float(stall_timeout_s)
        self.config = config
        self.served_model_name = served_model_name or config.model.served_model_name or config.model.model
        self.tokenizer = None
        self.max_model_len = 0
        self.vocab_size: int | None = None
        self.engine_id: str | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats: dict[str, Any] = {}
        self._outbox: queue.Queue = queue.Queue()
        self._dead: str | None = None
        self._broken: str | None = None        # the engine process reported itself broken: why
        self._degraded: str | None = None      # steps keep failing (it serves on): why
        self._last_heard: float | None = None  # time.monotonic() of the last message from it
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.process: mp.process.BaseProcess | None = None

    async def start(self) -> None:
        from pdserve.model.loader import load_tokenizer, resolve_model_path
        self._loop = asyncio.get_running_loop()
        path = resolve_model_path(self.config.model.model)
        ctx = mp.get_context("spawn")
        in_recv, self._in_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=run_engine_process, args=(self.config, in_recv, out_send),
                                   daemon=True, name="pdserve-engine")
        self.process.start()
        in_recv.close()
        out_send.close()
        self.tokenizer = await asyncio.to_thread(load_tokenizer, path)
        kind, payload = await asyncio.to_thread(self._out_recv.recv)
        if kind != "ready":
            self.process.join(5)
            raise RuntimeError(f"engine failed to start: {payload}")
        self._last_heard = time.monotonic()
        self.max_model_len = payload["max_model_len"]
        self.vocab_size = payload["vocab_size"]
        self.engine_id = payload["engine_id"]
        threading.Thread(target=self._receive_loop, daemon=True, name="pdserve-engine-out").start()
        threading.Thread(target=self._send_loop, daemon=True, name="pdserve-engine-in").start()

    # -- pipe threads ------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            try:
                self._in_send.send(msg)
            except (BrokenPipeError, OSError):
                return
            if msg[0] == "shutdown":
                return

    def _receive_loop(self) -> None:
        while True:
            try:
                msg = self._out_recv.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self.process.join(5)  # off the event loop: the exit code, for the reason
                self._call_soon(self._engine_died)
                return
            # Here, not in _dispatch: a busy event loop must not make the engine look silent.
            self._last_heard = time.monotonic()
            self._call_soon(self._dispatch, msg)

    def _call_soon(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop has closed: nobody is left to tell
            pass

    def _dispatch(self, msg: tuple) -> None:
        kind, payload = msg
        if kind == "outputs":
            for out in payload:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
        elif kind == "stats":
            self._stats = payload
        elif kind == "broken":
            self._broken = f"engine broken: {payload}"
            logger.error(self._broken)
        elif kind == "degraded":
            self._degraded = None if payload is None else f"engine degraded: {payload}"

    def _engine_died(self) -> None:
        if self._stopping:
            return  # the pipe closing is the shutdown we asked for
        if self._dead is None:
            self._dead = self._broken or f"engine process exited (code {self.process.exitcode})"
            logger.error(self._dead)
        for request_id, q in self._queues.items():
            q.put_nowait(_error_output(request_id, self._dead))

    # -- API for the server ------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       kv_transfer_params: dict | None = None,
                       resumed_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """resumed_token_ids: see EngineCore.add_request (the router's stream recovery)."""
        refusal = self._dead or self._broken
        if refusal is not None:
            yield _error_output(request_id, refusal, len(prompt_token_ids))
            return
        if request_id in self._queues:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        KVTransferParams.from_dict(kv_transfer_params)  # malformed: a 400 for the client, not a dead engine
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._outbox.put(("add", request_id, list(prompt_token_ids), params, kv_transfer_params,
                          list(resumed_token_ids or ())))
        finished = False
        try:
            while not finished:
                out = await q.get()
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the caller went away: free the request's blocks
                self._outbox.put(("abort", [request_id]))

    async def abort(self, request_id: str) -> None:
        self._outbox.put(("abort", [request_id]))

    def release_kv(self, kv_transfer_params: dict) -> None:
        """P: free the blocks held for the request these params (this engine's answer) name, which no
        D will read. ValueError when they are malformed or name another engine."""
        params = KVTransferParams.from_dict(kv_transfer_params)
        if params is None or params.remote_request_id is None:
            raise ValueError("kv_transfer_params: remote_request_id is missing")
        if params.remote_engine_id != self.engine_id:
            raise LookupError(f"these KV blocks are not held here (engine {self.engine_id!r})")
        self._outbox.put(("release_kv", [params.remote_request_id]))

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def health(self) -> tuple[bool, str]:
        """(True, "ok"), or (False, why): the engine process is not started, reported itself broken
        (a fault that outlived its requests), has exited, or has been silent for longer than
        stall_timeout_s (stuck in a step). A stall clears when the process speaks again."""
        if self.process is None or self._last_heard is None:
            return False, "engine not started"
        if self._broken is not None:
            return False, self._broken
        if self._degraded is not None:
            return False, self._degraded
        if not self.process.is_alive():
            return False, f"engine process exited (code {self.process.exitcode})"
        if self._dead is not None:
            return False, self._dead
        silent = time.monotonic() - self._last_heard
        if silent > self.stall_timeout_s:
            return False, (f"engine stalled: no word from the engine process for {silent:.1f} s "
                           f"(bound {self.stall_timeout_s:g} s)")
        return True, "ok"

    def is_healthy(self) -> bool:
        return self.health()[0]

    def is_running(self) -> bool:
        """The engine process is alive: `pdserve serve` lives as long as it does. A degraded or
        stalled engine is unhealthy (/health says why) but may recover, so it is not a reason to exit."""
        return self.process is not None and self.process.is_alive()

    async def shutdown(self) -> None:
        if self.process is None:
            return
        self._stopping = True
        self._outbox.put(("shutdown",))
        await asyncio.to_thread(self.process.join, 10)
        if self.process.is_alive():
            self.process.terminate()
