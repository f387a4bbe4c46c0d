"""Continuous batching over a paged KV cache.

The scheduler speaks "tokens to catch up", not phases: each step a request gets
    num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
so a prompt is a request far behind (possibly split into chunks) and a decode is one token behind.

One step:
  1. running requests first (decodes and unfinished prompt chunks), in arrival order; when blocks
     run out the newest running request is preempted (its blocks freed, recomputed later)
  2. then waiting requests, oldest first, while budget, sequence slots and blocks last; a waiting
     request first takes its prefix-cache hit and asks the connector for external tokens; an async
     load parks it in WAITING_FOR_REMOTE_KVS (blocks allocated, no compute) until the connector
     reports it in finished_recving
  3. update_from_output advances computed tokens, appends sampled tokens, finishes requests, and
     applies the connector's report (finished_sending frees P's held blocks; finished_recving
     promotes D's loaded requests; load errors follow kv_load_failure_policy)
  4. a step that raises (engine/engine_core.py) instead ends in fail_requests: that step's requests,
     and those of the step in flight, finish with FINISHED_ERROR through the normal finish path

Async scheduling (the engine schedules step N+1 while the device runs step N): a request's tokens in
a step whose outputs have not landed count as computed (num_inflight_tokens), and the token that step
samples counts as known (num_inflight_samples) though its id is not: it goes out as
PLACEHOLDER_TOKEN_ID and the model runner fills it in on the device. A request that will have reached
max_tokens once its in-flight step lands is not scheduled again; one that stops on a token, a stop
string or an abort meanwhile had one wasted step, whose result update_from_output drops. With
nothing in flight (the synchronous engine) all of this reduces to the plain rules above.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.config import SchedulerConfig
from pdserve.core.batch import (PLACEHOLDER_TOKEN_ID, KVConnectorOutput, ModelRunnerOutput, ScheduledRequest,
                                SchedulerOutput)
from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.core.request import Request, RequestStatus
from pdserve.kv_transfer.base import KVConnectorScheduler


@dataclass
class RequestUpdate:
    """What one step did to a request, for the engine to turn into a RequestOutput."""
    request: Request
    new_token_ids: list[int]
    kv_transfer_params: dict | None = None
    is_remote: bool = False   # new_token_ids are P's, not sampled here (the router's rates count only those)

    @property
    def finished(self) -> bool:
        return self.request.is_finished


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 connector: KVConnectorScheduler | None = None,
                 kv_load_failure_policy: str = "fail") -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.connector = connector
        self.kv_load_failure_policy = kv_load_failure_policy
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held_for_transfer: dict[str, Request] = {}  # P: finished, blocks kept for a reader
        self.aborted_while_loading: dict[str, Request] = {}  # blocks kept until the load ends
        self._finished_ids: set[str] = set()            # tell the runner to drop state
        self._dropped_sample_ids: set[str] = set()      # tell the runner to rewind generators
        self.num_preemptions = 0
        self._updates: list[RequestUpdate] = []         # finishes decided outside a step
        # Async scheduling: blocks of requests finished while a step that writes them was in
        # flight; freed when the next step lands.
        self._free_after_landing: dict[str, Request] = {}

    # -- intake ------------------------------------------------------------------------------
    def add_request(self, request: Request, first_token_ids: Sequence[int] = ()) -> RequestUpdate | None:
        """first_token_ids (D): the tokens P sampled after the prompt. They are this request's first output,
        returned here for the caller to send at once, without waiting for the KV (not queued for the next
        step, which could then carry a second update of the same request), and then computed as context
        after the prompt: the load brings the prompt's KV, and _promote_loaded's back-off has nothing to
        redo. A token that ends the request (EOS, max_tokens of 1) finishes it here, and P's blocks go back."""
        if (request.request_id in self.requests or request.request_id in self.held_for_transfer
                or request.request_id in self.aborted_while_loading
                or request.request_id in self._free_after_landing):
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        capacity = self.kv.pool.num_blocks * self.block_size
        if request.num_tokens >= capacity:   # a resumed request's output so far must fit too
            raise ValueError(f"prompt: {request.num_tokens} tokens do not fit in the KV cache "
                             f"({capacity} token slots)")
        # A request alone must always fit, or preemption could never make room for it.
        request.max_tokens = min(request.max_tokens, capacity - request.num_prompt_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.connector is not None:
            self.connector.request_added(request)
        return self._take_first_tokens(request, first_token_ids) if first_token_ids else None

    def _take_first_tokens(self, request: Request, token_ids: Sequence[int]) -> RequestUpdate:
        taken, status = [], None
        for token_id in token_ids:
            request.append_output_token_id(token_id)
            taken.append(token_id)
            if (status := request.check_stop()) is not None:
                break
        update = RequestUpdate(request, taken, is_remote=True)
        if status is not None:
            update.kv_transfer_params = self._finish(request, status, emit=False)
        return update

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> dict | None:
        """Finish from outside a step (the detokenizer found a stop string); returns the
        connector's kv_transfer_params for the response."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        return self._finish(request, status, emit=False)

    def fail_requests(self, request_ids: Iterable[str], error: str,
                      unsent_finished_ids: Iterable[str] = ()) -> list[RequestUpdate]:
        """A step failed and the engine gave up every step it had not landed (engine/engine_core.py);
        the device is done with them. Finish with FINISHED_ERROR and `error` the given requests (those
        steps' requests) and any other request with tokens in flight, so that nothing counts as in
        flight any more; their blocks, and those of requests that waited for a step to land, are
        freed now. unsent_finished_ids: finished ids of the failed step, which the runner may not have
        seen (it drops their per-request state on the next step). Returns the updates still owed: the
        finishes decided outside a step (aborts) and one per failed request."""
        landed, self._free_after_landing = self._free_after_landing, {}
        for request in landed.values():
            self.kv.free(request)
        self._finished_ids.update(unsent_finished_ids)
        in_flight = [r.request_id for r in self.requests.values()
                     if r.num_inflight_tokens or r.num_inflight_samples]
        updates, self._updates = self._updates, []
        for request_id in dict.fromkeys([*request_ids, *in_flight]):
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            request.num_inflight_tokens = request.num_inflight_samples = 0  # blocks free now
            request.error = error
            params = self._finish(request, RequestStatus.FINISHED_ERROR, emit=False)
            updates.append(RequestUpdate(request, [], params))
        return updates

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return sum(1 for r in self.waiting if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS)

    @property
    def num_waiting_for_remote_kvs(self) -> int:
        return sum(1 for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)

    @property
    def num_prefill_tokens_waiting(self) -> int:
        """Context tokens still to compute before the requests can decode (the router's prefill queue):
        a prompt less its prefix hits once admitted, or a preempted or resumed request's tokens so far.
        A decoding request's one next token is decode work, not prefill: a request one token behind
        counts nothing. Tokens of a step in flight count as computed; KV a remote instance is sending
        (WAITING_FOR_REMOTE_KVS) is not computed here."""
        total = 0
        for request in (*self.waiting, *self.running):
            done = request.num_computed_tokens + request.num_inflight_tokens
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                done = max(done, request.num_cached_tokens)
            behind = request.num_tokens - done
            if behind > 1:
                total += behind
        return total

    @property
    def num_blocks_held_for_transfer(self) -> int:
        return sum(self.kv.num_blocks_of(r) for r in self.held_for_transfer)

    def has_unfinished(self) -> bool:
        # Pending updates and finished ids too: an abort's final output and the runner's cleanup
        # must go out even when nothing else is left to run.
        return bool(self.requests or self.held_for_transfer or self.aborted_while_loading
                    or self._updates or self._finished_ids or self._free_after_landing)

    # -- decide ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False

        running = list(self.running)
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if request.last_token_in_flight:
                i += 1
                continue
            num_new = min(request.num_tokens + request.num_inflight_samples
                          - request.num_computed_tokens - request.num_inflight_tokens, budget)
            while self.kv.allocate_slots(request, request.num_inflight_tokens + num_new) is None:
                victim = self._pick_victim(running, i)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1

        if not preempted:
            budget = self._schedule_waiting(scheduled, budget)

        out = SchedulerOutput(
            scheduled=[self._schedule_request(r, n) for r, n in scheduled],
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_request_ids=self._finished_ids,
            dropped_sample_ids=self._dropped_sample_ids,
        )
        self._finished_ids, self._dropped_sample_ids = set(), set()
        if self.connector is not None:
            out = dataclasses.replace(out, connector_meta=self.connector.build_connector_meta(out))
        return out

    def _schedule_waiting(self, scheduled: list[tuple[Request, int]], budget: int) -> int:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(self.waiting.popleft())  # uses no compute until its KV lands
                continue

            computed_blocks, num_local = [], request.num_computed_tokens
            # (Prefix hits become the first blocks of a table: never for a request that holds blocks.)
            looked_up = num_local == 0 and self.kv.enable_caching and not self.kv.num_blocks_of(request.request_id)
            if looked_up:
                computed_blocks, num_local = self.kv.get_computed_blocks(request)
            num_external, load_async = 0, False
            if self.connector is not None:  # (also without kv_transfer_params: a store may hold the prompt)
                num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
                if num_external is None:  # the connector cannot tell yet
                    skipped.append(self.waiting.popleft())
                    continue

            num_new = 0
            if not load_async:
                num_new = request.num_tokens - num_local - num_external
                if not self.config.enable_chunked_prefill and num_new > budget:
                    break
                num_new = min(num_new, budget)
            new_block_ids = self.kv.allocate_slots(
                request, num_new + num_external, computed_blocks, num_local - request.num_computed_tokens)
            if new_block_ids is None:
                break  # waiting requests never preempt running ones
            if looked_up:
                self.kv.record_prefix_query(request.num_tokens, num_local)
            self.waiting.popleft()
            request.num_computed_tokens = num_local
            request.num_cached_tokens = max(request.num_cached_tokens, num_local)
            if self.connector is not None and num_external:
                self.connector.update_state_after_alloc(
                    request, self.kv.get_block_ids(request.request_id), num_external)
            if load_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                request.num_cached_tokens = num_local + num_external
                skipped.append(request)
                continue
            request.num_computed_tokens += num_external
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _promote_loaded(self, request: Request, invalid_block_ids: set[int], recompute: bool = False,
                        first_token_ids: Sequence[int] = ()) -> None:
        """The connector finished loading the request's KV: make it schedulable, or finish it with
        an error when the load failed under policy `fail` (unless the connector says to recompute).
        first_token_ids: P's token, where the load brought it (push): taken as add_request takes a pull's,
        so D's output starts with what P's prefill sampled."""
        block_ids = self.kv.get_block_ids(request.request_id)
        loaded = request.num_cached_tokens
        request.status = RequestStatus.WAITING
        bad = [i for i, b in enumerate(block_ids) if b in invalid_block_ids]
        if bad:
            self.kv.evict_blocks({block_ids[i] for i in bad})
            if self.kv_load_failure_policy == "fail" and not recompute:
                request.error = (f"KV load failed for {len(bad)} of {len(block_ids)} blocks "
                                 "(kv_load_failure_policy=fail)")
                self._finish(request, RequestStatus.FINISHED_ERROR)
                return
            loaded = min(loaded, bad[0] * self.block_size)  # recompute from the first bad block
        # Back off one token: the last prompt token runs again to produce logits (none to redo when P's
        # first token came along: it follows the prompt, and is computed next).
        first_token_ids = first_token_ids if not request.output_token_ids else ()  # (one from HTTP came first)
        request.num_computed_tokens = min(loaded, request.num_tokens + len(first_token_ids) - 1)
        request.num_cached_tokens = request.num_computed_tokens
        if first_token_ids:   # a token that ends the request finishes it here (its blocks go back)
            self._updates.append(self._take_first_tokens(request, first_token_ids))
            if request.is_finished:
                return
        if request.num_computed_tokens == 0:
            # Nothing of the load is kept (it failed from its first block): start over as a new request, with
            # no blocks. It looks the prefix cache up again when scheduled (another request may have cached
            # the prefix meanwhile), and hits must be the first blocks of its table: appended after these,
            # it would read them (unwritten) as context and write its decode into the cached hits.
            self.kv.free(request)
            return
        self.kv.cache_blocks(request, request.num_computed_tokens)

    @staticmethod
    def _pick_victim(running: list[Request], i: int) -> Request:
        """The newest running request after running[i] gives way, but not one whose last token is
        already in flight (async scheduling): its blocks free themselves when that step lands,
        and preempting it would throw away all its KV to recompute one token."""
        for j in range(len(running) - 1, i, -1):
            if not running[j].last_token_in_flight:
                return running.pop(j)
        return running.pop()

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        # Freed at once even with a step in flight: a block reused by a step of this engine runs
        # after that step on the device, and a step that preempts starts no remote loads.
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if request.num_inflight_samples:
            self._dropped_sample_ids.add(request.request_id)
        request.num_inflight_tokens = request.num_inflight_samples = 0  # their outputs will be dropped
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_request(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens + request.num_inflight_tokens
        token_ids = request.all_token_ids[start:start + num_new]
        # Only the token of the step in flight can be unknown, and only as the first of a decode.
        token_ids += [PLACEHOLDER_TOKEN_ID] * (num_new - len(token_ids))
        do_sample = start + num_new >= request.num_tokens + request.num_inflight_samples
        request.num_inflight_tokens += num_new
        request.num_inflight_samples += do_sample
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            num_computed_tokens=start,
            block_ids=self.kv.get_block_ids(request.request_id),
            sampling_params=request.sampling_params,
            do_sample=do_sample,
            prefill=start < request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
        )

    # -- update ------------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        # The step in flight when these were let go has landed (steps land in order).
        landed, self._free_after_landing = self._free_after_landing, {}
        updates, self._updates = self._updates, []
        for item in scheduler_output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                # finished between schedule and update (abort, stop string), or preempted while
                # the step was in flight (async scheduling): the step's work is dropped
                continue
            request.num_computed_tokens += len(item.token_ids)
            request.num_inflight_tokens -= len(item.token_ids)
            request.num_inflight_samples -= item.do_sample
            token_id = runner_output.sampled_token_ids.get(item.request_id)
            if not item.do_sample or token_id is None:
                continue
            request.append_output_token_id(token_id)
            self.kv.cache_blocks(request, request.num_computed_tokens)
            status = request.check_stop()
            update = RequestUpdate(request, [token_id])
            if status is not None:
                update.kv_transfer_params = self._finish(request, status, emit=False)
            updates.append(update)
        self._apply_connector_output(runner_output.kv_connector_output)
        for request in landed.values():
            self.kv.free(request)
        updates.extend(self._updates)
        self._updates = []
        return updates

    def _apply_connector_output(self, out: KVConnectorOutput) -> None:
        for request_id, token_ids in out.first_token_ids.items():
            request = self.requests.get(request_id)
            if (request_id not in out.finished_recving and request is not None and not request.output_token_ids
                    and request.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS)):
                # P's token ahead of its KV: out now, as add_request sends a pull's; a token that ends the
                # request finishes it here (a load under way keeps its blocks until it reports)
                self._updates.append(self._take_first_tokens(request, token_ids))
        for request_id in out.finished_sending:
            request = self.held_for_transfer.pop(request_id, None)
            if request is not None:
                self.kv.free(request)
        for request_id in out.finished_recving:
            request = self.aborted_while_loading.pop(request_id, None)
            if request is not None:
                self.kv.free(request)
            elif request_id in self.requests:
                self._promote_loaded(self.requests[request_id], out.invalid_block_ids,
                                     request_id in out.recompute_request_ids,
                                     out.first_token_ids.get(request_id, ()))

    def _finish(self, request: Request, status: RequestStatus, emit: bool = True) -> dict | None:
        was_loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)

        params = None
        if was_loading:
            # A READ may still be writing into these blocks: free them when the load reports.
            self.connector.request_aborted_while_loading(request)
            self.aborted_while_loading[request.request_id] = request
        else:
            delay_free = False
            if self.connector is not None:
                delay_free, params = self.connector.request_finished(
                    request, self.kv.get_block_ids(request.request_id))
                if params is not None and params.get("do_remote_prefill") and request.output_token_ids:
                    # P's sampled token goes with its KV: D starts from it (add_request above).
                    params["first_token_ids"] = request.output_token_ids[:1]
                if params is not None and params.get("do_remote_prefill"):
                    # what D reports as cached: P's prefix hits, not the KV P computed (Request)
                    params["remote_cached_tokens"] = min(request.num_cached_tokens, request.num_prompt_tokens)
            if delay_free:
                self.held_for_transfer[request.request_id] = request
            elif request.num_inflight_tokens:
                # A step in flight still writes these blocks, and a remote load (which does not
                # wait for that step) must not land in them first.
                self._free_after_landing[request.request_id] = request
            else:
                self.kv.free(request)
        if emit:
            self._updates.append(RequestUpdate(request, [], params))
        return params
