"""The store handoff for tensor-parallel instances: every rank moves its own KV heads to and from the pool.

The pool keeps one layout, the whole model's ([layers, 2, slots, heads, dim] per slot, what an instance of one
rank holds), so that instances of every tensor-parallel size share what they store. A rank r of T holds
heads r*H/T .. (r+1)*H/T of each block, strided in a slot, so:

  mapped    on the store's host each rank maps the pool (shared memory) and copies its heads between its
            blocks and that column of the slots (store_shm.py, part (r, T)): any size, no extra bytes.
            Rank 0 maps it on the store client's thread, as one rank does; ranks 1..T-1 when rank 0's
            handshake completes (one call, on the engine thread). If any rank cannot map it, none does.
  READ      over NIXL, each rank reads the lookup's slots whole into a staging buffer and copies its heads
            out (RankReader's staged READ of a one-rank P): T times the bytes on the link.
  WRITE     over NIXL, each rank writes its blocks whole into the r-th part of each run of the insert's slots
            (grouped_layout, as a push into a D of fewer ranks), and the commit asks the store to regroup
            the slots before they become visible (kv_store/server.py). A commit that does not arrive leaves
            the blocks pending, never readable in the grouped layout.

The rest (the handshake, leases, inserts, lookups, every deadline and way out) is the one-rank worker half's
(store_worker.py), on rank 0; only these transport hooks fan out to ranks 1..T-1, through the tensor-parallel
executor's calls between steps (worker/tp_executor.py, RankCalls), as the NIXL handoffs do (nixl_tp.py).
A transfer is done when every rank's part is; one that failed to post on some rank never counts as done.
"""
from __future__ import annotations

import base64
import logging
from typing import Any

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.nixl_tp import Ranks, RankTransfers, _TPHandle, combine
from pdserve.kv_transfer.store_client import StoreClient
from pdserve.kv_transfer.store_shm import MappedPool, attach
from pdserve.kv_transfer.store_worker import StoreConnectorWorker
from pdserve.kv_transfer.transport_worker import single_kv_cache

logger = logging.getLogger(__name__)


