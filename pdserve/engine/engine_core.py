"""EngineCore: the only place where the scheduler, the model runner and the connector halves meet.

step(): schedule → execute → update, then turn each request's progress into a RequestOutput
(incremental text, stop strings, finish reason, kv_transfer_params for P's response).

With async scheduling (on by default on CUDA) a step launches step N+1 before it waits for step N,
then applies step N: the scheduling, output processing and input building of one step run on the
host while the device computes the previous one, instead of leaving the device idle between steps.
Outputs then trail the launches by one step; core/scheduler.py says how the scheduler accounts for
the step in flight.

A step that raises (the model, the sampler, the connector's worker half, the scheduler's update)
never escapes step(): the requests of that step, and with async scheduling of the step in flight,
finish with FinishReason.ERROR and "engine step failed: <exception type>" (the traceback goes to the
log), their blocks are freed through the scheduler's finish path (Scheduler.fail_requests), their
detokenizers are dropped and nothing stays in flight; the model runner drops their generators on the
next step, as for any finished request. Requests not in those steps carry on. A fault that outlives
the requests it met (MAX_CONSECUTIVE_FAILED_STEPS failed steps with no step that computed something
in between: a lost device, say) sets `degraded`, which the engine process reports up (/health turns
503 with the reason) while it keeps serving: no sequence of requests ends the instance, and the next
step that computes clears it. Only `broken` (the scheduler's own state is no longer trustworthy) ends
the engine process.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from pdserve.config import EngineConfig
from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.core.request import Request, RequestStatus
from pdserve.core.scheduler import RequestUpdate, Scheduler
from pdserve.engine.detokenizer import IncrementalDetokenizer, fast_decoder
from pdserve.kv_transfer.base import KVTransferParams
from pdserve.kv_transfer.factory import create_connector
from pdserve.model.loader import load_tokenizer, resolve_model_path
from pdserve.outputs import FinishReason, RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.worker.core_lending import CoreLending
from pdserve.worker.cpu_memory import keep_freed_memory
from pdserve.worker.cpu_threads import set_num_threads
from pdserve.worker.model_runner import ModelRunner, resolve_device_and_dtype
from pdserve.worker.tp_executor import RankLost, TPExecutor

logger = logging.getLogger(__name__)

# A request that breaks its step leaves with that step, so a fault that fails this many steps in a row,
# with no step that computed something in between, is likely not one request's: the engine is degraded
# (unhealthy) until a step computes again. Each failed step takes its requests with it, so the fault
# costs requests, never the instance: a few bad requests in a row must not take it down.
MAX_CONSECUTIVE_FAILED_STEPS = 3


def _slow_step_seconds() -> float | None:
    """$PDSERVE_LOG_SLOW_STEP_MS: log every step slower than this, with its batch (default: off)."""
    value = os.environ.get("PDSERVE_LOG_SLOW_STEP_MS")
    if not value:
        return None
    try:
        return float(value) / 1000.0
    except ValueError:
        raise ValueError(f"PDSERVE_LOG_SLOW_STEP_MS: expected milliseconds, got {value!r}") from None


class EngineCore:
    def __init__(self, config: EngineConfig, num_blocks: int | None = None) -> None:
        config.validate()
        self.config = config
        # Lending: the process may run on every core it was given; the thread count follows the cores
        # it holds for each step (worker/core_lending.py).
        if config.cpu_affinity and not config.core_lending:
            try:
                os.sched_setaffinity(0, config.cpu_affinity)
            except OSError as e:   # cores its cpuset forbids
                raise ValueError(f"cpu_affinity (--cpu-cores) {config.cpu_affinity}: this process may not run on "
                                 f"them ({e.strerror}); it may run on {sorted(os.sched_getaffinity(0))}") from None
        mc = config.model
        mc.model = resolve_model_path(mc.model)
        self.tokenizer = load_tokenizer(mc.model)
        self._decode = fast_decoder(self.tokenizer) if self.tokenizer is not None else None
        device, dtype = resolve_device_and_dtype(mc)
        if config.num_threads or device.type == "cpu":
            set_num_threads(config.num_threads)
        if device.type == "cpu":
            keep_freed_memory()
        self.core_lending = None
        if config.core_lending:
            if device.type != "cpu":
                raise ValueError("core_lending: for CPU engines only")
            self.core_lending = CoreLending(config.core_lending, config.cpu_affinity)
        # The connector is built after the runner: its compatibility hash needs the model's identity.
        if config.parallel.tensor_parallel_size > 1:
            self.runner = TPExecutor(config, num_blocks)
        else:
            self.runner = ModelRunner(mc, config.cache, None, num_blocks,
                                      max_num_seqs=config.scheduler.max_num_seqs)
        info = self.runner.info
        self.max_model_len = self.runner.max_model_len
        if not config.scheduler.enable_chunked_prefill:
            # A prompt must fit in one step's token budget when it cannot be split.
            self.max_model_len = min(self.max_model_len, config.scheduler.max_num_batched_tokens)
        compat = {"model": info.identity, "dtype": str(dtype).removeprefix("torch."),
                  "block_size": config.cache.block_size,
                  "kv_layout": "blocks,layers,kv,slots,heads,dim",
                  # the whole model's (a rank holds num_kv_heads / T): P and D of other TP sizes pair
                  "kv_shape": "x".join(map(str, (*self.runner.kv_cache.shape[1:4], info.num_kv_heads,
                                                  info.head_dim)))}
        hash_extra = f"{info.identity}:{dtype}"   # the prefix cache's (and the KV store's) block names
        connector_scheduler, self.connector_worker = create_connector(
            config.kv_transfer, config.cache.block_size, compat, hash_extra,
            ranks=self.runner if isinstance(self.runner, TPExecutor) else None, num_kv_heads=info.num_kv_heads)
        if self.connector_worker is not None:
            self.runner.connector = self.connector_worker
            self.connector_worker.register_kv_caches(self.runner.kv_cache)
        self.engine_id = getattr(connector_scheduler, "engine_id", None)

        sc = config.scheduler
        sc.max_model_len = self.max_model_len
        self.runner.warm_up(sc.max_num_batched_tokens)
        kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                            config.cache.enable_prefix_caching,
                            hash_extra=hash_extra)
        self.scheduler = Scheduler(sc, kv, connector_scheduler,
                                   config.kv_transfer.kv_load_failure_policy)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.async_scheduling = self.resolve_async_scheduling(sc.async_scheduling, device.type)
        self._inflight = None  # async scheduling: (SchedulerOutput, StepHandle, start time) launched, not landed
        self.last_step_was_empty = True  # the engine process polls transfers instead of spinning
        self.eos_token_ids = info.eos_token_ids
        self.slow_step_s = _slow_step_seconds()
        self.num_consecutive_failed_steps = 0  # reset by every landed step that computed something
        self.degraded: str | None = None  # why steps keep failing (a fault that outlived its requests)
        self.broken: str | None = None    # why the engine cannot go on (its scheduler state is broken)
        # For the router (docs/router.md): the bytes a handoff moves per token, and counters whose
        # deltas give it this instance's rates.
        kv_cache = self.runner.kv_cache
        self.kv_bytes_per_token = (kv_cache[0].numel() * kv_cache.element_size() // config.cache.block_size
                                   * config.parallel.tensor_parallel_size)   # every rank's heads
        self.num_prompt_tokens_computed = 0
        self.num_output_tokens = 0   # sampled here: P's first tokens on a D are not
        self.is_kv_consumer = config.kv_transfer.is_consumer   # takes P's first token (add_request)
        self._admission_outputs: list[RequestOutput] = []      # made by add_request, sent with the next step's
        self.busy_seconds = 0.0

    def check_ranks(self) -> None:
        """A tensor-parallel rank that died while the engine was idle breaks it now, before a request
        meets it (the engine process then ends and its supervisor starts the instance again)."""
        if isinstance(self.runner, TPExecutor) and self.broken is None:
            lost = self.runner.dead_rank()
            if lost is not None:
                self.broken = f"tensor parallel: {lost}"

    def kv_side_channel(self) -> dict[str, Any] | None:
        """Where peers reach this instance's connector ({host, port, boot_id}); None without one."""
        worker = self.connector_worker
        port = getattr(worker, "side_channel_port", None)
        if port is None:
            return None
        return {"host": self.config.kv_transfer.side_channel_host, "port": port,
                "boot_id": getattr(worker, "boot_id", None)}

    @staticmethod
    def resolve_async_scheduling(asked: bool | None, device_type: str) -> bool:
        """On CPU the model runs on the host threads that would do the overlapped work: nothing to gain."""
        return asked if asked is not None else device_type == "cuda"

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer_params: dict | None = None, resumed_token_ids: list[int] | None = None) -> None:
        """ValueError naming the field for what the engine cannot run; nothing of the request stays.

        resumed_token_ids: the tokens another instance generated for this request before it died (the
        router resumes the stream here). They are computed as context after the prompt and count as
        output: max_tokens and usage include them, a seeded generator skips their draws, and the
        detokenizer replays them so that the text goes on where the client's stopped (a multi-byte
        character or a stop string across the boundary included)."""
        resumed = list(resumed_token_ids or ())
        all_token_ids = [*prompt_token_ids, *resumed]
        if len(all_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(all_token_ids)} tokens, the model's length is "
                             f"{self.max_model_len}")
        vocab_size = self.runner.info.vocab_size
        if all_token_ids and not 0 <= min(all_token_ids) <= max(all_token_ids) < vocab_size:
            raise ValueError(f"prompt: token ids must be in [0, {vocab_size}), got "
                             f"{min(all_token_ids)}..{max(all_token_ids)}")
        # Again here, not only at construction: params changed since (or built without it, and sent
        # from another process) must fail this request, not the step that samples for it.
        params.validate()
        parsed = KVTransferParams.from_dict(kv_transfer_params)  # malformed: ValueError here, not in the loop
        if self.scheduler.connector is not None:
            self.scheduler.connector.check_params(parsed)
        if resumed and kv_transfer_params:
            raise ValueError("resume: a resumed request computes its context here, without kv_transfer_params")
        first = []
        if parsed is not None and parsed.do_remote_prefill and self.is_kv_consumer:
            first = parsed.first_token_ids or []
            if not all(t < vocab_size for t in first):
                raise ValueError(f"kv_transfer_params: first_token_ids must be in [0, {vocab_size})")
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids,
                          self.max_model_len, kv_transfer_params, output_token_ids=resumed)
        if parsed is not None and parsed.do_remote_prefill and self.is_kv_consumer:
            request.remote_prefill_cached_tokens = parsed.remote_cached_tokens or 0
        if resumed and request.num_output_tokens >= request.max_tokens:
            raise ValueError(f"resume: {len(resumed)} tokens already generated, max_tokens is {request.max_tokens}")
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params, self._decode)
        if resumed and detokenizer.resume(resumed):
            raise ValueError("resume: the tokens already generated hold a stop string")
        first_update = self.scheduler.add_request(request, first)
        self.detokenizers[request_id] = detokenizer
        if first_update is not None:   # P's token: out before any step, so a stop string in it ends the request now
            self._admission_outputs.append(self._make_output(first_update))

    def abort(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def release_kv(self, request_ids: list[str]) -> None:
        """P: no D will read the blocks held for these requests (the proxy's decode hop failed before
        a D took them): free them now rather than at lease expiry."""
        if self.connector_worker is not None:
            self.connector_worker.release_held(request_ids)

    @property
    def step_in_flight(self) -> bool:
        return self._inflight is not None

    def has_work(self) -> bool:
        return bool(self._admission_outputs) or self.step_in_flight or self.scheduler.has_unfinished() or (
            self.connector_worker is not None and self.connector_worker.num_pending_requests() > 0)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step's outputs, after those made on admission (P's first tokens). Never raises for a failure
        inside the step: see _fail_step."""
        start = time.perf_counter()
        early, self._admission_outputs = self._admission_outputs, []
        try:
            return early + self._step(start)
        finally:
            self.busy_seconds += time.perf_counter() - start
            if not self.has_work():
                self.idle()

    def idle(self) -> None:
        """Nothing to compute (also after aborts that ran no step): this engine's cores may be lent."""
        if self.core_lending is not None:
            self.core_lending.idle()

    def _step(self, start: float) -> list[RequestOutput]:
        out = landing = outputs = None
        try:
            out = self.scheduler.schedule()
            if self.core_lending is not None:
                # Claim cores only for a step that computes: one that only polls transfers (a P whose
                # KV D is still reading, a D waiting for it) lends them, or its peer decodes on one core.
                if out.is_empty:
                    self.core_lending.idle()
                else:
                    self.core_lending.before_step()
            if not self.async_scheduling and self._inflight is None:
                return self._land(out, self.runner.execute_model(out), start)
            handle = self.runner.launch(out)
            landing, self._inflight = self._inflight, None
            outputs = []
            if landing is not None:
                outputs = self._land(landing[0], self.runner.collect(landing[1]), landing[2])
                landing = None
            if out.is_empty or not self.async_scheduling:
                outputs += self._land(out, self.runner.collect(handle), start)  # nothing to overlap with
            else:
                self._inflight = (out, handle, start)
            self.last_step_was_empty = out.is_empty and self._inflight is None
            return outputs
        except Exception as error:
            # Outputs of a step that landed before the failure still go out, before the failures.
            return (outputs or []) + self._fail_step(error, out, landing)

    def _land(self, out, runner_output, start: float) -> list[RequestOutput]:
        """Apply a step whose sampled tokens are on the host."""
        self._count_prompt_tokens(out)  # before the update: it lets go of the requests that finish
        updates = self.scheduler.update_from_output(out, runner_output)
        self.num_output_tokens += sum(len(u.new_token_ids) for u in updates if not u.is_remote)
        if self.slow_step_s is not None and time.perf_counter() - start > self.slow_step_s:
            self._log_slow_step(out, time.perf_counter() - start)
        self.last_step_was_empty = out.is_empty
        if not out.is_empty:
            self.num_consecutive_failed_steps = 0
            self.degraded = None
        return [self._make_output(u) for u in updates]

    def _count_prompt_tokens(self, out) -> None:
        """Prompt positions this step computed: the router's prefill rate is their delta over busy
        seconds. A request gone before its step landed (aborted) is left out."""
        requests = self.scheduler.requests
        for item in out.scheduled:
            request = requests.get(item.request_id)
            if request is not None and item.num_computed_tokens < request.num_prompt_tokens:
                end = min(item.num_computed_tokens + len(item.token_ids), request.num_prompt_tokens)
                self.num_prompt_tokens_computed += end - item.num_computed_tokens

    def _fail_step(self, error: Exception, out, landing) -> list[RequestOutput]:
        """The step raised: finish the requests of every step not landed (this one, the one it was
        landing, the one in flight) with an error, free their blocks and keep serving the rest.
        out: this step's SchedulerOutput (None when scheduling raised); landing: the step in flight
        that it was landing, unless that one landed."""
        self.num_consecutive_failed_steps += 1
        message = f"engine step failed: {type(error).__name__}"
        logger.error("%s (%d in a row); failing the requests of the steps not landed", message,
                     self.num_consecutive_failed_steps, exc_info=error)
        steps = [s for s in (out, landing and landing[0], self._inflight and self._inflight[0])
                 if s is not None]
        self._inflight = None
        self.last_step_was_empty = False
        if self.runner.device.type == "cuda":
            try:  # the given-up steps' kernels must be done before their blocks go to other requests
                torch.cuda.synchronize(self.runner.device)
            except Exception:
                logger.exception("device synchronize after a failed step failed too")
        failed = [item.request_id for s in steps for item in s.scheduled]
        unsent = out.finished_request_ids if out is not None else set()
        try:
            updates = self.scheduler.fail_requests(failed, message, unsent)
        except Exception:  # the scheduler's own state is broken: nothing here can be trusted
            logger.exception("failing the requests of a failed step failed")
            self.broken = f"the scheduler failed while failing a step's requests ({type(error).__name__})"
            updates = []
        outputs = []
        for update in updates:
            try:
                outputs.append(self._make_output(update))
            except Exception:
                logger.exception("output of request %s after a failed step", update.request.request_id)
        # A request owed its final output but no longer known to the scheduler (its finish was lost
        # with the step) gets it now, so that no caller waits for it forever.
        for request_id in [r for r in self.detokenizers if r not in self.scheduler.requests]:
            del self.detokenizers[request_id]
            outputs.append(RequestOutput(request_id, [], "", 0, 0, FinishReason.ERROR, error=message))
        if isinstance(error, RankLost):  # the ranks are out of step for good: the instance must restart
            self.broken = f"tensor parallel: {error}"
        if self.num_consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            # /health shows this to anyone: the count, not the exception (the log above has it).
            self.degraded = f"{self.num_consecutive_failed_steps} engine steps failed in a row"
            logger.error("engine degraded: %s (last: %s: %s)", self.degraded, type(error).__name__, error)
        return outputs

    def _log_slow_step(self, out, seconds: float) -> None:
        """Which batch was slow: a stall (a compile, a transfer wait) shows as a small batch taking long."""
        query_lens = sorted((len(s.token_ids) for s in out.scheduled), reverse=True)
        num_decodes = sum(n == 1 for n in query_lens)
        logger.warning("slow step: %.0f ms, %d tokens from %d sequences (%d decodes; longest chunks %s), "
                       "%d waiting, %d running", seconds * 1000, out.num_scheduled_tokens, len(query_lens),
                       num_decodes, query_lens[:4], len(self.scheduler.waiting), len(self.scheduler.running))

    def _make_output(self, update: RequestUpdate) -> RequestOutput:
        request = update.request
        detok = self.detokenizers[request.request_id]
        params = update.kv_transfer_params
        if detok.update(update.new_token_ids) and not request.is_finished:
            params = self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        finished = request.is_finished
        error = request.error
        if request.status == RequestStatus.FINISHED_ERROR and self.connector_worker is not None:
            error = self.connector_worker.get_load_error(request.request_id) or error
        output = RequestOutput(
            request_id=request.request_id,
            new_token_ids=update.new_token_ids,
            new_text=detok.take_new_text(finished),
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            finish_reason=request.status.finish_reason if finished else None,
            num_cached_tokens=request.num_reported_cached_tokens,
            kv_transfer_params=params,
            error=error,
        )
        if finished:
            del self.detokenizers[request.request_id]
        return output

    def stats(self) -> dict:
        s, kv = self.scheduler, self.scheduler.kv
        sc = self.config.scheduler
        stats = {
            "num_requests_running": s.num_running,
            "num_requests_waiting": s.num_waiting,
            "num_requests_waiting_for_remote_kvs": s.num_waiting_for_remote_kvs,
            "num_blocks_held_for_transfer": s.num_blocks_held_for_transfer,
            "num_prefill_tokens_waiting": s.num_prefill_tokens_waiting,
            "kv_cache_usage_perc": kv.usage,
            "num_blocks": kv.pool.num_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "block_size": kv.block_size,
            "hash_extra": kv.hash_extra,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "prefix_cache_queries_total": kv.prefix_cache_queries,
            "prefix_cache_hits_total": kv.prefix_cache_hits,
            "num_preemptions_total": s.num_preemptions,
            "num_prompt_tokens_computed_total": self.num_prompt_tokens_computed,
            "num_output_tokens_total": self.num_output_tokens,
            "busy_seconds_total": self.busy_seconds,
            "kv_transfer_bytes_total": 0,
            "kv_transfer_seconds_total": 0.0,
        }
        if self.connector_worker is not None:
            worker_stats = self.connector_worker.get_stats()
            worker_stats.pop("num_blocks_held_for_transfer", None)  # the scheduler's count is exact
            stats.update(worker_stats)
            # The histogram's sum is the seconds total; connectors without the histogram report none.
            stats["kv_transfer_seconds_total"] = float(
                (worker_stats.get("kv_transfer_seconds") or {}).get("sum", 0.0))
        return stats

    # -- KV events (docs/router.md) ------------------------------------------------------------
    def enable_kv_events(self) -> None:
        """The served engine reports its prefix cache's changes to the router; offline use does not."""
        self.scheduler.kv.pool.enable_events()

    def take_kv_events(self) -> list[tuple[str, list[int]]]:
        """The prefix cache's changes since the last call (BlockPool.take_events); [] while off."""
        return self.scheduler.kv.pool.take_events()

    def shutdown(self) -> None:
        if self.core_lending is not None:
            self.core_lending.close()
        try:
            if self.connector_worker is not None:
                self.connector_worker.shutdown()
        finally:   # the ranks go whatever the connector met (a rank lost fails its calls)
            if isinstance(self.runner, TPExecutor):
                self.runner.shutdown()
