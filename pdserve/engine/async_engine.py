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
     going idle) carrying the prefix cache's KV events since the last one, which the front numbers
     for the router's GET /v1/load (KVEventLog)
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
import atexit
import ctypes
import glob
import itertools
import logging
import multiprocessing as mp
import os
import queue
import secrets
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

from pdserve.config import EngineConfig
from pdserve.core.block_pool import REMOVED, SNAPSHOT, STORED
from pdserve.kv_transfer.base import KVTransferParams
from pdserve.outputs import FinishReason, RequestOutput
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1

STATS_INTERVAL_S = 0.1
IDLE_WAIT_S = 0.1
TRANSFER_POLL_S = 0.001  # while only KV transfers are in flight
# Silence from the engine process past this means it is stuck inside one step (it reports at least
# every STATS_INTERVAL_S between steps). Generous: one CPU step of a long prefill can take seconds.
DEFAULT_STALL_TIMEOUT_S = 60.0
# KV event hashes the front keeps for the router (docs/router.md): a router that polls within this
# many changes reads only what changed, one further behind reads the whole set once.
KV_EVENT_RING_HASHES = 100_000
# The engine's stats that GET /v1/load carries, in docs/router.md's order.
LOAD_REPORT_STATS = ("block_size", "hash_extra", "num_blocks", "num_free_blocks", "kv_bytes_per_token",
                     "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_requests_running",
                     "num_requests_waiting", "num_requests_waiting_for_remote_kvs", "num_prefill_tokens_waiting",
                     "num_blocks_held_for_transfer", "num_prompt_tokens_computed_total", "num_output_tokens_total",
                     "busy_seconds_total", "kv_transfer_bytes_total", "kv_transfer_seconds_total")


def _error_output(request_id: str, message: str, num_prompt_tokens: int = 0) -> RequestOutput:
    return RequestOutput(request_id, [], "", num_prompt_tokens, 0, FinishReason.ERROR, error=message)


# An engine process that has not stopped this long after being asked is stuck in a step. `pdserve up`
# gives an instance cluster.STOP_TIMEOUT_S between SIGTERM and SIGKILL, which must cover the drain
# (config.ServerConfig.drain_timeout_s) plus this plus the kills.
SHUTDOWN_TIMEOUT_S = 5.0


def _tp_ranks_of(pid: int) -> list[int]:
    """The tensor-parallel rank processes (worker/tp_executor.py) the engine process `pid` started."""
    ranks = []
    for children in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            pids = [int(c) for c in open(children).read().split()]
        except (OSError, ValueError):
            continue
        for child in pids:
            try:
                cmdline = open(f"/proc/{child}/cmdline", "rb").read()
            except OSError:
                continue
            if b"pdserve.worker.tp_executor" in cmdline:
                ranks.append(child)
    return ranks


def _die_with_parent() -> None:
    """SIGKILL this engine process when its server dies, however it dies (a SIGTERM while the model loads
    ends the server before its exit hook is set; the engine, which ignores SIGTERM, kept loading with no
    parent, and under `pdserve up` re-created the core-lending file `up` had removed)."""
    parent = mp.parent_process()
    if not sys.platform.startswith("linux") or parent is None:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent.pid:   # it died before the prctl
        os._exit(1)


def _kill_at_exit(process: mp.process.BaseProcess) -> None:
    if process.is_alive():
        process.kill()
        process.join(5)


def run_engine_process(config: EngineConfig, in_conn, out_conn) -> None:
    # The server that started this process stops it (a message, or the pipe's end when the server dies).
    # A Ctrl-C at the terminal, or a SIGTERM to the whole process group or service (systemd's default),
    # reaches this process too: ending here would cut the requests the server is draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    try:
        from pdserve.engine.engine_core import EngineCore
        core = EngineCore(config)
        core.enable_kv_events()
    except Exception as e:  # report why start-up failed instead of dying silently
        if isinstance(e, (ValueError, FileNotFoundError)):   # most likely the user's to fix: one line
            logger.debug("engine start-up failed", exc_info=True)
        else:
            logger.exception("engine start-up failed")
        out_conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    # The first stats ride with "ready": a load report is whole from the start.
    out_conn.send(("ready", {"max_model_len": core.max_model_len, "engine_id": core.engine_id,
                             "kv_side_channel": core.kv_side_channel(),
                             "vocab_size": core.runner.info.vocab_size,
                             "num_blocks": core.runner.num_blocks, "stats": core.stats()}))
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
        if not busy:
            if not core.has_work():   # `busy` was read before the messages: a request may have come since
                core.idle()
            core.check_ranks()
            if core.broken is not None:
                return core.broken
        now = time.monotonic()
        busy = core.has_work()
        if now - last_stats >= STATS_INTERVAL_S or (was_busy and not busy):
            _send_stats(core, out_conn)
            last_stats = now
        was_busy = busy


