"""The worker half of every pull transport: P's leases, D's request queue, the side channel.

A transport (nixl.py, cuda_ipc.py) subclasses PullConnectorWorker and fills a few hooks; this
module owns the lifecycle they share, so a lease, a cancel or a failed handshake behaves the same
over every transport. KV layout (model/attention.py): one contiguous tensor
[num_blocks, num_layers, 2, block_size, heads, dim], so block b is the byte range
[b * block_bytes, (b + 1) * block_bytes) and a run of consecutive block ids on BOTH sides is one
descriptor (one NIXL descriptor, one copy).

Threads: the engine thread makes every transport call. The side-channel server thread (P) only
reads cached handshake data and touches lease state under self._lock; a small client pool (D) does
the blocking TCP work: handshakes, heartbeats, releases, read-done notices.

On P (producer), per request:
  1. start_load_kv: a SendSpec arrives → hold its blocks, deadline = now + lease_seconds
  2. side channel: a D handshakes once per engine (compat hash → region + what the transport needs
     to reach P's memory); heartbeats push deadlines to now + lease_seconds; a release or a "done"
     means D no longer needs the blocks
  3. get_finished → finished_sending: D's read-done notice (a transport notification or a "done"
     message, either carrying P's request id), a release, or an expired lease
     (kv_lease_expirations_total, warning); the scheduler then frees the blocks

On D (consumer), per request:
  1. start_load_kv: a RecvSpec arrives → if the remote engine is known, post the READ now; else
     queue it behind a background handshake with that engine (one per engine, result cached)
  2. the handshake completes (seen in get_finished): _connect on the engine thread, then post the
     queued READs as coalesced runs; a failed handshake or connect fails every request queued for it
  3. get_finished polls each READ without blocking: DONE → finished_recving (+ bytes, descriptors,
     seconds) and, for transports without their own notification, a "done" to P; ERR →
     finished_recving + its local blocks in get_block_ids_with_load_errors() + get_load_error();
     heartbeats go out every heartbeat_seconds for requests waiting (for the handshake or the READ,
     and, from reqs_to_keep_alive, for requests still queued in D's scheduler); reqs_to_release:
     a queued request that will not load (finished, aborted, covered by D's prefix cache) → a
     release to P
  4. reqs_to_cancel: not posted yet → dropped, release sent to P; in flight → left to finish;
     either way reported in finished_recving exactly once (an id this half never saw: at once)

Hooks a transport fills (engine thread, except where said):
  _register(kv_cache) → (handshake fields, handshake blob)   once, at start-up
  _connect(remote)         after a handshake: make P's memory reachable; raise to fail its requests
  _post(recv, remote, runs) → (handle, "PROC" | "DONE" | "ERR")   start one request's READ
  _check(handle) → "PROC" | "DONE" | "ERR";  _release(handle)
  _take_notifs() → P's request ids whose READ the transport itself reported done (P side)
  _send_done(engine_id, host, port, request_ids)   D side, with notifies_done (default: side channel)
  _disconnect(remote), _deregister()   at shutdown
  notifies_done: False when the transport tells P itself (NIXL notif); True: D sends "done"

Fault injection, for tests only: config.extra["inject_read_failure"] = "all" (every READ is done,
then reported failed with all its blocks) or "last_block" (done; its last local block reported
invalid). It is read in one place: _invalid_blocks.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.base import KVConnectorWorker
from pdserve.kv_transfer.pull import KeepAliveSpec, PullConnectorMeta, RecvSpec, track_keep_alives

logger = logging.getLogger(__name__)

INJECT_READ_FAILURE_MODES = (None, "all", "last_block")
LOAD_ERROR_TTL_S = 60.0
# kv_transfer_seconds upper bounds (the +Inf bucket is `count`)
TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def compat_hash(compat: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(compat, sort_keys=True).encode()).hexdigest()


def coalesce(local_block_ids: list[int], remote_block_ids: list[int]) -> list[tuple[int, int, int]]:
    """[(local_start, remote_start, num_blocks)]: one run per stretch consecutive on both sides.
    It runs inside the handoff's time (D posts after it): vectorized past a few blocks."""
    num_blocks = min(len(local_block_ids), len(remote_block_ids))
    if num_blocks and all(ids[:num_blocks] == list(range(ids[0], ids[0] + num_blocks))
                          for ids in (local_block_ids, remote_block_ids)):
        return [(local_block_ids[0], remote_block_ids[0], num_blocks)]  # the common case: one run
    if num_blocks > 16:
        local = np.asarray(local_block_ids[:num_blocks], dtype=np.int64)
        remote = np.asarray(remote_block_ids[:num_blocks], dtype=np.int64)
        breaks = np.flatnonzero((np.diff(local) != 1) | (np.diff(remote) != 1)) + 1  # a run starts after each
        starts = np.concatenate(([0], breaks))
        lengths = np.diff(np.concatenate((starts, [num_blocks])))
        return list(zip(local[starts].tolist(), remote[starts].tolist(), lengths.tolist()))
    runs: list[tuple[int, int, int]] = []
    for local_id, remote_id in zip(local_block_ids, remote_block_ids):
        if runs and local_id == runs[-1][0] + runs[-1][2] and remote_id == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((local_id, remote_id, 1))
    return runs


