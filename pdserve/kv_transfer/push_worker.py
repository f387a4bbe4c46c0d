"""The worker half of the push handoff: the connector contract around push_lifecycle's Pusher (P) and
Receiver (D), over an abstract transport.

Side-channel message types this half serves: handshake (transport_worker's: P fetches D's memory
description before its first WRITE to that D), and announce, heartbeat, release (D → P), push_failed
and first_token (P → D: P's sampled token, ahead of the KV). Hooks a transport fills, beside
transport_worker's (_register, _connect, ...):
  _write(transfer_id, remote, local_block_ids, remote_block_ids, first_token_ids)
                        → (handle, "PROC" | "DONE" | "ERR", descriptors)   one WRITE of those blocks, with a
                           notification (push_lifecycle.write_notif: the transfer id, P's first token, the
                           writing rank) that D's transport delivers after the data
  _check(handle), _release(handle): as pull's (raise from _release when an active transfer cannot be
                           aborted: the Send stays quarantined, P's blocks held)
  _take_notifs() → the notifications of WRITEs into this instance that are done (D side)
Every instance runs both halves: one with kv_role both can prefill for one request and decode another.
"""
from __future__ import annotations

import logging
from typing import Any

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.push import PushConnectorMeta
from pdserve.kv_transfer.push_lifecycle import NOTIF_FORMAT, Pusher, Receiver, Send
from pdserve.kv_transfer.transport_worker import RemoteEngine, TransportWorker

logger = logging.getLogger(__name__)


class PushConnectorWorker(TransportWorker):
    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, str | int]) -> None:
        # (a peer whose WRITE notifications read otherwise is refused at the handshake, naming both)
        super().__init__(config, engine_id, {**compat, "push_notif": NOTIF_FORMAT}, {
            "announce": lambda m, b: (self.pusher.on_announce(m), b""),
            "heartbeat": lambda m, b: (self.pusher.on_heartbeat(m), b""),
            "release": lambda m, b: (self.pusher.on_release(m), b""),
            "first_token": lambda m, b: (self.receiver.on_first_token(m), b""),
            "push_failed": lambda m, b: (self.receiver.on_push_failed(m), b"")})
        self.side_channel_host = config.side_channel_host   # what D announces for P's push_failed messages
        self.pusher = Pusher(self, config)
        self.receiver = Receiver(self, config)

    # ---- transport hooks ----
    def _write(self, transfer_id: str, remote: RemoteEngine, local_block_ids: list[int],
               remote_block_ids: list[int], first_token_ids: tuple[int, ...]) -> tuple[Any, str, int]:
        raise NotImplementedError

    def _check(self, handle: Any) -> str:
        raise NotImplementedError

    def _release(self, handle: Any) -> None:
        pass

    def _take_notifs(self) -> list:
        """D: the raw notifications of WRITEs into this instance's agent (nixl.py; parsed and counted over the
        ranks by nixl_tp_push.py, which hands the Receiver read_notif's)."""
        return []

    # ---- the contract ----
    def start_load_kv(self, meta: PushConnectorMeta) -> None:
        if meta.reqs_to_send or meta.reqs_not_sent:
            self.pusher.apply(meta)
        if meta.reqs_to_recv or meta.reqs_to_keep_alive or meta.reqs_to_release or meta.reqs_to_cancel:
            self.receiver.apply(meta)

    def get_finished(self) -> tuple[set[str], set[str]]:
        notified = self._take_notifs() if self._region is not None else []
        finished_recving = self.receiver.step(notified)
        self._prune_load_errors()
        return self.pusher.step(), finished_recving

    def release_held(self, request_ids: list[str]) -> None:
        """The router's release, naming transfer ids: on P, no D took the request (free what is held for
        it); on D, the prefill hop failed (the load fails once P confirms nothing writes)."""
        self.pusher.release(request_ids)
        self.receiver.abandon(request_ids)

    def get_first_token_ids(self) -> dict[str, list[int]]:
        return self.receiver.first_tokens

    def get_recompute_request_ids(self) -> set[str]:
        taken, self.receiver.to_recompute = self.receiver.to_recompute, set()
        return taken

    def num_pending_requests(self) -> int:
        return self.pusher.num_pending() + self.receiver.num_pending()

    def get_stats(self) -> dict[str, Any]:
        return self._stats(self.pusher.num_failures + self.receiver.num_failures,
                           self.pusher.num_quarantined + self.receiver.num_quarantined,
                           self.pusher.num_expirations, self.pusher.num_blocks_held())

    def _shutdown_lifecycle(self) -> None:
        self.pusher.shutdown()
        self.receiver.shutdown()

    # ---- for the lifecycle ----
    def _post_write(self, transfer_id: str, local_block_ids: list[int], remote_block_ids: list[int],
                    remote: RemoteEngine, first_token_ids: tuple[int, ...] = ()) -> tuple[Any, str, int, int]:
        """(handle, state, descriptors, bytes); ValueError when the ids do not fit either cache."""
        local = self._region
        if local is None:
            raise ValueError("KV cache is not registered")
        if not (0 <= min(local_block_ids) and max(local_block_ids) < local.num_blocks):
            raise ValueError(f"local block id out of range [0, {local.num_blocks})")
        if not (0 <= min(remote_block_ids) and max(remote_block_ids) < remote.region.num_blocks):
            raise ValueError(f"the decode instance's block id out of range [0, {remote.region.num_blocks})")
        handle, state, num_descriptors = self._write(transfer_id, remote, local_block_ids, remote_block_ids,
                                                     first_token_ids)
        return handle, state, num_descriptors, len(local_block_ids) * local.block_bytes

    def num_blocks(self) -> int | None:
        """Blocks of this instance's cache (an announce may name no more)."""
        return self._region.num_blocks if self._region is not None else None

    def _count_write(self, send: Send, seconds: float) -> None:
        """P counts what it wrote (it alone times the WRITE); D counts nothing of a push."""
        self.num_bytes += send.num_bytes
        self.num_descriptors += send.num_descriptors
        self.transfer_seconds.observe(seconds)
