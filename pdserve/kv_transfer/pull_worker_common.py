"""The worker half of every pull transport: the hooks a transport fills, around the lifecycle.

The lifecycle itself (P's grants, D's loads, their states and deadlines) is lifecycle.py's
LeaseHolder and Loader; this module is the glue between them, the connector contract and a
transport: registration, the handshake reply, the side-channel handlers, stats. KV layout
(model/attention.py): one contiguous tensor [num_blocks, num_layers, 2, block_size, heads, dim], so
block b is the byte range [b * block_bytes, (b + 1) * block_bytes) and a run of consecutive block
ids on BOTH sides is one descriptor (one NIXL descriptor, one copy).

Hooks a transport fills (engine thread):
  _register(kv_cache) → (handshake fields, handshake blob)   once, at start-up
  _connect(remote)         after a handshake: make P's memory reachable; raise to fail its requests
  _post(load, remote, runs) → (handle, "PROC" | "DONE" | "ERR")   start one request's READ
  _check(handle) → "PROC" | "DONE" | "ERR" (raising counts as "ERR");  _release(handle): let it go,
                           aborting it if active; raise when it cannot (the load stays quarantined)
  _take_notifs() → P's request ids whose READ the transport itself reported done (P side)
  _send_done(peer, request_ids)   D side, with notifies_done (default: "done" over the side channel)
  _disconnect(remote), _deregister()
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
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.base import KVConnectorWorker
from pdserve.kv_transfer.lifecycle import GrantState, LeaseHolder, Load, Loader, Peer
from pdserve.kv_transfer.pull import PullConnectorMeta

logger = logging.getLogger(__name__)

INJECT_READ_FAILURE_MODES = (None, "all", "last_block")
LOAD_ERROR_TTL_S = 60.0  # a load error no client asked for (get_load_error) is dropped after this
# kv_transfer_seconds upper bounds (the +Inf bucket is `count`)
TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
__all__ = ["PullConnectorWorker", "Load", "Region", "RemoteEngine", "Peer", "coalesce", "compat_hash"]


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


@dataclass(frozen=True)
class Region:
    """One engine's registered KV cache, as the handshake describes it."""
    base_addr: int
    num_blocks: int
    block_bytes: int
    mem_type: str   # DRAM | VRAM
    device_id: int


@dataclass
class RemoteEngine:
    engine_id: str
    region: Region
    reply: dict[str, Any]   # the handshake reply: transport fields beside the region
    blob: bytes             # the handshake blob (NIXL: agent metadata)
    conn: Any = None        # what the transport's _connect made of them


@dataclass
class Histogram:
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


def check_inject_read_failure(config: KVTransferConfig) -> None:
    mode = config.extra.get("inject_read_failure")
    if mode not in INJECT_READ_FAILURE_MODES:
        raise ValueError(f"inject_read_failure: expected one of {INJECT_READ_FAILURE_MODES}, got {mode!r}")


