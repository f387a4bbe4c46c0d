"""In-process pull transport: D's worker half copies blocks straight out of P's registered cache.

A real registered connector for tests (and single-process experiments): P and D engines live in
one process and find each other by engine id. It follows the contract (leases, keep-alives,
cancellation, injected read failures) so the scheduler-level P/D tests exercise it without a
network, but not lifecycle.py's states: no handshake, no claim, no boot nonce (one process cannot
restart a peer); the real transports' lifecycle is tested in tests/kv_transfer. The copy is done with item assignment, so the
"KV cache" may be a torch tensor or, in torch-free tests, a plain list of blocks.
"""
from __future__ import annotations

import time
from typing import Any

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.base import KVConnectorWorker
from pdserve.kv_transfer.pull import KeepAliveSpec, PullConnectorMeta, RecvSpec, track_keep_alives

_REGISTRY: dict[str, "LoopbackConnectorWorker"] = {}


class LoopbackConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, engine_id: str, clock=time.monotonic) -> None:
        self.config = config
        self.engine_id = engine_id
        self.clock = clock
        self.kv_caches: Any = None
        self._leases: dict[str, float] = {}        # P: request id → deadline
        self._lease_blocks: dict[str, int] = {}
        self._notified: set[str] = set()           # P: reads finished before/after the lease began
        self._pending: list[RecvSpec] = []         # D: copy on the next get_finished
        self._kept_alive: dict[str, KeepAliveSpec] = {}  # D: queued requests whose P lease it extends
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._load_error_msgs: dict[str, str] = {}
        self.stats = {"kv_transfer_bytes_total": 0, "kv_transfer_descriptors_total": 0,
                      "kv_transfer_failures_total": 0, "kv_lease_expirations_total": 0}
        _REGISTRY[engine_id] = self

    def register_kv_caches(self, kv_caches: Any) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self, meta: PullConnectorMeta) -> None:
        now = self.clock()
        for spec in meta.reqs_to_send:
            self._leases[spec.request_id] = now + self.config.lease_seconds
            self._lease_blocks[spec.request_id] = len(spec.block_ids)
        track_keep_alives(self._kept_alive, meta)
        for keep in meta.reqs_to_release:
            peer = _REGISTRY.get(keep.remote_engine_id)
            if peer is not None:  # (possibly before P's SendSpec: _notified keeps it for then)
                peer._notified.add(keep.remote_request_id)
        self._pending.extend(meta.reqs_to_recv)
        for request_id in meta.reqs_to_cancel:
            for spec in [s for s in self._pending if s.request_id == request_id]:
                self._pending.remove(spec)
                self._finished_recving.add(request_id)
                peer = _REGISTRY.get(spec.remote_engine_id)
                if peer is not None:
                    peer._notified.add(spec.remote_request_id)

    def _copy(self, spec: RecvSpec) -> None:
        peer = _REGISTRY.get(spec.remote_engine_id)
        if peer is None or peer.kv_caches is None:
            self._fail(spec, f"remote engine {spec.remote_engine_id!r} is unknown")
            return
        injected = self.config.extra.get("inject_read_failure")
        if injected == "all":
            self._fail(spec, "injected read failure")
            return
        for local, remote in zip(spec.local_block_ids, spec.remote_block_ids):
            self.kv_caches[local] = peer.kv_caches[remote]
        self.stats["kv_transfer_descriptors_total"] += len(spec.local_block_ids)
        if injected == "last_block" and spec.local_block_ids:
            self._load_errors.add(spec.local_block_ids[-1])
            self.stats["kv_transfer_failures_total"] += 1
        peer._notified.add(spec.remote_request_id)

    def _fail(self, spec: RecvSpec, message: str) -> None:
        peer = _REGISTRY.get(spec.remote_engine_id)
        if peer is not None:  # release P's blocks now rather than at lease expiry
            peer._notified.add(spec.remote_request_id)
        self._load_errors.update(spec.local_block_ids)
        self._load_error_msgs[spec.request_id] = message
        self.stats["kv_transfer_failures_total"] += 1

    def get_finished(self) -> tuple[set[str], set[str]]:
        for keep in self._kept_alive.values():  # the heartbeat, without a network
            peer = _REGISTRY.get(keep.remote_engine_id)
            if peer is not None and keep.remote_request_id in peer._leases:
                peer._leases[keep.remote_request_id] = max(peer._leases[keep.remote_request_id],
                                                           peer.clock() + peer.config.lease_seconds)
        for spec in self._pending:
            self._copy(spec)
            self._finished_recving.add(spec.request_id)
        self._pending = []
        finished_sending = {r for r in self._leases if r in self._notified}
        now = self.clock()
        for request_id, deadline in self._leases.items():
            if request_id not in finished_sending and now >= deadline:
                finished_sending.add(request_id)
                self.stats["kv_lease_expirations_total"] += 1
        for request_id in finished_sending:
            del self._leases[request_id], self._lease_blocks[request_id]
            self._notified.discard(request_id)
        finished_recving, self._finished_recving = self._finished_recving, set()
        return finished_sending, finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_load_error(self, request_id: str) -> str | None:
        return self._load_error_msgs.pop(request_id, None)

    def get_stats(self) -> dict[str, float]:
        return {**self.stats, "num_blocks_held_for_transfer": sum(self._lease_blocks.values())}

    def num_pending_requests(self) -> int:
        return len(self._leases) + len(self._pending) + len(self._finished_recving)

    def shutdown(self) -> None:
        _REGISTRY.pop(self.engine_id, None)
