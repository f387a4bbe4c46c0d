"""What every worker half shares, whatever the direction (pull, push): the registered KV region, the handshake
that describes it to a peer, load errors for clients, and the transfer histogram.

KV layout (model/attention.py): one contiguous tensor [num_blocks, num_layers, 2, block_size, heads, dim], so
block b is the byte range [b * block_bytes, (b + 1) * block_bytes) and a run of consecutive block ids on BOTH
sides is one descriptor (one NIXL descriptor, one copy).

A transport fills the hooks (engine thread): _register(kv_cache) → (handshake fields, handshake blob) once at
start-up; _connect(remote) after a handshake (make the peer's memory reachable; raise to fail its requests);
_disconnect(remote); _deregister(). The direction's own hooks (post a READ or a WRITE, check it, release it)
are the subclass's.
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

logger = logging.getLogger(__name__)

LOAD_ERROR_TTL_S = 60.0  # a load error no client asked for (get_load_error) is dropped after this
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


@dataclass(frozen=True)
class Region:
    """One engine's registered KV cache, as the handshake describes it."""
    base_addr: int
    num_blocks: int
    block_bytes: int
    mem_type: str   # DRAM | VRAM
    device_id: int


def single_kv_cache(kv_caches: Any) -> torch.Tensor:
    """The one contiguous KV cache tensor a worker half registers; ValueError otherwise."""
    kv_cache = kv_caches[0] if isinstance(kv_caches, (list, tuple)) and len(kv_caches) == 1 else kv_caches
    if not isinstance(kv_cache, torch.Tensor) or not kv_cache.is_contiguous():
        raise ValueError("register_kv_caches: expected one contiguous tensor "
                         "[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]")
    return kv_cache


def region_of(kv_cache: torch.Tensor) -> Region:
    """Where the cache lies now (read it after a registration that may move a CPU cache)."""
    return Region(kv_cache.data_ptr(), kv_cache.shape[0], kv_cache[0].numel() * kv_cache.element_size(),
                  "VRAM" if kv_cache.is_cuda else "DRAM", (kv_cache.device.index if kv_cache.is_cuda else 0) or 0)


def remote_tp_size(reply: dict[str, Any]) -> int:
    """A peer's tensor-parallel size, from its handshake reply (its ranks 1..T-1 listed in tp_ranks)."""
    ranks = reply.get("tp_ranks")
    return 1 + (len(ranks) if isinstance(ranks, list) else 0)


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


