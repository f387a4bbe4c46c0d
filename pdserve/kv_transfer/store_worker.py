"""The worker half of the store handoff: READs of a lookup's slots into this instance's blocks, and inserts
(ask for slots, WRITE, commit) of finished prompts, against the pool of `pdserve kv-store`. On the store's
host the pool is mapped here and a READ or WRITE is a copy (store_shm.py); elsewhere it is a NIXL transfer.

Every NIXL call runs on the engine thread (the agent runs without locks); exchanges with the store run on
the StoreClient's threads and are polled here, once per step. What each wait is bounded by:

  handshake   one exchange (RPC_TIMEOUT_S), then mapping the pool where the store offers it on this host
              (on the store client's thread: a pool of many GiB takes a second to map and pin); a failure is
              tried again after HANDSHAKE_RETRY_S, and until it succeeds the store counts as empty (lookups
              and inserts are skipped)
  load        the READ must be done before the lookup's read deadline (send time + lease - margin, so the
              store still pins the slots). Past it, or on a transfer error, the load fails: its blocks are
              invalid and the request recomputes them. A READ past its deadline is aborted; one NIXL cannot
              abort keeps its blocks (quarantined) until it can, as pull's do
  insert      the slots' reply (one exchange), then the WRITE before send time + insert TTL - margin (the
              store reuses the slots after its TTL); finished_sending comes once nothing writes from the
              request's blocks, whatever the outcome: a failed insert costs a later reader a recompute,
              never an error
  liveness    an idle client checks every POOL_CHECK_S that the store still holds the pool it maps, or
              pings (one exchange) a store over NIXL it has not heard from in PING_S: a dead or restarted
              store is forgotten (kv_store_connected 0) and handshaken with again
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.base import KVConnectorWorker
from pdserve.kv_transfer.nixl import new_agent, post_transfer, transfer_state, ucx_tcp_segments
from pdserve.kv_transfer.store import StoreConnectorMeta, StoreInsertSpec, StoreLoadSpec
from pdserve.kv_transfer.store_client import StoreClient, StoreUnreachable, read_margin
from pdserve.kv_transfer.store_shm import CopyHandle, MappedPool, attach
from pdserve.kv_transfer.transport_worker import (Histogram, Region, coalesce, compat_hash, region_of,
                                                   single_kv_cache)

logger = logging.getLogger(__name__)

HANDSHAKE_RETRY_S = 2.0
POOL_CHECK_S = 1.0   # how often a client that maps the pool checks the store still holds it
PING_S = 2.0         # how long a client over NIXL goes without a word from the store before it asks


@dataclass
class Load:
    spec: StoreLoadSpec
    handle: Any
    posted_at: float
    is_cancelled: bool = False


@dataclass
class Insert:
    spec: StoreInsertSpec
    reply: Future | None = None         # the store's slots
    sent_at: float = 0.0
    boot_id: str = ""
    insert_id: str | None = None
    handle: Any = None                  # the WRITE, once posted
    deadline: float = 0.0
    posted_at: float = 0.0
    num_bytes: int = 0
    regroup: dict[str, int] | None = None   # the commit's (store_tp.py)


class StoreConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, Any], client: StoreClient) -> None:
        self.config, self.engine_id, self.client = config, engine_id, client
        self.compat, self.compat_hash = dict(compat), compat_hash(compat)
        self.drop_after_read = bool(config.extra.get("store_drop_after_read", False))
        self.agent_name = f"{engine_id}-{uuid.uuid4().hex[:8]}"
        self.agent = new_agent(self.agent_name, config.enable_prog_thread, "kv_connector store")
        self._kv_cache: torch.Tensor | None = None
        self._reg_descs = None
        self._region: Region | None = None
        self._store: Region | None = None           # the pool, as the handshake described it
        self._store_agent: str | None = None        # connected over NIXL ...
        self._mapped: MappedPool | None = None      # ... or the pool mapped here
        self._pool_checked_at = 0.0
        self._ping: Future | None = None            # a liveness question to the store, of boot _ping_boot
        self._ping_boot: str | None = None
        self._closed = False
        self._closing = threading.Lock()   # shutdown against a handshake mapping the pool on another thread
        self._insert_ttl_s = 0.0
        self._handshake: Future | None = None
        self._handshake_at = float("-inf")
        self._loads: dict[str, Load] = {}
        self._inserts: dict[str, Insert] = {}
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._error_blocks: set[int] = set()
        self._recompute: set[str] = set()
        self.num_bytes = self.num_descriptors = self.num_failures = self.num_quarantined = 0
        self.num_loaded_blocks = self.num_inserted_blocks = 0
        self.transfer_seconds = Histogram()

    # ---- start-up and the store's boot -----------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        kv_cache = single_kv_cache(kv_caches)
        self._kv_cache = kv_cache   # registered memory must outlive its registration
        self._reg_descs = self.agent.register_memory(kv_cache)
        self._region = region_of(kv_cache)
        self._connect()

    def _connect(self) -> None:
        self._handshake_at = time.monotonic()
        result: Future = Future()

        def map_pool(handshake: Future) -> None:   # (the store client's thread)
            try:
                reply, blob = handshake.result()
                region = reply["region"]
                mapped = None if self._closed else self._attach(reply, region)
            except Exception as e:
                result.set_exception(e)
                return
            with self._closing:   # shut down meanwhile: nobody takes the mapping, so it goes here
                if self._closed and mapped is not None:
                    mapped.close()
                    mapped = None
                result.set_result((reply, blob, mapped))

        self.client.handshake({"engine_id": self.engine_id, "compat_hash": self.compat_hash, "compat": self.compat,
                               "block_bytes": self.block_bytes}).add_done_callback(map_pool)
        self._handshake = result

    @property
    def block_bytes(self) -> int:
        """A block's bytes, the whole model's (the store's slot; a tensor-parallel rank holds a part)."""
        return self._region.block_bytes

    def _attach(self, reply: dict[str, Any], region: dict[str, Any]) -> MappedPool | None:
        return attach(reply.get("shared_memory"), reply["boot_id"], region["num_blocks"], region["block_bytes"],
                      self._kv_cache)

    def _connect_store(self, reply: dict[str, Any], blob: bytes, mapped: MappedPool | None) -> MappedPool | None:
        """Where the pool is not mapped here, the store's agent added; the mapping to use (None: NIXL)."""
        if mapped is None:
            theirs, ours = reply.get("ucx_tcp_segments"), ucx_tcp_segments()
            if theirs is not None and theirs != ours:   # (UCX would fail every transfer)
                raise ValueError(f"UCX TCP segment sizes (UCX_TCP_TX_SEG_SIZE/UCX_TCP_RX_SEG_SIZE) differ: "
                                 f"the store's {theirs}, this instance's {ours}")
            self.agent.add_remote_agent(blob)
            self._store_agent = reply["agent_name"]
        return mapped

    def _advance_handshake(self) -> None:
        if self.client.is_ready and self._store is not None:
            self._check_store()
            return
        if self._store is not None:   # the store restarted: once nothing moves to or from the old one
            if self._loads or any(i.handle is not None for i in self._inserts.values()):
                return
            self._disconnect()
        if self._handshake is None:
            if time.monotonic() - self._handshake_at >= HANDSHAKE_RETRY_S:
                self._connect()
            return
        if not self._handshake.done():
            return
        future, self._handshake = self._handshake, None
        self._handshake_at = time.monotonic()   # (the next try waits HANDSHAKE_RETRY_S from this one's end)
        mapped = None
        try:
            reply, blob, mapped = future.result()
            store = Region(**reply["region"])
            mapped = self._connect_store(reply, blob, mapped)
        except Exception as e:
            if mapped is not None:
                mapped.close()
            logger.warning("KV store at %s:%d: handshake failed, lookups and inserts off until it succeeds: %s",
                           *self.client.address, e)
            return
        self._store, self._mapped = store, mapped
        self._insert_ttl_s = float(reply["insert_ttl_s"])
        self.client.set_boot(reply["boot_id"])
        logger.info("KV store at %s:%d: %d slots of %d bytes, %s", *self.client.address, store.num_blocks,
                    store.block_bytes, "mapped here (shared memory)" if mapped is not None else "over NIXL")

    def _check_store(self) -> None:
        """An idle client hears of no restart or death (no reply says stale_boot or fails), so it asks:
        one that maps the pool checks the store still holds it (the pages it maps outlive the store), one
        over NIXL pings a store it has not heard from in PING_S. num_pending_requests makes an idle engine
        step for this, but not while a ping is on its way."""
        boot_id = self.client.boot_id
        if self._mapped is not None:
            if time.monotonic() - self._pool_checked_at >= POOL_CHECK_S:
                self._pool_checked_at = time.monotonic()
                if not self._mapped.is_current():
                    self.client.forget_boot(boot_id, "is gone (its pool with it)")
            return
        if self._ping is None:
            if self._ping_due():
                self._ping, self._ping_boot = self.client.ping(boot_id), boot_id
            return
        if self._ping.done():
            ping, self._ping = self._ping, None
            if isinstance(ping.exception(), StoreUnreachable):   # (a stale_boot reply forgot the boot already)
                self.client.forget_boot(self._ping_boot, "does not answer")

    def _ping_due(self) -> bool:
        return time.monotonic() - self.client.last_answer_at >= PING_S   # (asked only of a client over NIXL)

    def _disconnect(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
        if self._store_agent is not None:
            try:
                self.agent.remove_remote_agent(self._store_agent)
            except Exception as e:
                logger.debug("remove_remote_agent: %s", e)
        self._store = self._store_agent = self._mapped = self._ping = None

    # ---- the contract ----------------------------------------------------------------------------

    def start_load_kv(self, meta: StoreConnectorMeta) -> None:
        for spec in meta.reqs_to_load:
            self._start_load(spec)
        for request_id in meta.reqs_to_cancel:
            if request_id in self._loads:
                self._loads[request_id].is_cancelled = True   # reported once nothing reads into its blocks
        for spec in meta.reqs_to_insert:
            self._start_insert(spec)

    def _start_load(self, spec: StoreLoadSpec) -> None:
        now = time.monotonic()
        if self._store is None or spec.boot_id != self.client.boot_id or now >= spec.read_deadline:
            self._load_failed(spec, "the store's lease ran out (or the store restarted) before the READ")
            return
        try:
            handle = self._xfer("READ", spec.local_block_ids, spec.slots)
        except Exception as e:
            self._load_failed(spec, f"READ could not be posted: {type(e).__name__}: {e}")
            return
        self._loads[spec.request_id] = Load(spec, handle, now)

    def _start_insert(self, spec: StoreInsertSpec) -> None:
        boot_id = self.client.boot_id
        if self._store is None or boot_id is None:
            self._finished_sending.add(spec.request_id)   # nothing stored; the blocks go free
            return
        insert = Insert(spec, sent_at=time.monotonic(), boot_id=boot_id)
        insert.insert_id, insert.reply = self.client.insert(boot_id, spec.hashes)
        self._inserts[spec.request_id] = insert

    def get_finished(self) -> tuple[set[str], set[str]]:
        self._advance_handshake()
        now = time.monotonic()
        for request_id, load in list(self._loads.items()):
            self._advance_load(request_id, load, now)
        for request_id, insert in list(self._inserts.items()):
            self._advance_insert(request_id, insert, now)
        sending, self._finished_sending = self._finished_sending, set()
        recving, self._finished_recving = self._finished_recving, set()
        return sending, recving

    def _state(self, handle: Any) -> str:
        return handle.state() if isinstance(handle, CopyHandle) else transfer_state(self.agent, handle)

    def _released(self, handle: Any) -> bool:
        """Release a transfer (aborting it if active); False: NIXL cannot yet, keep its blocks."""
        try:
            handle.release()
            return True
        except Exception as e:
            logger.warning("NIXL could not release a transfer yet: %s", e)
            return False

    def _advance_load(self, request_id: str, load: Load, now: float) -> None:
        state = self._state(load.handle)
        if state == "PROC" and now < load.spec.read_deadline:
            return
        # Blocks go back only once nothing can write into them: a transfer still moving that NIXL cannot let go
        # yet (past its deadline) keeps them, and is asked again next step. A DONE or ERR one moves no more
        # (a tensor-parallel one only once every part has ended: store_tp._state), whatever its release says.
        if not self._released(load.handle) and state not in ("DONE", "ERR"):
            self.num_quarantined += 1
            return
        del self._loads[request_id]
        spec = load.spec
        if state == "DONE" and time.monotonic() < spec.read_deadline:
            self._finished_recving.add(request_id)
            self.client.release(spec.lease_id, spec.boot_id, drop=self.drop_after_read)
            self.num_loaded_blocks += len(spec.local_block_ids)
            self.num_bytes += len(spec.local_block_ids) * self.block_bytes
            self.transfer_seconds.observe(time.monotonic() - load.posted_at)
            return
        self._load_failed(spec, "READ failed" if state == "ERR" else "READ not done inside the store's lease")

    def _load_failed(self, spec: StoreLoadSpec, why: str) -> None:
        logger.info("request %s recomputes %d blocks the store had: %s", spec.request_id,
                    len(spec.local_block_ids), why)
        self.num_failures += 1
        self._error_blocks.update(spec.local_block_ids)
        self._recompute.add(spec.request_id)
        self._finished_recving.add(spec.request_id)
        self.client.release(spec.lease_id, spec.boot_id)

    def _advance_insert(self, request_id: str, insert: Insert, now: float) -> None:
        if insert.handle is None:
            if not insert.reply.done():
                return
            try:
                reply = insert.reply.result()
            except Exception as e:   # (unanswered: the client aborts it by name)
                logger.info("request %s: not stored: %s", request_id, e)
                self._end_insert(request_id, insert, None)
                return
            try:
                self._post_insert(insert, reply)
            except Exception as e:
                logger.info("request %s: not stored: %s", request_id, e)
                self._end_insert(request_id, insert, "abort")
            return
        state = self._state(insert.handle)
        if state == "PROC" and now < insert.deadline:
            return
        if not self._released(insert.handle) and state not in ("DONE", "ERR"):
            self.num_quarantined += 1   # P's blocks stay: the WRITE may still read them
            return
        if state == "DONE":
            self.num_bytes += insert.num_bytes
            self.transfer_seconds.observe(time.monotonic() - insert.posted_at)
            self.num_inserted_blocks += insert.num_bytes // self.block_bytes
        else:
            self.num_failures += 1
        # A WRITE aborted at its deadline is not aborted at the store: its slots wait out the insert's TTL,
        # in case the transport's abort left anything in flight.
        self._end_insert(request_id, insert, "commit" if state == "DONE" else "abort" if state == "ERR" else None)

    def _post_insert(self, insert: Insert, reply: dict[str, Any]) -> None:
        placed = [(int(i), int(slot)) for i, slot in reply["slots"]]
        spec = insert.spec
        if not placed:
            self._end_insert(spec.request_id, insert, None)   # (nothing pending at the store)
            return
        if insert.boot_id != self.client.boot_id or self._store is None:
            raise RuntimeError("the store restarted")
        if time.monotonic() >= insert.sent_at + self._insert_ttl_s - read_margin(self._insert_ttl_s):
            raise RuntimeError("the store's slots came too late to write them")
        if not all(0 <= i < len(spec.block_ids) for i, _ in placed):
            raise ValueError("the store answered slots for blocks the insert does not have")
        insert.deadline = insert.sent_at + self._insert_ttl_s - read_margin(self._insert_ttl_s)
        insert.handle = self._xfer("WRITE", [spec.block_ids[i] for i, _ in placed], [slot for _, slot in placed])
        insert.regroup = self._write_regroup()
        insert.posted_at = time.monotonic()
        insert.num_bytes = len(placed) * self.block_bytes

    def _end_insert(self, request_id: str, insert: Insert, outcome: str | None) -> None:
        """P's blocks go free; outcome: commit, abort, or None (nothing to tell the store)."""
        self._inserts.pop(request_id, None)
        self._finished_sending.add(request_id)
        if outcome is not None:
            self.client.end_insert(outcome, insert.boot_id, insert.insert_id,
                                   insert.regroup if outcome == "commit" else None)

    def _write_regroup(self) -> dict[str, int] | None:
        """What the store must do to a WRITE's slots before they are read (store_tp.py); here nothing."""
        return None

    def _xfer(self, op: str, local_block_ids: list[int], slots: list[int]) -> Any:
        store, local = self._store, self._region
        if not slots or len(slots) != len(local_block_ids):
            raise ValueError("a transfer needs one slot per block")
        if not (0 <= min(slots) and max(slots) < store.num_blocks):
            raise ValueError(f"a store slot out of range [0, {store.num_blocks})")
        if not (0 <= min(local_block_ids) and max(local_block_ids) < local.num_blocks):
            raise ValueError(f"a local block id out of range [0, {local.num_blocks})")
        runs = coalesce(local_block_ids, slots)
        handle, num_descriptors = self._move(op, runs, local_block_ids, slots)
        self.num_descriptors += num_descriptors
        return handle

    def _move(self, op: str, runs: list[tuple[int, int, int]], local_block_ids: list[int],
              slots: list[int]) -> tuple[Any, int]:
        """(the transfer's handle, NIXL descriptors or copies it took)."""
        if self._mapped is not None:
            return self._mapped.copy(op, runs), len(runs)
        handle, state = post_transfer(self.agent, op, self._region, self._store, self._store_agent, runs, b"")
        if state == "ERR":
            handle.release()
            raise RuntimeError(f"NIXL refused the {op}")
        return handle, len(runs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        error_blocks, self._error_blocks = self._error_blocks, set()
        return error_blocks

    def get_recompute_request_ids(self) -> set[str]:
        taken, self._recompute = self._recompute, set()
        return taken

    def num_pending_requests(self) -> int:
        # The handshake, and a due check that the store lives, count too: an idle engine steps for them (it
        # calls get_finished only in a step), so that it notices a dead store and lets its pool go.
        # (A handshake on its way does not: the engine would step every millisecond for as long as a hung
        # store takes to time out.)
        return (len(self._loads) + len(self._inserts) + len(self._finished_sending) + len(self._finished_recving)
                + (self._handshake is not None and self._handshake.done()) + self._store_check_due())

    def _store_check_due(self) -> bool:
        if self._store is None:   # a handshake to try again (the store was down): due once it may be
            return self._handshake is None and time.monotonic() - self._handshake_at >= HANDSHAKE_RETRY_S
        if not self.client.is_ready:   # the store is gone: let its pool go once nothing moves
            return True
        if self._mapped is not None:
            return time.monotonic() - self._pool_checked_at >= POOL_CHECK_S
        return self._ping.done() if self._ping is not None else self._ping_due()

    def num_blocks_held(self) -> int:
        return (sum(len(i.spec.block_ids) for i in self._inserts.values())
                + sum(len(load.spec.local_block_ids) for load in self._loads.values()))

    def get_stats(self) -> dict[str, Any]:
        return {
            "kv_transfer_bytes_total": self.num_bytes,
            "kv_transfer_descriptors_total": self.num_descriptors,
            "kv_transfer_failures_total": self.num_failures,
            "kv_transfer_quarantined_total": self.num_quarantined,
            "kv_lease_expirations_total": 0,
            "num_blocks_held_for_transfer": self.num_blocks_held(),
            "kv_transfer_seconds": self.transfer_seconds.to_dict(),
            "kv_store_loaded_blocks_total": self.num_loaded_blocks,
            "kv_store_inserted_blocks_total": self.num_inserted_blocks,
            "kv_store_errors_total": self.client.num_errors,
            "kv_store_connected": int(self.client.is_ready),
            "kv_store_shared_memory": int(self._mapped is not None),
            "kv_store_lookups_total": self.client.num_lookups,
            "kv_store_hits_total": self.client.num_hits,
        }

    def shutdown(self) -> None:
        with self._closing:   # a handshake still under way maps nothing more, or lets its mapping go
            self._closed = True
            handshake = self._handshake
            if handshake is not None and handshake.done():
                self._handshake = None
        if handshake is not None and handshake.done() and handshake.exception() is None:
            _, _, mapped = handshake.result()   # (mapped before shutdown began, never taken)
            if mapped is not None:
                mapped.close()
        deadline = time.monotonic() + 5.0
        while (self._loads or self._inserts) and time.monotonic() < deadline:
            self.get_finished()
            time.sleep(0.005)
        self.client.close()
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        self._deregister_cache()

    def _deregister_cache(self) -> None:
        if self._reg_descs is not None:
            self.agent.deregister_memory(self._reg_descs)
            self._reg_descs = None
