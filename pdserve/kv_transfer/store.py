"""The scheduler half of the store handoff (`--kv-connector store`): P inserts its prompt's blocks into a KV
pool shared by every instance (`pdserve kv-store`), and any instance looks a prompt's blocks up there.

Blocks are named by the prefix cache's chained hash (request.block_hashes), so a lookup finds the longest
run of a prompt's blocks that any instance stored: P's prompt for the D it was sent to, and a returning
conversation's history for whichever instance gets its next turn (seed 004, 四.2.3).

  every request, on any instance:
    0. request_added: the prompt's full blocks are hashed and looked up at once, so the answer is usually
       back before the scheduler reaches the request
    1. get_num_new_matched_tokens → None (not known yet) while the lookup runs; then (the stored run's
       tokens beyond the local prefix-cache hit, load_async=True), or (0, False) on a miss or any store
       error: the store is a cache, never a reason to fail a request
    2. update_state_after_alloc → StoreLoadSpec: READ these slots into these blocks under the lookup's
       lease; the request parks in WAITING_FOR_REMOTE_KVS
    3. the worker half reports it in finished_recving; a READ that failed or could not finish inside the
       lease marks its blocks invalid and the request recomputes them (get_recompute_request_ids)
  on D, a request with kv_transfer_params {"do_remote_prefill": true, "num_remote_tokens": N} (from P's
  answer, through the router): the lookup waits up to store_wait_seconds for P's N tokens to be stored
  (P answers the router before its insert has landed)
  on P (producer or both), when a request finishes normally:
    4. request_finished → delay_free=True and a StoreInsertSpec: the worker half asks the store for slots
       (blocks already stored are skipped), WRITEs, commits, and reports finished_sending whatever the
       outcome; for a do_remote_decode request the params name P's computed tokens for D
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.hashing import hash_prompt_blocks
from pdserve.kv_transfer.base import ConnectorMeta, KVConnectorScheduler, KVTransferParams
from pdserve.kv_transfer.store_client import LookupResult, StoreClient

if TYPE_CHECKING:
    from pdserve.core.batch import SchedulerOutput
    from pdserve.core.request import Request

logger = logging.getLogger(__name__)

DEFAULT_WAIT_S = 10.0   # D: how long a lookup waits for P's insert (P's engine takes two steps to land it)
LOOKUP_GRACE_S = 2.0    # past its deadline a lookup not answered yet is a miss (a store that stalls)
# The engine thread may wait this long per step, in all, for lookups sent at admission: the answer (one local
# round trip) usually lands within it, and a request that misses it waits a whole step (measured on CPU:
# TTFT p50 841 → 1,030 ms with the store on a multi-turn workload when every request waited a step).
STEP_WAIT_S = 0.005


@dataclass(frozen=True)
class StoreLoadSpec:
    """READ the store's slots[i] into local_block_ids[i], before read_deadline (monotonic)."""
    request_id: str
    lease_id: str
    boot_id: str
    local_block_ids: list[int]
    slots: list[int]
    read_deadline: float


@dataclass(frozen=True)
class StoreInsertSpec:
    """WRITE block_ids[i] into the store under hashes[i] (the prompt's full blocks, in chain order)."""
    request_id: str
    hashes: list[int]
    block_ids: list[int]


@dataclass
class StoreConnectorMeta(ConnectorMeta):
    reqs_to_load: list[StoreLoadSpec] = field(default_factory=list)
    reqs_to_insert: list[StoreInsertSpec] = field(default_factory=list)
    reqs_to_cancel: set[str] = field(default_factory=set)