def check_inject_read_failure(config: KVTransferConfig) -> None:
    mode = config.extra.get("inject_read_failure")
    if mode not in INJECT_READ_FAILURE_MODES:
        raise ValueError(f"inject_read_failure: expected one of {INJECT_READ_FAILURE_MODES}, got {mode!r}")


@dataclass(frozen=True)
class _Region:
    """One engine's registered KV cache, as the handshake describes it."""
    base_addr: int
    num_blocks: int
    block_bytes: int
    mem_type: str   # DRAM | VRAM
    device_id: int


@dataclass
class _RemoteEngine:
    engine_id: str
    region: _Region
    reply: dict[str, Any]   # the handshake reply: transport fields beside the region
    blob: bytes             # the handshake blob (NIXL: agent metadata)
    conn: Any = None        # what _connect made of them (NIXL: agent name; IPC: P's cache mapped here)


@dataclass
class _Recv:
    spec: RecvSpec
    is_posted: bool = False
    handle: Any = None            # the transport's handle once posted
    posted_at: float = 0.0
    num_bytes: int = 0
    num_descriptors: int = 0


@dataclass
class _Held:
    block_ids: list[int]
    deadline: float


@dataclass
class _Histogram:
    buckets: tuple[float, ...] = TRANSFER_SECONDS_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * len(TRANSFER_SECONDS_BUCKETS))
    sum: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        for i in range(bisect.bisect_left(self.buckets, value), len(self.buckets)):
            self.counts[i] += 1  # cumulative, as Prometheus wants
        self.sum += value
        self.count += 1

    def to_dict(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum, "count": self.count}


