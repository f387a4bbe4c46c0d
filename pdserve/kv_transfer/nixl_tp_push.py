"""The `nixl-push` handoff between tensor-parallel instances of the same size.

P's rank r WRITEs its heads of the prompt's blocks into D's rank r, which holds the same heads (one descriptor
per block run per rank, as with one rank), and every rank's WRITE carries the same NIXL notification (the
transfer id and P's first token, push_lifecycle.write_notif) to its D rank. A rank's data is in its blocks
once its own notification has come, so D counts a push done only when every rank's has: rank 0's from its own
agent, ranks 1..T-1's through the step's one poll of the ranks (made only while a push is under way on either
side). A count whose last notifications never come (the WRITE failed on some rank: P says push_failed, or D's
wait runs out) is dropped once D can no longer be waiting for it (NOTIF_TTL_S at least).

The lifecycle (announce, leases, heartbeats, push_failed) stays whole on rank 0 (push_lifecycle.py); only
the transport hooks fan out (nixl_tp.RankFanOut). Between sizes, one rank's heads are strided in the
other's blocks: pull regroups them on D through a staging buffer (nixl_tp.py), a push would need D to stage
for P, which is not built. P refuses a D of another size at the handshake, naming both sizes; the router
and `pdserve up` refuse such a pair at their start.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.nixl import NixlPushConnectorWorker
from pdserve.kv_transfer.nixl_tp import RankFanOut, Ranks
from pdserve.kv_transfer.transport_worker import Region, RemoteEngine, check_same_tp_size

NOTIF_TTL_S = 120.0


class TPNixlPushConnectorWorker(RankFanOut, NixlPushConnectorWorker):
    """Rank 0's push worker half of a tensor-parallel instance."""

    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, str | int], ranks: Ranks,
                 num_kv_heads: int) -> None:
        self.ranks, self.tp_size = ranks, ranks.size
        self._rank_states: list[dict[int, str]] = []
        self._rank_notifs: list[list[str]] = []                     # ranks 1..T-1's, from the step's poll
        self._notified: dict[str, tuple[set[int], float]] = {}    # notification → (ranks notified, first at)
        super().__init__(config, engine_id, compat)
        self._init_ranks(ranks, num_kv_heads, False)

    def _check_remote_region(self, region: Region, reply: dict[str, Any], engine_id: str) -> None:
        check_same_tp_size(self.tp_size, reply, engine_id)
        # (past NixlPushConnectorWorker's own check, which is for one rank: to the block size's)
        super(NixlPushConnectorWorker, self)._check_remote_region(region, reply, engine_id)

    def _write(self, transfer_id: str, remote: RemoteEngine, runs: list[tuple[int, int, int]],
               notif: str) -> tuple[Any, str]:
        local = [start + i for start, _, n in runs for i in range(n)]
        theirs = [start + i for _, start, n in runs for i in range(n)]
        return self._post_ranks(transfer_id, remote, local, theirs, "WRITE", notif)   # one notif, every rank

    def _post_write(self, transfer_id: str, local_block_ids: list[int], remote_block_ids: list[int],
                    remote: RemoteEngine, notif: str) -> tuple[Any, str, int, int]:
        """Every rank's descriptors and bytes (each rank writes its heads)."""
        handle, state, _, num_bytes = super()._post_write(transfer_id, local_block_ids, remote_block_ids, remote,
                                                          notif)
        return handle, state, handle.num_descriptors, num_bytes * self.tp_size

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

    def _take_notifs(self) -> list[str]:
        now = time.monotonic()
        done = []
        arrived = [(0, super()._take_notifs()), *enumerate(self._rank_notifs, start=1)]
        self._rank_notifs = []   # (counted below; rank 0's call above raised otherwise, and they stay)
        for rank, transfer_ids in arrived:
            for transfer_id in transfer_ids:
                ranks, _ = self._notified.setdefault(transfer_id, (set(), now))
                ranks.add(rank)
                if len(ranks) == self.tp_size:
                    del self._notified[transfer_id]
                    done.append(transfer_id)
        if self._notified:   # kept as long as D may still wait for the push (Receiver's wait and lease)
            ttl = max(NOTIF_TTL_S, self.receiver.wait_timeout + self.receiver.lease_s)
            self._notified = {t: e for t, e in self._notified.items() if now - e[1] < ttl}
        return done
