"""The engine core in its own process, and the asyncio front that the HTTP server talks to.

The server process never runs model compute: it sends ("add" | "abort" | "release_kv" | "shutdown") messages
down a pipe and receives per-step RequestOutput batches and stats snapshots back. A sender thread
and a receiver thread keep pipe I/O off the event loop, so a long engine step never stalls HTTP.

Engine process loop:
  1. drain incoming messages (wait up to 100 ms when idle, not at all when busy)
  2. step() while there is work: requests to compute, or KV transfers to advance
  3. send the step's outputs, and a stats snapshot at most every 100 ms (and when going idle)
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
    last_stats = 0.0
    was_busy = False
    try:
        while True:
            busy = core.has_work()
            timeout = 0.0 if busy else IDLE_WAIT_S
            while in_conn.poll(timeout):
                timeout = 0.0
                msg = in_conn.recv()
                if msg[0] == "add":
                    _, request_id, prompt_token_ids, params, kv_params = msg
                    try:
                        core.add_request(request_id, prompt_token_ids, params, kv_params)
                    except ValueError as e:
                        out_conn.send(("outputs", [_error_output(request_id, str(e), len(prompt_token_ids))]))
                elif msg[0] == "abort":
                    core.abort(msg[1])
                elif msg[0] == "release_kv":
                    core.release_kv(msg[1])
                elif msg[0] == "shutdown":
                    return
            if core.has_work():
                outputs = core.step()
                if outputs:
                    out_conn.send(("outputs", outputs))
                elif core.last_step_was_empty:
                    # Only transfers in flight: poll them without spinning a core.
                    in_conn.poll(TRANSFER_POLL_S)
            now = time.monotonic()
            busy = core.has_work()
            if now - last_stats >= STATS_INTERVAL_S or (was_busy and not busy):
                out_conn.send(("stats", core.stats()))
                last_stats = now
            was_busy = busy
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        core.shutdown()


class AsyncEngine:
    """The handle the HTTP server holds: generate(), abort(), stats(), is_healthy()."""

    def __init__(self, config: EngineConfig, served_model_name: str | None = None) -> None:
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
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

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
                self._loop.call_soon_threadsafe(self._engine_died)
                return
            self._loop.call_soon_threadsafe(self._dispatch, msg)

    def _dispatch(self, msg: tuple) -> None:
        kind, payload = msg
        if kind == "outputs":
            for out in payload:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
        elif kind == "stats":
            self._stats = payload

    def _engine_died(self) -> None:
        if self._stopping:
            return  # the pipe closing is the shutdown we asked for
        if self._dead is None:
            self._dead = f"engine process exited (code {self.process.exitcode})"
            logger.error(self._dead)
        for request_id, q in self._queues.items():
            q.put_nowait(_error_output(request_id, self._dead))

    # -- API for the server ------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            yield _error_output(request_id, self._dead, len(prompt_token_ids))
            return
        if request_id in self._queues:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        KVTransferParams.from_dict(kv_transfer_params)  # malformed: a 400 for the client, not a dead engine
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._outbox.put(("add", request_id, list(prompt_token_ids), params, kv_transfer_params))
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

    def is_healthy(self) -> bool:
        return self._dead is None and self.process.is_alive()

    async def shutdown(self) -> None:
        self._stopping = True
        self._outbox.put(("shutdown",))
        await asyncio.to_thread(self.process.join, 10)
        if self.process.is_alive():
            self.process.terminate()
