"""The `nixl-push` handoff for tensor-parallel instances, of the same size or not.

Each rank's KV cache holds its own KV heads, in its own process (and GPU), and each P rank WRITEs its heads
of the prompt's blocks into the D ranks that hold them (nixl_tp.RankReader, which also reads for pull):

  same size     P's rank r writes into D's rank r, which holds the same heads: one descriptor per block run
                per rank, as with one rank.
  P has more    k = Tp / Td P ranks hold one D rank's heads, each a contiguous k-th of every slot there, so
                strided in D's blocks. Each of them writes its blocks whole into its k-th of each run of
                D's blocks (tp_layout.grouped_layout): one descriptor per run per P rank. Once every P rank's
                WRITE is in, each D rank puts the heads back in their places (RankReader.regroup, a copy of
                the run through a buffer the size of the run) before D reports the load.
  D has more    a P rank's heads cover k = Td / Tp D ranks: it copies each one's heads of the blocks into its
                staging pool (staging.py) and writes those into that D rank's blocks as they stand: one
                descriptor per run per D rank, nothing for D to do; in rounds when the pool is smaller
                than the transfer, the notification with the last round.

Every P rank's WRITE to every D rank carries a notification (push_lifecycle.write_notif) naming the
transfer, P's first token and the writing rank of how many; a D rank's data is in once the notifications
of every P rank writing into it have come, so D counts a push done when it holds max(Tp, Td) distinct
(D rank, P rank) pairs: rank 0's from its own agent, ranks 1..T-1's through the step's one poll of the
ranks (made only while a push is under way on either side). A count whose last notifications never come
(the WRITE failed on some rank: P says push_failed, or D's wait runs out) is dropped once D can no longer
be waiting for it (NOTIF_TTL_S at least).

The lifecycle (announce, leases, heartbeats, push_failed) stays whole on rank 0 (push_lifecycle.py); only
the transport hooks fan out (nixl_tp.RankFanOut). A one-rank instance uses this worker too (ranks None), so
that it can push to, or be pushed to by, a tensor-parallel one. Sizes of which neither divides the other are
refused at P's handshake naming both, and by the router and `pdserve up` at their start.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.nixl import NixlPushConnectorWorker
from pdserve.kv_transfer.nixl_tp import RankFanOut, Ranks
from pdserve.kv_transfer.push_lifecycle import WriteNotif, read_notif, write_notif
from pdserve.kv_transfer.transport_worker import Region, RemoteEngine

logger = logging.getLogger(__name__)

NOTIF_TTL_S = 120.0


@dataclass
class _Arrivals:
    """D: the notifications of one transfer so far."""
    first_at: float
    expected: int                    # max(Tp, Td): one per (D rank, P rank writing into it)
    p_tp_size: int
    notif: WriteNotif
    pairs: set[tuple[int, int]] = field(default_factory=set)   # (D rank, P rank)


class TPNixlPushConnectorWorker(RankFanOut, NixlPushConnectorWorker):
    """Rank 0's push worker half of a tensor-parallel instance, or a one-rank instance's (ranks None)."""

    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, str | int],
                 ranks: Ranks | None, num_kv_heads: int) -> None:
        self.ranks = ranks
        self.tp_size = ranks.size if ranks is not None else 1
        self._rank_states: list[dict[int, str]] = []
        self._rank_notifs: list[list[str]] = []       # ranks 1..T-1's, from the step's poll
        self._notified: dict[str, _Arrivals] = {}     # transfer id → its notifications so far
        super().__init__(config, engine_id, compat)
        self._init_ranks(ranks, num_kv_heads, False)

    def _check_remote_region(self, region: Region, reply: dict[str, Any], engine_id: str) -> None:
        self._check_tp_pair(region, reply, engine_id)

    def _write(self, transfer_id: str, remote: RemoteEngine, local_block_ids: list[int],
               remote_block_ids: list[int], first_token_ids: tuple[int, ...]) -> tuple[Any, str, int]:
        """Every rank's WRITE (each coalesces its own runs); every rank's descriptors."""
        notifs = [write_notif(transfer_id, first_token_ids, rank, self.tp_size) for rank in range(self.tp_size)]
        handle, state = self._post_ranks(transfer_id, remote, local_block_ids, remote_block_ids, "WRITE", notifs)
        return handle, state, handle.num_descriptors

    def _post_write(self, transfer_id: str, local_block_ids: list[int], remote_block_ids: list[int],
                    remote: RemoteEngine, first_token_ids: tuple[int, ...] = ()) -> tuple[Any, str, int, int]:
        """Every rank's bytes (each rank writes its heads, whatever D's size)."""
        handle, state, num_descriptors, num_bytes = super()._post_write(
            transfer_id, local_block_ids, remote_block_ids, remote, first_token_ids)
        return handle, state, num_descriptors, num_bytes * self.tp_size

    def get_finished(self) -> tuple[set[str], set[str]]:
        if self._region is not None and (self.pusher.num_pending() or self.receiver.num_pending()):
            polled = self._call("kv_poll_writes", [()] * (self.tp_size - 1))
            self._rank_states = [states for states, _ in polled]
            # (added to, not replaced: what an earlier poll brought stays until _take_notifs has counted it)
            self._rank_notifs = [mine + new for mine, (_, new) in itertools.zip_longest(
                self._rank_notifs, polled, fillvalue=[])]
        else:
            self._rank_states = []
        return super().get_finished()

    def _take_notifs(self) -> list[WriteNotif]:
        now = time.monotonic()
        done = []
        arrived = [(0, super()._take_notifs()), *enumerate(self._rank_notifs, start=1)]
        self._rank_notifs = []   # (counted below; rank 0's call above raised otherwise, and they stay)
        for d_rank, messages in arrived:
            for message in messages:
                notif = read_notif(message)
                if notif is None:
                    logger.warning("push: a WRITE notification that is not a transfer's: %.80r", message)
                    continue
                if not self._pairs_with(notif.tp_size):   # never a sign that every rank's data is in
                    logger.warning("push of %s: a notification from a P of %d ranks, which cannot write into "
                                   "%d; ignored", notif.transfer_id, notif.tp_size, self.tp_size)
                    continue
                entry = self._notified.setdefault(notif.transfer_id, _Arrivals(
                    now, max(notif.tp_size, self.tp_size), notif.tp_size, notif))
                entry.pairs.add((d_rank, notif.rank))
                if len(entry.pairs) >= entry.expected:
                    del self._notified[notif.transfer_id]
                    if self._regroup(notif.transfer_id, entry.p_tp_size):
                        done.append(entry.notif)
        if self._notified:   # kept as long as D may still wait for the push (Receiver's wait and lease)
            ttl = max(NOTIF_TTL_S, self.receiver.wait_timeout + self.receiver.lease_s)
            self._notified = {t: e for t, e in self._notified.items() if now - e.first_at < ttl}
        return done

    def _pairs_with(self, p_tp_size: int) -> bool:
        return max(p_tp_size, self.tp_size) % min(p_tp_size, self.tp_size) == 0

    def _regroup(self, transfer_id: str, p_tp_size: int) -> bool:
        """Every D rank puts the heads a bigger P wrote back in place; False (the load failed, its blocks
        invalid) when a rank could not."""
        if p_tp_size <= self.tp_size:
            return True
        recv = self.receiver.by_transfer(transfer_id)
        if recv is None:
            return True   # (not waited for here: nothing reads those blocks)
        block_ids, k = list(recv.spec.local_block_ids), p_tp_size // self.tp_size
        try:
            self.local.regroup(block_ids, k)
            self._call("kv_regroup", [(block_ids, k)] * (self.tp_size - 1))
        except Exception as error:
            logger.warning("push of %s: regrouping the KV heads failed: %s: %s", transfer_id,
                           type(error).__name__, error)
            self.receiver.fail(recv, "the pushed KV could not be put in place on the decode instance")
            return False
        return True
