"""The worker half of every pull transport: the hooks a transport fills, around the lifecycle.

The lifecycle itself (P's grants, D's loads, their states and deadlines) is lifecycle.py's
LeaseHolder and Loader; this module is the glue between them, the connector contract and a
transport: the side-channel handlers, stats. Registration, the handshake and the KV layout are
transport_worker.py's, shared with push.

Hooks a transport fills (engine thread), beside transport_worker's (_register, _connect, ...):
  _post(load, remote, runs) → (handle, "PROC" | "DONE" | "ERR")   start one request's READ
  _check(handle) → "PROC" | "DONE" | "ERR" (raising counts as "ERR");  _release(handle): let it go,
                           aborting it if active; raise when it cannot (the load stays quarantined)
  _take_notifs() → P's request ids whose READ the transport itself reported done (P side)
  _send_done(peer, request_ids, claimants)   D side, with notifies_done (default: "done" over the side
                           channel; claimants: D's request ids, which P checks against the claim)
  _disconnect(remote), _deregister()
  notifies_done: False when the transport tells P itself (NIXL notif); True: D sends "done"

Fault injection, for tests only: config.extra["inject_read_failure"] = "all" (every READ is done,
then reported failed with all its blocks) or "last_block" (done; its last local block reported
invalid). It is read in one place: _invalid_blocks.
"""
from __future__ import annotations

import logging
from typing import Any

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.lifecycle import GrantState, LeaseHolder, Load, Loader, Peer
from pdserve.kv_transfer.pull import PullConnectorMeta
from pdserve.kv_transfer.transport_worker import (Histogram, Region, RemoteEngine, TransportWorker, coalesce,
                                                  compat_hash)

logger = logging.getLogger(__name__)

INJECT_READ_FAILURE_MODES = (None, "all", "last_block")
__all__ = ["PullConnectorWorker", "Load", "Region", "RemoteEngine", "Peer", "Histogram", "coalesce", "compat_hash"]


def check_inject_read_failure(config: KVTransferConfig) -> None:
    mode = config.extra.get("inject_read_failure")
    if mode not in INJECT_READ_FAILURE_MODES:
        raise ValueError(f"inject_read_failure: expected one of {INJECT_READ_FAILURE_MODES}, got {mode!r}")


class PullConnectorWorker(TransportWorker):
    """The pull lifecycle over an abstract transport; see the module docstring for the hooks."""

    notifies_done = False

    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, str | int]) -> None:
        check_inject_read_failure(config)
        self._inject_read_failure = config.extra.get("inject_read_failure")
        super().__init__(config, engine_id, compat, {
            "claim": lambda m, b: (self.holder.on_claim(m), b""),
            "heartbeat": lambda m, b: (self.holder.on_heartbeat(m), b""),
            "release": lambda m, b: (self.holder.on_end(m, GrantState.RELEASED), b""),
            "done": lambda m, b: (self.holder.on_end(m, GrantState.READ), b"")})
        self.holder = LeaseHolder(config, self.boot_id)
        self.loader = Loader(self, config)

    # ---- transport hooks ------------------------------------------------------------------------

    def _post(self, load: Load, remote: RemoteEngine, runs: list[tuple[int, int, int]]) -> tuple[Any, str]:
        raise NotImplementedError

    def _check(self, handle: Any) -> str:
        raise NotImplementedError

    def _release(self, handle: Any) -> None:
        pass

    def _take_notifs(self) -> list[str]:
        return []

    def _send_done(self, peer: Peer, request_ids: list[str], claimants: list[str]) -> None:
        """Tell P these READs are done (transports with notifies_done); over the side channel here."""
        self.loader.send_done(peer, request_ids, claimants)

    # ---- each step ----------------------------------------------------------------------------

    def start_load_kv(self, meta: PullConnectorMeta) -> None:
        for send in meta.reqs_to_send:
            self.holder.hold(send.request_id, send.block_ids)
        if meta.reqs_to_recv or meta.reqs_to_keep_alive or meta.reqs_to_release or meta.reqs_to_cancel:
            self.loader.apply(meta)

    def get_finished(self) -> tuple[set[str], set[str]]:
        finished_recving = self.loader.step()
        self._prune_load_errors()
        notified = self._take_notifs() if self._region is not None else []
        return self.holder.step(notified), finished_recving

    def release_held(self, request_ids: list[str]) -> None:
        self.holder.end(request_ids, GrantState.RELEASED)

    def num_pending_requests(self) -> int:
        """Requests this half still tracks (held, loading, or to report): 0 when idle. P keeps
        stepping (and so progressing the transport) while it holds anything a READ may be reading."""
        return self.holder.num_pending() + self.loader.num_pending()

    def get_stats(self) -> dict[str, Any]:
        return self._stats(self.loader.num_failures, self.loader.num_quarantined, self.holder.num_expirations,
                           self.holder.num_blocks_held())

    def _shutdown_lifecycle(self) -> None:
        self.loader.shutdown()

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