class TPStoreConnectorWorker(RankTransfers, StoreConnectorWorker):
    """Rank 0's worker half of a tensor-parallel instance with `--kv-connector store`."""

    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, Any], client: StoreClient,
                 ranks: Ranks, num_kv_heads: int) -> None:
        super().__init__(config, engine_id, compat, client)
        self.ranks, self.tp_size = ranks, ranks.size
        self._key: str | None = None              # the store's agent on every rank (over NIXL)
        self._ranks_mapped = False
        self._rank_states: list[dict[int, str]] = []
        self._init_ranks(ranks, num_kv_heads, False)

    # ---- start-up and the store's boot -----------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        self.local.check_staging_bytes(single_kv_cache(kv_caches))   # (before the ranks refuse it less plainly)
        self._call("kv_register")   # (before rank 0's handshake, which may map the pool on every rank)
        super().register_kv_caches(kv_caches)
        self.local.adopt(self._kv_cache, self._region)

    @property
    def block_bytes(self) -> int:
        return self._region.block_bytes * self.tp_size

    def _attach(self, reply: dict[str, Any], region: dict[str, Any]) -> MappedPool | None:
        return attach(reply.get("shared_memory"), reply["boot_id"], region["num_blocks"], region["block_bytes"],
                      self._kv_cache, (0, self.tp_size))

    def _connect_store(self, reply: dict[str, Any], blob: bytes, mapped: MappedPool | None) -> MappedPool | None:
        region = reply["region"]
        if mapped is not None:
            args = (reply.get("shared_memory"), reply["boot_id"], region["num_blocks"], region["block_bytes"])
            try:
                ok = all(self._call("kv_store_attach", [args] * (self.tp_size - 1)))
            except Exception as error:
                logger.warning("KV store: a rank could not map the pool: %s", error)
                ok = False
            if not ok:   # all or none: KV moves over NIXL
                self._call_quietly("kv_store_detach")
                mapped.close()
                mapped = None
            self._ranks_mapped = ok
        if mapped is None:
            super()._connect_store(reply, blob, None)
            key = f"store:{reply['boot_id']}"
            entry = {"agent_name": self._store_agent, "region": region, "metadata": None}
            try:
                self.local.connect(key, [entry])
                self._call("kv_connect", [(key, [{**entry, "metadata": base64.b64encode(blob).decode()}])]
                           * (self.tp_size - 1))
            except Exception:
                self.local.disconnect(key, keep_first=True)
                self._call_quietly("kv_disconnect", [(key, False)] * (self.tp_size - 1))
                self.agent.remove_remote_agent(self._store_agent)
                self._store_agent = None
                raise
            self._key = key
        return mapped

    def _disconnect(self) -> None:
        if self._ranks_mapped:
            self._call_quietly("kv_store_detach")
            self._ranks_mapped = False
        if self._key is not None:
            self.local.disconnect(self._key, keep_first=True)
            self._call_quietly("kv_disconnect", [(self._key, False)] * (self.tp_size - 1))
            self._key = None
        super()._disconnect()

    # ---- transfers -------------------------------------------------------------------------------

    def _move(self, op: str, runs: list[tuple[int, int, int]], local_block_ids: list[int],
              slots: list[int]) -> tuple[Any, int]:
        if self._mapped is not None:
            handle = self._mapped.copy(op, runs)
            try:
                self._call("kv_store_copy", [(op, runs)] * (self.tp_size - 1))   # (done when it returns)
            except Exception:
                handle.release()   # (waits out rank 0's copy: its blocks may go back to the pool)
                raise
            return handle, len(runs) * self.tp_size
        handle, _ = self._post_on_ranks(f"(a store {op})", self._key, local_block_ids, slots, op)
        return handle, handle.num_descriptors   # (a part that failed to post: ERR at the next check)

    def _write_regroup(self) -> dict[str, int] | None:
        if self._mapped is not None:
            return None   # (each rank copied its heads into place)
        shape = self._kv_cache.shape
        return {"parts": self.tp_size, "outer": shape[1] * shape[2] * shape[3]}

    def get_finished(self) -> tuple[set[str], set[str]]:
        # One round to the ranks a step, and only while a NIXL transfer of theirs may be in flight: every
        # check of one (_state) reads this step's poll.
        in_flight = any(isinstance(load.handle, _TPHandle) for load in self._loads.values()) or any(
            isinstance(insert.handle, _TPHandle) for insert in self._inserts.values())
        self._rank_states = self._call("kv_poll", [(False,)] * (self.tp_size - 1)) if in_flight else []
        return super().get_finished()

    def _state(self, handle: Any) -> str:
        """A tensor-parallel transfer's state. One whose part failed (to post, or on the way) is ERR only once no
        other part still moves: until then its blocks, and at the store its slots, may still be written
        (the deadline then lets every part go, and a part NIXL cannot abort keeps them: _released)."""
        if not isinstance(handle, _TPHandle):
            return super()._state(handle)
        rank_states = self._rank_states or [{}] * (self.tp_size - 1)
        parts = [self.local.state_of(handle.read_ids[0])] if handle.read_ids[0] is not None else []
        parts += [states.get(read_id, "PROC") for states, read_id in zip(rank_states, handle.read_ids[1:])
                  if read_id is not None]
        if handle.erred:
            return "PROC" if "PROC" in parts else "ERR"
        return combine(parts)

    def _released(self, handle: Any) -> bool:
        if not isinstance(handle, _TPHandle):
            return super()._released(handle)
        try:
            self._release(handle)
            return True
        except Exception as e:
            logger.warning("NIXL could not release a transfer yet: %s", e)
            return False

    def _deregister_cache(self) -> None:
        self.local.deregister()   # rank 0's transfers and staging buffers before the cache they point into
        super()._deregister_cache()
        self._call_quietly("kv_deregister")