class PullConnectorWorker(KVConnectorWorker):
    """The pull lifecycle over an abstract transport; see the module docstring for the hooks."""

    notifies_done = False

    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, str | int]) -> None:
        check_inject_read_failure(config)
        self._inject_read_failure = config.extra.get("inject_read_failure")
        self.config = config
        self.engine_id = engine_id
        self.compat = dict(compat)
        self.compat_hash = compat_hash(self.compat)
        self._region: _Region | None = None
        self._kv_cache: torch.Tensor | None = None
        self._handshake_fields: dict[str, Any] = {}
        self._handshake_blob = b""
        self._lock = threading.Lock()  # guards _held, _released, _early_done, _expired, _lost (other threads)
        # P: lease state
        self._held: dict[str, _Held] = {}
        self._released: set[str] = set()
        self._early_done: dict[str, float] = {}  # done/release seen before its SendSpec
        self._expired: dict[str, float] = {}     # leases that ran out, for heartbeat replies: when
        # D: request state
        self._recvs: dict[str, _Recv] = {}
        self._kept_alive: dict[str, KeepAliveSpec] = {}  # queued on this engine, no load yet
        self._queued: dict[str, list[str]] = {}  # remote engine id → request ids awaiting handshake
        self._handshakes: dict[str, Future] = {}
        self._remotes: dict[str, _RemoteEngine] = {}
        self._finished_recving: set[str] = set()
        self._done_to_send: dict[tuple[str, str, int], list[str]] = {}  # (P, host, port) → P's request ids
        self._error_blocks: set[int] = set()
        self._load_errors: dict[str, tuple[str, float]] = {}  # request id → (error, when)
        # (P host, port, P's request id) whose lease P reports expired (client pool thread; the lock)
        self._lost: set[tuple[str, int, str]] = set()
        self._next_heartbeat = 0.0
        self._is_shut_down = False
        # stats
        self._num_bytes = self._num_descriptors = self._num_failures = self._num_lease_expirations = 0
        self._transfer_seconds = _Histogram()
        self._client = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"pdserve-kv-client-{engine_id}")
        self._server = side_channel.SideChannelServer(config.side_channel_host, config.side_channel_port, {
            "handshake": self._on_handshake, "heartbeat": self._on_heartbeat,
            "release": self._on_release, "done": self._on_release}, key=config.auth_key)
        self.side_channel_port = self._server.port

    # ---- transport hooks ------------------------------------------------------------------------

    def _register(self, kv_cache: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        raise NotImplementedError

    def _connect(self, remote: _RemoteEngine) -> None:
        raise NotImplementedError

    def _post(self, recv: _Recv, remote: _RemoteEngine, runs: list[tuple[int, int, int]]) -> tuple[Any, str]:
        raise NotImplementedError

    def _check(self, handle: Any) -> str:
        raise NotImplementedError

    def _release(self, handle: Any) -> None:
        pass

    def _take_notifs(self) -> list[str]:
        return []

    def _disconnect(self, remote: _RemoteEngine) -> None:
        pass

    def _deregister(self) -> None:
        pass

    # ---- start-up ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        kv_cache = kv_caches[0] if isinstance(kv_caches, (list, tuple)) and len(kv_caches) == 1 else kv_caches
        if not isinstance(kv_cache, torch.Tensor) or not kv_cache.is_contiguous():
            raise ValueError("register_kv_caches: expected one contiguous tensor "
                             "[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]")
        block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self._kv_cache = kv_cache  # registered memory must outlive its registration
        fields, blob = self._register(kv_cache)  # may move a CPU cache into shared memory: address after
        device_id = kv_cache.device.index if kv_cache.is_cuda else 0
        self._region = _Region(kv_cache.data_ptr(), kv_cache.shape[0], block_bytes,
                               "VRAM" if kv_cache.is_cuda else "DRAM", device_id or 0)
        self._handshake_fields, self._handshake_blob = fields, blob

    # ---- each step ----------------------------------------------------------------------------

    def start_load_kv(self, meta: PullConnectorMeta) -> None:
        now = time.monotonic()
        for send in meta.reqs_to_send:
            with self._lock:
                self._held[send.request_id] = _Held(list(send.block_ids), now + self.config.lease_seconds)
                if self._early_done.pop(send.request_id, None) is not None:
                    self._released.add(send.request_id)
        was_waiting = bool(self._recvs or self._kept_alive)
        track_keep_alives(self._kept_alive, meta)
        for keep in meta.reqs_to_release:
            self._send_release(keep)
            with self._lock:
                self._lost.discard((keep.remote_host, keep.remote_port, keep.remote_request_id))
        for spec in meta.reqs_to_recv:
            self._add_recv(spec)
        if not was_waiting and (self._recvs or self._kept_alive):
            # The first heartbeat one period after the wait starts; a keep-alive handing over to
            # its READ in between does not restart the period.
            self._next_heartbeat = now + self.config.heartbeat_seconds
        for request_id in meta.reqs_to_cancel:
            self._cancel(request_id)

    def get_finished(self) -> tuple[set[str], set[str]]:
        self._poll_handshakes()
        self._poll_reads()
        self._maybe_heartbeat()
        finished_sending = self._poll_sends()
        finished_recving, self._finished_recving = self._finished_recving, set()
        if self._load_errors:  # errors no client asked for (get_load_error) go after a while
            expired = time.monotonic() - LOAD_ERROR_TTL_S
            self._load_errors = {r: e for r, e in self._load_errors.items() if e[1] > expired}
        return finished_sending, finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        error_blocks, self._error_blocks = self._error_blocks, set()
        return error_blocks

    def get_load_error(self, request_id: str) -> str | None:
        """Why a request reported in finished_recving failed to load (None: it didn't); returns and
        forgets it. Unread errors are dropped LOAD_ERROR_TTL_S after the failure."""
        error = self._load_errors.pop(request_id, None)
        return error[0] if error is not None else None

    def num_pending_requests(self) -> int:
        """Requests this half still tracks (held, queued, in flight, or to report): 0 when idle."""
        with self._lock:
            num_held = len(self._held) + len(self._released)
        return num_held + len(self._recvs) + len(self._finished_recving)

    def get_stats(self) -> dict[str, Any]:
        with self._lock:
            num_blocks_held = sum(len(h.block_ids) for h in self._held.values())
        return {
            "kv_transfer_bytes_total": self._num_bytes,
            "kv_transfer_descriptors_total": self._num_descriptors,
            "kv_transfer_failures_total": self._num_failures,
            "kv_lease_expirations_total": self._num_lease_expirations,
            "num_blocks_held_for_transfer": num_blocks_held,
            "kv_transfer_seconds": self._transfer_seconds.to_dict(),
        }

    def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self._server.close()
        self._client.shutdown(wait=False, cancel_futures=True)
        for recv in self._recvs.values():
            if recv.is_posted:
                try:
                    self._release(recv.handle)
                except Exception as e:  # still active: the transport could not abort it
                    logger.warning("shutdown: READ of %s not released: %s", recv.spec.request_id, e)
        self._recvs.clear()
        for remote in self._remotes.values():
            self._disconnect(remote)
        self._remotes.clear()
        if self._region is not None:
            self._deregister()
            self._region = self._kv_cache = None

    # ---- D: receiving -------------------------------------------------------------------------

    def _add_recv(self, spec: RecvSpec) -> None:
        self._recvs[spec.request_id] = _Recv(spec)
        remote = self._remotes.get(spec.remote_engine_id)
        if remote is not None:
            self._post_read(self._recvs[spec.request_id], remote)
            return
        self._queued.setdefault(spec.remote_engine_id, []).append(spec.request_id)
        if spec.remote_engine_id not in self._handshakes:
            self._handshakes[spec.remote_engine_id] = self._client.submit(
                self._handshake, spec.remote_engine_id, spec.remote_host, spec.remote_port)

    def _cancel(self, request_id: str) -> None:
        recv = self._recvs.get(request_id)
        if recv is None:  # unknown here: report it so the scheduler never waits for it
            self._finished_recving.add(request_id)
        elif not recv.is_posted:  # nothing can write into its blocks any more
            self._queued[recv.spec.remote_engine_id].remove(request_id)
            self._send_release(recv.spec)
            self._finish_recv(recv)
        # else in flight: it may still write into its blocks; _poll_reads reports it when it ends

    def _handshake(self, engine_id: str, host: str, port: int) -> _RemoteEngine:
        """Client pool thread: no transport calls here; the engine thread connects."""
        try:
            reply, blob = side_channel.request(host, port, {
                "type": "handshake", "engine_id": self.engine_id, "compat_hash": self.compat_hash},
                key=self.config.auth_key)
        except OSError as e:  # the address and errno go to the log; the request's error reaches its client
            logger.warning("handshake with remote engine %s at %s:%d failed: %s", engine_id, host, port, e)
            raise RuntimeError(f"handshake with remote engine {engine_id} failed: its side channel "
                               f"did not answer") from None
        if reply.get("engine_id") not in (None, engine_id):
            logger.warning("remote engine at %s:%d is %s, expected %s", host, port, reply["engine_id"], engine_id)
            raise RuntimeError(f"the side channel named for remote engine {engine_id} belongs to another engine")
        if not reply.get("ok"):
            remote_compat = reply.get("compat") or {}
            diffs = [f"{key} local={self.compat.get(key)} remote={remote_compat.get(key)}"
                     for key in sorted(set(self.compat) | set(remote_compat))
                     if self.compat.get(key) != remote_compat.get(key)]
            if diffs:
                raise RuntimeError(f"KV layout mismatch with remote engine {engine_id}: {', '.join(diffs)}")
            raise RuntimeError(f"handshake with remote engine {engine_id} failed: {reply.get('error')}")
        region = _Region(**reply["region"])
        if self._region is not None and region.block_bytes != self._region.block_bytes:
            raise RuntimeError(f"KV layout mismatch with remote engine {engine_id}: "
                               f"block_bytes local={self._region.block_bytes} remote={region.block_bytes}")
        return _RemoteEngine(engine_id, region, reply, blob)

    def _poll_handshakes(self) -> None:
        for engine_id, future in list(self._handshakes.items()):
            if not future.done():
                continue
            del self._handshakes[engine_id]
            waiting = [self._recvs[request_id] for request_id in self._queued.pop(engine_id, [])]
            try:
                remote = future.result()
                self._connect(remote)
            except Exception as e:
                error = str(e)
                logger.warning("%s; failing %d request(s)", error, len(waiting))
                for recv in waiting:
                    self._fail(recv, error, recv.spec.local_block_ids, release=True)
                continue
            self._remotes[engine_id] = remote
            for recv in waiting:
                self._post_read(recv, remote)

    def _post_read(self, recv: _Recv, remote: _RemoteEngine) -> None:
        spec, local = recv.spec, self._region
        error = None
        if local is None:
            error = "KV cache is not registered"
        elif len(spec.local_block_ids) != len(spec.remote_block_ids):
            error = f"{len(spec.local_block_ids)} local blocks for {len(spec.remote_block_ids)} remote blocks"
        elif spec.local_block_ids and not (0 <= min(spec.local_block_ids)
                                           and max(spec.local_block_ids) < local.num_blocks):
            error = f"local block id out of range [0, {local.num_blocks})"
        elif spec.remote_block_ids and not (0 <= min(spec.remote_block_ids)
                                            and max(spec.remote_block_ids) < remote.region.num_blocks):
            error = f"remote block id out of range [0, {remote.region.num_blocks})"
        if error is None and self._is_lost(spec):
            error = "its lease on the KV ran out before this engine's first heartbeat reached it"
        if error is not None:
            self._fail(recv, f"KV load from remote engine {remote.engine_id} failed: {error}",
                       spec.local_block_ids, release=True)
            return
        if not spec.local_block_ids:  # nothing to read: let P free its blocks
            self._send_release(spec)
            self._finish_recv(recv)
            return
        runs = coalesce(spec.local_block_ids, spec.remote_block_ids)
        recv.posted_at = time.monotonic()
        try:
            handle, state = self._post(recv, remote, runs)
        except Exception as e:
            logger.warning("request %s: posting the READ from %s failed: %s", spec.request_id, remote.engine_id, e)
            self._fail(recv, f"KV load from remote engine {remote.engine_id} failed: the transfer could not "
                             f"be posted", spec.local_block_ids, release=True)
            return
        recv.is_posted, recv.handle, recv.num_descriptors = True, handle, len(runs)
        recv.num_bytes = len(spec.local_block_ids) * local.block_bytes
        if state != "PROC":
            self._complete_read(recv, state)

    def _poll_reads(self) -> None:
        for recv in [r for r in self._recvs.values() if r.is_posted]:
            state = self._check(recv.handle)
            if state != "PROC":
                self._complete_read(recv, state)
        for (engine_id, host, port), request_ids in self._done_to_send.items():  # one notice per P per step
            self._send_done(engine_id, host, port, request_ids)
        self._done_to_send = {}

    def _complete_read(self, recv: _Recv, state: str) -> None:
        spec = recv.spec
        try:
            self._release(recv.handle)
        except Exception as e:
            logger.warning("READ of %s: handle not released: %s", spec.request_id, e)
        recv.handle = None
        if state == "DONE":
            self._num_bytes += recv.num_bytes
            self._num_descriptors += recv.num_descriptors
            self._transfer_seconds.observe(time.monotonic() - recv.posted_at)
            if self.notifies_done:
                self._done_to_send.setdefault((spec.remote_engine_id, spec.remote_host, spec.remote_port),
                                              []).append(spec.remote_request_id)
        invalid = self._invalid_blocks(recv, state)
        lost = state == "DONE" and self._is_lost(spec)  # P freed the blocks while we read them
        if lost:
            invalid = list(spec.local_block_ids)
        if not invalid:
            self._finish_recv(recv)
            return
        cause = ("transfer error" if state != "DONE" else "the remote lease ran out during the read" if lost
                 else f"injected {self._inject_read_failure}")
        self._fail(recv, f"KV load from remote engine {spec.remote_engine_id} failed: "
                   f"{len(invalid)} of {len(spec.local_block_ids)} blocks invalid ({cause})", invalid,
                   release=state != "DONE")  # after an ERR P got no done notice: let it free now

    def _invalid_blocks(self, recv: _Recv, state: str) -> list[int]:
        """Local blocks a finished READ left without valid KV. The one place fault injection acts."""
        if state != "DONE" or self._inject_read_failure == "all":
            return list(recv.spec.local_block_ids)
        if self._inject_read_failure == "last_block":
            return list(recv.spec.local_block_ids[-1:])
        return []

    def _fail(self, recv: _Recv, error: str, invalid_block_ids: list[int], release: bool) -> None:
        if release:
            self._send_release(recv.spec)
        self._num_failures += 1
        self._error_blocks.update(invalid_block_ids)
        self._load_errors[recv.spec.request_id] = (error, time.monotonic())
        self._finish_recv(recv)

    def _finish_recv(self, recv: _Recv) -> None:
        del self._recvs[recv.spec.request_id]
        self._finished_recving.add(recv.spec.request_id)
        spec = recv.spec
        with self._lock:
            self._lost.discard((spec.remote_host, spec.remote_port, spec.remote_request_id))

    def _maybe_heartbeat(self) -> None:
        now = time.monotonic()
        if not (self._recvs or self._kept_alive) or now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.config.heartbeat_seconds
        by_engine: dict[tuple[str, int], list[str]] = {}
        # Waiting for blocks here, waiting for a handshake, or reading: P must keep all of them.
        specs = [*self._kept_alive.values(), *(recv.spec for recv in self._recvs.values())]
        for spec in specs:
            by_engine.setdefault((spec.remote_host, spec.remote_port), []).append(spec.remote_request_id)
        for (host, port), request_ids in by_engine.items():
            self._send_async(host, port, {"type": "heartbeat", "engine_id": self.engine_id,
                                          "remote_request_ids": request_ids},
                             on_reply=lambda reply, host=host, port=port: self._note_expired(host, port, reply))

    def _note_expired(self, host: str, port: int, reply: dict[str, Any]) -> None:
        """Client pool thread: P says these leases ran out before a heartbeat reached it (P may
        have reused the blocks): their loads must fail, not read."""
        expired = reply.get("expired") or []
        if expired:
            logger.warning("P at %s:%d had already freed the KV of %d request(s) queued here: their "
                           "loads fail (kv_load_failure_policy applies)", host, port, len(expired))
            with self._lock:
                self._lost.update((host, port, request_id) for request_id in expired)

    def _is_lost(self, spec: RecvSpec) -> bool:
        if not self._lost:  # nearly always: no lock on the post/read path (a set's truth test is atomic)
            return False
        with self._lock:
            return (spec.remote_host, spec.remote_port, spec.remote_request_id) in self._lost

    def _send_done(self, engine_id: str, host: str, port: int, request_ids: list[str]) -> None:
        """Tell P these READs are done (transports with notifies_done); over the side channel here."""
        self._send_async(host, port, {"type": "done", "engine_id": self.engine_id,
                                      "remote_request_ids": request_ids})

    def _send_release(self, spec: RecvSpec | KeepAliveSpec) -> None:
        self._send_async(spec.remote_host, spec.remote_port, {
            "type": "release", "engine_id": self.engine_id, "remote_request_ids": [spec.remote_request_id]})

    def _send_async(self, host: str, port: int, message: dict[str, Any], on_reply=None) -> None:
        def send() -> None:
            try:
                reply, _ = side_channel.request(host, port, message, key=self.config.auth_key)
                if not reply.get("ok"):
                    logger.warning("%s to %s:%d refused: %s", message["type"], host, port, reply.get("error"))
                elif on_reply is not None:
                    on_reply(reply)
            except OSError as e:
                logger.warning("%s to %s:%d failed: %s", message["type"], host, port, e)
        try:
            self._client.submit(send)
        except RuntimeError:  # shut down
            pass

    # ---- P: sending ---------------------------------------------------------------------------

    def _poll_sends(self) -> set[str]:
        notified = self._take_notifs() if self._region is not None else []
        now = time.monotonic()
        with self._lock:
            for request_id in notified:
                if request_id in self._held:
                    self._released.add(request_id)
                else:  # READ done before the SendSpec reached us
                    self._early_done[request_id] = now
            finished, self._released = {r for r in self._released if r in self._held}, set()
            for request_id, held in self._held.items():
                if request_id not in finished and held.deadline < now:
                    logger.warning("KV lease of %s expired: no READ or heartbeat for %.1fs; freeing "
                                   "%d blocks", request_id, self.config.lease_seconds, len(held.block_ids))
                    self._num_lease_expirations += 1
                    self._expired[request_id] = now
                    finished.add(request_id)
            for request_id in finished:
                del self._held[request_id]
            for pending in (self._early_done, self._expired):
                if not pending:  # most steps: nothing to sweep
                    continue
                for request_id, seen_at in list(pending.items()):
                    if seen_at + self.config.lease_seconds < now:
                        del pending[request_id]
        return finished

    # side-channel thread: lease state under the lock, never the transport
    def _on_handshake(self, message: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        reply = {"engine_id": self.engine_id, "compat": self.compat}
        if message.get("compat_hash") != self.compat_hash:
            logger.warning("handshake from %s refused: compat hash mismatch", message.get("engine_id"))
            return {**reply, "ok": False, "error": "compat mismatch"}, b""
        if self._region is None:
            return {**reply, "ok": False, "error": "KV cache is not registered yet"}, b""
        return {**reply, **self._handshake_fields, "ok": True,
                "region": self._region.__dict__}, self._handshake_blob

    def _on_heartbeat(self, message: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        deadline = time.monotonic() + self.config.lease_seconds
        num_extended, expired = 0, []
        with self._lock:
            for request_id in message.get("remote_request_ids", []):
                held = self._held.get(request_id)
                if held is not None:
                    held.deadline = max(held.deadline, deadline)
                    num_extended += 1
                elif request_id in self._expired:  # (unknown ids may just not have arrived yet)
                    expired.append(request_id)
        return {"ok": True, "num_extended": num_extended, "expired": expired}, b""

    def release_held(self, request_ids: list[str]) -> None:
        self._mark_released(request_ids)

    def _on_release(self, message: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        """A release (D gives up) or a done (D's READ finished): either way P may free the blocks."""
        self._mark_released(message.get("remote_request_ids", []))
        return {"ok": True}, b""

    def _mark_released(self, request_ids: list[str]) -> None:
        """Free at the next get_finished; one not held yet (its SendSpec still on the way) is freed
        when it arrives."""
        now = time.monotonic()
        with self._lock:
            for request_id in request_ids:
                if request_id in self._held:
                    self._released.add(request_id)
                else:
                    self._early_done[request_id] = now