class PullConnectorWorker(KVConnectorWorker):
    """The pull lifecycle over an abstract transport; see the module docstring for the hooks."""

    notifies_done = False

    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, str | int]) -> None:
        check_inject_read_failure(config)
        self._inject_read_failure = config.extra.get("inject_read_failure")
        self.config = config
        self.engine_id = engine_id
        self.boot_id = uuid.uuid4().hex  # a nonce per boot: params from an earlier boot are refused
        self.compat = dict(compat)
        self.compat_hash = compat_hash(self.compat)
        self._region: Region | None = None
        self._kv_cache: torch.Tensor | None = None
        self._handshake_fields: dict[str, Any] = {}
        self._handshake_blob = b""
        self._is_shut_down = False
        self.num_bytes = self.num_descriptors = 0
        self._error_blocks: set[int] = set()
        self._load_errors: dict[str, tuple[str, float]] = {}  # request id → (error, when)
        self.transfer_seconds = Histogram()
        self.holder = LeaseHolder(config, self.boot_id)
        self.loader = Loader(self, config)
        self._server = side_channel.SideChannelServer(config.side_channel_host, config.side_channel_port, {
            "handshake": self._on_handshake,
            "claim": lambda m, b: (self.holder.on_claim(m), b""),
            "heartbeat": lambda m, b: (self.holder.on_heartbeat(m), b""),
            "release": lambda m, b: (self.holder.on_end(m, GrantState.RELEASED), b""),
            "done": lambda m, b: (self.holder.on_end(m, GrantState.READ), b"")}, key=config.auth_key)
        self.side_channel_port = self._server.port

    # ---- transport hooks ------------------------------------------------------------------------

    def _register(self, kv_cache: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        raise NotImplementedError

    def _connect(self, remote: RemoteEngine) -> None:
        raise NotImplementedError

    def _post(self, load: Load, remote: RemoteEngine, runs: list[tuple[int, int, int]]) -> tuple[Any, str]:
        raise NotImplementedError

    def _check(self, handle: Any) -> str:
        raise NotImplementedError

    def _release(self, handle: Any) -> None:
        pass

    def _take_notifs(self) -> list[str]:
        return []

    def _send_done(self, peer: Peer, request_ids: list[str]) -> None:
        """Tell P these READs are done (transports with notifies_done); over the side channel here."""
        self.loader.send_done(peer, request_ids)

    def _disconnect(self, remote: RemoteEngine) -> None:
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
        self._region = Region(kv_cache.data_ptr(), kv_cache.shape[0], block_bytes,
                              "VRAM" if kv_cache.is_cuda else "DRAM", device_id or 0)
        self._handshake_fields, self._handshake_blob = fields, blob

    # ---- each step ----------------------------------------------------------------------------

    def start_load_kv(self, meta: PullConnectorMeta) -> None:
        for send in meta.reqs_to_send:
            self.holder.hold(send.request_id, send.block_ids)
        if meta.reqs_to_recv or meta.reqs_to_keep_alive or meta.reqs_to_release or meta.reqs_to_cancel:
            self.loader.apply(meta)

    def get_finished(self) -> tuple[set[str], set[str]]:
        finished_recving = self.loader.step()
        if self._load_errors:
            expired = time.monotonic() - LOAD_ERROR_TTL_S
            self._load_errors = {r: e for r, e in self._load_errors.items() if e[1] > expired}
        notified = self._take_notifs() if self._region is not None else []
        return self.holder.step(notified), finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        error_blocks, self._error_blocks = self._error_blocks, set()
        return error_blocks

    def get_load_error(self, request_id: str) -> str | None:
        """Why a request reported in finished_recving failed to load (None: it didn't); returns and
        forgets it. Unread errors are dropped after a while."""
        error = self._load_errors.pop(request_id, None)
        return error[0] if error is not None else None

    def release_held(self, request_ids: list[str]) -> None:
        self.holder.end(request_ids, GrantState.RELEASED)

    def num_pending_requests(self) -> int:
        """Requests this half still tracks (held, loading, or to report): 0 when idle. P keeps
        stepping (and so progressing the transport) while it holds anything a READ may be reading."""
        return self.holder.num_pending() + self.loader.num_pending()

    def get_stats(self) -> dict[str, Any]:
        loader = self.loader
        return {
            "kv_transfer_bytes_total": self.num_bytes,
            "kv_transfer_descriptors_total": self.num_descriptors,
            "kv_transfer_failures_total": loader.num_failures,
            "kv_transfer_quarantined_total": loader.num_quarantined,
            "kv_lease_expirations_total": self.holder.num_expirations,
            "num_blocks_held_for_transfer": self.holder.num_blocks_held(),
            "kv_transfer_seconds": self.transfer_seconds.to_dict(),
        }

    def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self._server.close()
        self.loader.shutdown()
        if self._region is not None:
            self._deregister()
            self._region = self._kv_cache = None

    # ---- the handshake ------------------------------------------------------------------------

    def _parse_handshake(self, engine_id: str, reply: dict[str, Any], blob: bytes) -> RemoteEngine:
        """D, engine thread: P's handshake reply → RemoteEngine (no transport call yet); raises
        RuntimeError with the client's message, or another error for a malformed reply."""
        if reply.get("engine_id") not in (None, engine_id):
            logger.warning("remote engine %s answered as %s", engine_id, reply["engine_id"])
            raise RuntimeError(f"the side channel named for remote engine {engine_id} belongs to another engine")
        if not reply.get("ok"):
            remote_compat = reply.get("compat") or {}
            diffs = [f"{key} local={self.compat.get(key)} remote={remote_compat.get(key)}"
                     for key in sorted(set(self.compat) | set(remote_compat))
                     if self.compat.get(key) != remote_compat.get(key)]
            if diffs:
                raise RuntimeError(f"KV layout mismatch with remote engine {engine_id}: {', '.join(diffs)}")
            raise RuntimeError(f"handshake with remote engine {engine_id} failed: {reply.get('error')}")
        region = Region(**reply["region"])
        if not all(isinstance(v, int) for v in (region.base_addr, region.num_blocks, region.block_bytes)):
            raise TypeError("region fields must be integers")
        if self._region is not None and region.block_bytes != self._region.block_bytes:
            raise RuntimeError(f"KV layout mismatch with remote engine {engine_id}: "
                               f"block_bytes local={self._region.block_bytes} remote={region.block_bytes}")
        return RemoteEngine(engine_id, region, reply, blob)

    def _on_handshake(self, message: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        reply = {"engine_id": self.engine_id, "boot_id": self.boot_id, "compat": self.compat}
        if message.get("compat_hash") != self.compat_hash:
            logger.warning("handshake from %s refused: compat hash mismatch", message.get("engine_id"))
            return {**reply, "ok": False, "error": "compat mismatch"}, b""
        if self._region is None:
            return {**reply, "ok": False, "error": "KV cache is not registered yet"}, b""
        return {**reply, **self._handshake_fields, "ok": True,
                "region": self._region.__dict__}, self._handshake_blob

    def _post_read(self, load: Load, remote: RemoteEngine) -> tuple[Any, str, int, int]:
        """Start one load's READ: (handle, state, descriptors, bytes). ValueError: the block ids do not
        fit either cache (nothing posted)."""
        spec, local = load.spec, self._region
        if local is None:
            raise ValueError("KV cache is not registered")
        if len(spec.local_block_ids) != len(spec.remote_block_ids):
            raise ValueError(f"{len(spec.local_block_ids)} local blocks for {len(spec.remote_block_ids)} remote blocks")
        if not (0 <= min(spec.local_block_ids) and max(spec.local_block_ids) < local.num_blocks):
            raise ValueError(f"local block id out of range [0, {local.num_blocks})")
        if not (0 <= min(spec.remote_block_ids) and max(spec.remote_block_ids) < remote.region.num_blocks):
            raise ValueError(f"remote block id out of range [0, {remote.region.num_blocks})")
        runs = coalesce(spec.local_block_ids, spec.remote_block_ids)
        handle, state = self._post(load, remote, runs)
        return handle, state, len(runs), len(spec.local_block_ids) * local.block_bytes

    def _load_failed(self, load: Load, error: str, invalid_block_ids: list[int]) -> None:
        """The loader reports a failed load: its blocks and the error its client will see."""
        if "remote engine" not in error:  # (the handshake's errors name the engine already)
            error = f"KV load from remote engine {load.spec.remote_engine_id} failed: {error}"
        self._error_blocks.update(invalid_block_ids)
        self._load_errors[load.spec.request_id] = (error, time.monotonic())

    def _count_read(self, load: Load, seconds: float) -> None:
        self.num_bytes += load.num_bytes
        self.num_descriptors += load.num_descriptors
        self.transfer_seconds.observe(seconds)

    def _invalid_blocks(self, load: Load, state: str) -> list[int]:
        """Local blocks a finished READ left without valid KV. The one place fault injection acts."""
        if state != "DONE" or self._inject_read_failure == "all":
            return list(load.spec.local_block_ids)
        if self._inject_read_failure == "last_block":
            return list(load.spec.local_block_ids[-1:])
        return []