def _send_stats(core, out_conn) -> None:
    """A stats snapshot with the KV events taken since the last one: taken and sent together, so that
    no event falls between two messages."""
    stats = core.stats()
    stats["kv_events"] = core.take_kv_events()
    out_conn.send(("stats", stats))


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


class KVEventLog:
    """The engine's KV events as numbered batches for the router's polls, and the hashes cached now.

    Each batch of stored or removed hashes gets the next seq (1, 2, ...). The ring keeps the newest
    batches, up to max_hashes hashes, so batches floor+1 .. last_seq are always in it: a reader that has
    applied up to events_after in [floor, last_seq] gets the batches after it. Any other reader (no
    events_after, one older than the ring or newer than last_seq: another boot's) gets a reset: every
    hash cached as of last_seq, and no batches. A snapshot from the engine (its queue overflowed: events
    were lost) replaces the set and starts an empty ring at a new seq, so every reader resets."""

    def __init__(self, max_hashes: int = KV_EVENT_RING_HASHES) -> None:
        self.max_hashes = max_hashes
        self.last_seq = 0
        self.floor = 0
        self.cached: set[int] = set()
        self._ring: deque[list] = deque()   # [seq, kind, hashes], seqs floor+1 .. last_seq
        self._num_hashes = 0

    def apply(self, events: Iterable[tuple[str, list[int]]]) -> None:
        """The engine's events (BlockPool.take_events), oldest first."""
        for kind, hashes in events:
            if kind == SNAPSHOT:
                self._replace(hashes)
            elif kind in (STORED, REMOVED) and hashes:
                self._append(kind, hashes)
            elif kind not in (STORED, REMOVED):
                logger.error("unknown KV event %r from the engine", kind)

    def _append(self, kind: str, hashes: list[int]) -> None:
        if kind == STORED:
            self.cached.update(hashes)
        else:
            self.cached.difference_update(hashes)
        self.last_seq += 1
        self._ring.append([self.last_seq, kind, hashes])
        self._num_hashes += len(hashes)
        while self._num_hashes > self.max_hashes and len(self._ring) > 1:  # the newest batch always stays
            seq, _, dropped = self._ring.popleft()
            self._num_hashes -= len(dropped)
            self.floor = seq

    def _replace(self, hashes: list[int]) -> None:
        self.cached = set(hashes)
        self._ring.clear()
        self._num_hashes = 0
        self.last_seq += 1
        self.floor = self.last_seq

    def report(self, events_after: int | None) -> dict[str, Any]:
        """docs/router.md's `kv_events`. Its batches are the ring's own lists: serialise, do not keep."""
        if events_after is None or not self.floor <= events_after <= self.last_seq:
            return {"last_seq": self.last_seq, "reset": True, "snapshot": sorted(self.cached), "batches": []}
        batches = list(itertools.islice(self._ring, events_after - self.floor, None))
        return {"last_seq": self.last_seq, "reset": False, "snapshot": None, "batches": batches}