class StoreConnectorScheduler(KVConnectorScheduler):
    def __init__(self, engine_id: str, block_size: int, client: StoreClient, is_producer: bool,
                 hash_extra: str, wait_s: float = DEFAULT_WAIT_S) -> None:
        self.engine_id, self.block_size, self.client = engine_id, block_size, client
        self.is_producer, self.hash_extra, self.wait_s = is_producer, hash_extra, wait_s
        self._meta = StoreConnectorMeta()
        # request id → (lookup, give-up time, whether the engine may wait for it a little: not for D's wait)
        self._lookups: dict[str, tuple[Future, float, bool]] = {}
        self._found: dict[str, LookupResult] = {}     # request id → a hit, until its blocks are allocated
        self._step_wait_left = STEP_WAIT_S

    def _prompt_hashes(self, request: "Request") -> list[int]:
        """The prompt's full blocks' hashes, the KV cache manager's own (same function, same extra)."""
        num_blocks = request.num_prompt_tokens // self.block_size
        if len(request.block_hashes) < num_blocks:
            request.block_hashes = hash_prompt_blocks(request.prompt_token_ids, self.block_size,
                                                      self.hash_extra, request.block_hashes)
        return request.block_hashes[:num_blocks]

    def request_added(self, request: "Request") -> None:
        params = KVTransferParams.from_dict(request.kv_transfer_params)
        expected = 0
        if params is not None and params.do_remote_prefill:
            expected = (params.num_remote_tokens or 0) // self.block_size
        self._look_up(request, expected)

    def _look_up(self, request: "Request", expected: int) -> None:
        if not self.client.is_usable:
            return
        hashes = self._prompt_hashes(request)
        if not hashes:
            return
        deadline = time.monotonic() + (self.wait_s if expected else 0.0)
        self._lookups[request.request_id] = (self.client.lookup(hashes, min(expected, len(hashes)), deadline),
                                             deadline + LOOKUP_GRACE_S, expected == 0)
        self.client.num_lookups += 1

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        request_id = request.request_id
        if request_id in self._found:   # (asked again after an allocation failed)
            if time.monotonic() < self._found[request_id].read_deadline:
                return self._matched(request, self._found[request_id], num_computed_tokens)
            self._drop_found(request_id)   # queued past its lease: look it up again
            self._look_up(request, 0)
            return (None, False) if request_id in self._lookups else (0, False)
        future, give_up_at, is_quick = self._lookups.get(request_id, (None, 0.0, False))
        if future is None:
            return 0, False
        if num_computed_tokens >= request.num_prompt_tokens // self.block_size * self.block_size:
            self._forget(request_id)   # the local prefix cache holds every block the store could
            return 0, False
        if not future.done() and is_quick and self._step_wait_left > 0:
            start = time.monotonic()
            try:
                future.exception(timeout=self._step_wait_left)
            except TimeoutError:
                pass
            self._step_wait_left -= time.monotonic() - start
        if not future.done():
            if time.monotonic() < give_up_at:
                return None, False
            self._forget(request_id)   # a store that stalls costs this request its hit, not its time
            return 0, False
        del self._lookups[request_id]
        try:
            result = future.result()
        except Exception as e:  # (StoreError: logged by the client's caller once per failure kind)
            logger.debug("request %s: store lookup failed: %s", request_id, e)
            return 0, False
        if not result.slots:
            return 0, False
        self.client.num_hits += 1
        self._found[request_id] = result
        return self._matched(request, result, num_computed_tokens)

    def _matched(self, request: "Request", result: LookupResult, num_computed_tokens: int) -> tuple[int, bool]:
        num_tokens = min(len(result.slots) * self.block_size, request.num_prompt_tokens) - num_computed_tokens
        if num_tokens <= 0:  # the local prefix cache has it all
            self._drop_found(request.request_id)
            return 0, False
        return num_tokens, True

    def _drop_found(self, request_id: str) -> None:
        result = self._found.pop(request_id, None)
        if result is not None:
            self.client.release(result.lease_id, result.boot_id)

    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        result = self._found.pop(request.request_id, None)
        if result is None or num_external_tokens == 0:
            if result is not None:
                self.client.release(result.lease_id, result.boot_id)
            return
        first = request.num_computed_tokens // self.block_size
        last = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        self._meta.reqs_to_load.append(StoreLoadSpec(
            request.request_id, result.lease_id, result.boot_id, list(block_ids[first:last]),
            result.slots[first:last], result.read_deadline))
        request.kv_transfer_params = None  # consumed: a preempted request recomputes

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> StoreConnectorMeta:
        meta, self._meta = self._meta, StoreConnectorMeta()
        self._step_wait_left = STEP_WAIT_S
        return meta

    def _forget(self, request_id: str) -> None:
        """The request will not load: unpin whatever its lookup found, now or when the lookup answers."""
        self._drop_found(request_id)
        future, _, _ = self._lookups.pop(request_id, (None, 0.0, False))
        if future is not None:
            future.add_done_callback(self._release_result)

    def _release_result(self, future: Future) -> None:
        if future.exception() is None:
            result = future.result()
            self.client.release(result.lease_id, result.boot_id)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        if not self.is_producer or request.status.name in ("FINISHED_ABORTED", "FINISHED_ERROR"):
            return False, None
        num_blocks = min(request.num_prompt_tokens, request.num_computed_tokens) // self.block_size
        hashes = self._prompt_hashes(request)[:num_blocks]
        delay_free = bool(hashes) and self.client.is_usable
        if delay_free:
            self._meta.reqs_to_insert.append(StoreInsertSpec(request.request_id, hashes,
                                                             list(block_ids[:len(hashes)])))
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_decode")):
            return delay_free, None
        host, port = self.client.address
        return delay_free, KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.engine_id, remote_request_id=request.request_id,
            remote_host=host, remote_port=port, transfer_id=params.get("transfer_id"),
            num_remote_tokens=len(hashes) * self.block_size if delay_free else 0).to_dict()

    def request_aborted_while_loading(self, request: "Request") -> None:
        self._meta.reqs_to_cancel.add(request.request_id)