class TransportWorker(KVConnectorWorker):
    """The registered region, the handshake (served and parsed), load errors; `handlers` are the
    direction's side-channel message types beside "handshake"."""

    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, str | int],
                 handlers: dict[str, side_channel.Handler]) -> None:
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
        self._server = side_channel.SideChannelServer(config.side_channel_host, config.side_channel_port,
                                                      {"handshake": self._on_handshake, **handlers},
                                                      key=config.auth_key)
        self.side_channel_port = self._server.port

    # ---- transport hooks ------------------------------------------------------------------------

    def _register(self, kv_cache: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        raise NotImplementedError

    def _connect(self, remote: RemoteEngine) -> None:
        raise NotImplementedError

    def _disconnect(self, remote: RemoteEngine) -> None:
        pass

    def _deregister(self) -> None:
        pass

    # ---- start-up ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        kv_cache = single_kv_cache(kv_caches)
        self._kv_cache = kv_cache  # registered memory must outlive its registration
        fields, blob = self._register(kv_cache)  # may move a CPU cache into shared memory: address after
        self._region = region_of(kv_cache)
        self._handshake_fields, self._handshake_blob = fields, blob

    def get_block_ids_with_load_errors(self) -> set[int]:
        error_blocks, self._error_blocks = self._error_blocks, set()
        return error_blocks

    def get_load_error(self, request_id: str) -> str | None:
        """Why a request reported in finished_recving failed to load (None: it didn't); returns and
        forgets it. Unread errors are dropped after a while."""
        error = self._load_errors.pop(request_id, None)
        return error[0] if error is not None else None

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
            if diffs and reply.get("compat") is not None:
                raise RuntimeError(f"KV layout mismatch with remote engine {engine_id}: {', '.join(diffs)}")
            raise RuntimeError(f"handshake with remote engine {engine_id} failed: {reply.get('error')}")
        region = Region(**reply["region"])
        if not all(isinstance(v, int) for v in (region.base_addr, region.num_blocks, region.block_bytes)):
            raise TypeError("region fields must be integers")
        self._check_remote_region(region, reply, engine_id)
        return RemoteEngine(engine_id, region, reply, blob)

    def _check_remote_region(self, region: Region, reply: dict[str, Any], engine_id: str) -> None:
        """RuntimeError when the peer's blocks cannot pair with ours (a block of another size)."""
        if self._region is not None and region.block_bytes != self._region.block_bytes:
            raise RuntimeError(f"KV layout mismatch with remote engine {engine_id}: "
                               f"block_bytes local={self._region.block_bytes} remote={region.block_bytes}")

    def connect_remote(self, remote: RemoteEngine) -> None:
        """_connect, for the lifecycles: a transport's own error (a binding's exception, which a client must
        not see) is logged and becomes a RuntimeError that names the peer."""
        try:
            self._connect(remote)
        except RuntimeError as e:
            if "remote engine" in str(e):   # (ours, for the client)
                raise
            self._connect_failed(remote, e)
        except Exception as e:
            self._connect_failed(remote, e)

    @staticmethod
    def _connect_failed(remote: RemoteEngine, error: Exception) -> None:
        logger.warning("connecting to remote engine %s: %s: %s", remote.engine_id, type(error).__name__, error)
        raise RuntimeError(f"the transport could not connect to remote engine {remote.engine_id}") from None

    def _on_handshake(self, message: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        reply = {"engine_id": self.engine_id, "boot_id": self.boot_id, "compat": self.compat}
        if message.get("compat_hash") != self.compat_hash:
            logger.warning("handshake from %s refused: compat hash mismatch", message.get("engine_id"))
            return {**reply, "ok": False, "error": "compat mismatch"}, b""
        if self._region is None:
            return {**reply, "ok": False, "error": "KV cache is not registered yet"}, b""
        return {**reply, **self._handshake_fields, "ok": True,
                "region": self._region.__dict__}, self._handshake_blob

    def _load_failed(self, load: Any, error: str, invalid_block_ids: list[int], for_client: bool = True) -> None:
        """A failed load (its spec names the request and the remote engine): its blocks and the error its
        client will see (for_client=False: it will not see one, the request recomputes; the log has it)."""
        if "remote engine" not in error:  # (the handshake's errors name the engine already)
            error = f"KV load from remote engine {load.spec.remote_engine_id} failed: {error}"
        self._error_blocks.update(invalid_block_ids)
        if for_client:
            self._load_errors[load.spec.request_id] = (error, time.monotonic())
        else:
            logger.info("request %s recomputes its prompt: %s", load.spec.request_id, error)

    def _stats(self, failures: int, quarantined: int, expirations: int, blocks_held: int) -> dict[str, Any]:
        """get_stats' body: the transfer counters every direction keeps, and the lifecycle's."""
        return {
            "kv_transfer_bytes_total": self.num_bytes,
            "kv_transfer_descriptors_total": self.num_descriptors,
            "kv_transfer_failures_total": failures,
            "kv_transfer_quarantined_total": quarantined,
            "kv_lease_expirations_total": expirations,
            "num_blocks_held_for_transfer": blocks_held,
            "kv_transfer_seconds": self.transfer_seconds.to_dict(),
        }

    def _prune_load_errors(self) -> None:
        if self._load_errors:
            expired = time.monotonic() - LOAD_ERROR_TTL_S
            self._load_errors = {r: e for r, e in self._load_errors.items() if e[1] > expired}

    def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        # Transfers first, the side channel last: a peer that finds it closed may take this instance for
        # gone (push: a D then gives back blocks a WRITE of ours could still reach).
        try:
            self._shutdown_lifecycle()
            if self._region is not None:
                self._deregister()
                self._region = self._kv_cache = None
        finally:
            self._server.close()

    def _shutdown_lifecycle(self) -> None:
        pass