class AsyncEngine:
    """The handle the HTTP server holds: generate(), abort(), stats(), health(), is_healthy(),
    load_report()."""

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
        self.kv_side_channel: dict[str, Any] | None = None  # {host, port, boot_id} of the connector's side channel
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats: dict[str, Any] = {}
        # A router that sees another boot_id forgets what it knew of this instance's cache.
        self.boot_id = secrets.token_hex(8)
        self._kv_events = KVEventLog()
        self._outbox: queue.Queue = queue.Queue()
        self._dead: str | None = None
        self._broken: str | None = None        # the engine process reported itself broken: why
        self._draining: str | None = None      # shutting down: new requests are refused with this
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
        # The engine ignores SIGTERM (run_engine_process), and multiprocessing ends a daemon child at exit with
        # SIGTERM and an unbounded join: a server that fails after this point (its port taken, Ctrl-C while
        # the model loads) would never exit. Registered after multiprocessing's hook, so it runs first.
        atexit.register(_kill_at_exit, self.process)
        in_recv.close()
        out_send.close()
        try:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, path)
            kind, payload = await asyncio.to_thread(self._out_recv.recv)
        except BaseException:
            # Ctrl-C while the model loads: the thread waiting for "ready" (which asyncio.run waits for)
            # and the engine, which ignores SIGINT, would both run on until the load ended.
            _kill_at_exit(self.process)
            raise
        if kind != "ready":
            self.process.join(5)
            raise RuntimeError(f"engine failed to start: {payload}")
        self._last_heard = time.monotonic()
        self.max_model_len = payload["max_model_len"]
        self.vocab_size = payload["vocab_size"]
        self.engine_id = payload["engine_id"]
        self.kv_side_channel = payload.get("kv_side_channel")
        self._stats = payload.get("stats") or {}
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
            self._kv_events.apply(payload.pop("kv_events", ()))
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
        refusal = self._dead or self._broken or self._draining
        if refusal is not None:
            yield _error_output(request_id, refusal, len(prompt_token_ids))
            return
        if request_id in self._queues:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        parsed = KVTransferParams.from_dict(kv_transfer_params)  # malformed: a 400 for the client, not a dead engine
        first = parsed.first_token_ids if parsed is not None else None
        if first and self.vocab_size is not None and max(first) >= self.vocab_size:
            raise ValueError(f"kv_transfer_params: first_token_ids must be in [0, {self.vocab_size})")
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

    @property
    def kv_role(self) -> str | None:
        """producer, consumer or both; None without a KV connector (colocated)."""
        kv_transfer = self.config.kv_transfer
        return kv_transfer.kv_role if kv_transfer.kv_connector else None

    def load_report(self, events_after: int | None = None) -> dict[str, Any]:
        """GET /v1/load's body (docs/router.md): what the engine last reported, and the KV event batches
        after seq events_after (None: a reset with the whole set). Only reads what is already here."""
        healthy, health = self.health()
        report: dict[str, Any] = {"boot_id": self.boot_id, "kv_role": self.kv_role, "healthy": healthy,
                                  "health": health}
        if self.config.kv_transfer.kv_connector and self.engine_id is not None:
            # how it hands KV over (the router pairs only instances of one handoff), and where its side
            # channel is, where it has one (the push handoff: the router hands P's to D)
            report["kv_connector"] = {"name": self.config.kv_transfer.kv_connector, "engine_id": self.engine_id,
                                      "tp_size": self.config.parallel.tensor_parallel_size,
                                      **(self.kv_side_channel or {})}
        report.update((name, self._stats.get(name)) for name in LOAD_REPORT_STATS)
        report["kv_events"] = self._kv_events.report(events_after)
        return report

    def health(self) -> tuple[bool, str]:
        """(True, "ok"), or (False, why): the engine process is not started, reported itself broken
        (a fault that outlived its requests), has exited, or has been silent for longer than
        stall_timeout_s (stuck in a step). A stall clears when the process speaks again."""
        if self.process is None or self._last_heard is None:
            return False, "engine not started"
        if self._broken is not None:
            return False, self._broken
        if self._draining is not None:
            return False, self._draining
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

    @property
    def draining(self) -> str | None:
        """Why new requests are refused while the server shuts down, or None."""
        return self._draining

    async def drain(self, timeout_s: float, reason: str) -> int:
        """Refuse new requests, wait up to timeout_s for those in flight to finish, then end the rest with
        an error output carrying `reason` (each also aborted in the engine). Returns how many were ended."""
        self._draining = reason
        deadline = time.monotonic() + timeout_s

        def busy() -> bool:
            # a P's requests end at their first token, but D may still be reading their KV: wait for that too
            return bool(self._queues) or bool(self._stats.get("num_blocks_held_for_transfer"))
        while busy() and time.monotonic() < deadline and self.process is not None and self.process.is_alive():
            await asyncio.sleep(0.05)
        unfinished = list(self._queues.items())
        for request_id, q in unfinished:
            q.put_nowait(_error_output(request_id, f"{reason}: the request did not finish within the "
                                                   f"{timeout_s:g} s drain"))
        if unfinished:
            self._outbox.put(("abort", [request_id for request_id, _ in unfinished]))
        await asyncio.sleep(0)   # let the handlers take their error outputs before the server closes
        return len(unfinished)

    async def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Ask the engine process to stop; past timeout_s (stuck in a step whose collective waits on a
        stopped tensor-parallel rank, say) kill it and its ranks."""
        if self.process is None:
            return
        self._stopping = True
        self._outbox.put(("shutdown",))
        await asyncio.to_thread(self.process.join, timeout_s)
        if self.process.is_alive():
            # Its ranks end when they see it gone, but a stopped one sees nothing: they are killed by pid,
            # first, while the engine process is alive and so has not reaped them (their pids not reused).
            for pid in _tp_ranks_of(self.process.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            self.process.kill()   # not SIGTERM: the engine process ignores it (run_engine_process)
            await asyncio.to_thread(self.process.join, 2)
