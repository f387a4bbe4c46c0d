"""A torch-free stand-in for the model runner: samples token (last position + 1) % 1000, and drives
the connector's worker half like the real runner does."""
from __future__ import annotations

from pdserve.config import SchedulerConfig
from pdserve.core.batch import PLACEHOLDER_TOKEN_ID, KVConnectorOutput, ModelRunnerOutput
from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.core.scheduler import Scheduler


def fake_token(position: int) -> int:
    return (position * 7 + 3) % 1000


class FakeRunner:
    def __init__(self, num_blocks: int, connector_worker=None) -> None:
        # One "block" of KV is a list of the positions written into it.
        self.kv_caches = [None] * num_blocks
        self.connector = connector_worker
        self.last_sampled: dict[str, int] = {}  # the previous step's tokens: placeholders read them
        self.num_placeholders = 0
        if connector_worker is not None:
            connector_worker.register_kv_caches(self.kv_caches)

    def execute(self, out) -> ModelRunnerOutput:
        if self.connector is not None and out.connector_meta is not None:
            self.connector.start_load_kv(out.connector_meta)
        sampled = {}
        for item in out.scheduled:
            pos = item.num_computed_tokens + len(item.token_ids) - 1
            if PLACEHOLDER_TOKEN_ID in item.token_ids:  # async scheduling: as the real runner, fill it in
                assert item.token_ids == [PLACEHOLDER_TOKEN_ID], item
                assert self.last_sampled[item.request_id] == fake_token(pos - 1), item
                self.num_placeholders += 1
            if item.do_sample:
                sampled[item.request_id] = fake_token(pos)
        self.last_sampled = sampled
        conn = KVConnectorOutput()
        if self.connector is not None:
            sending, recving = self.connector.get_finished()
            conn = KVConnectorOutput(sending, recving, self.connector.get_block_ids_with_load_errors(),
                                     self.connector.get_recompute_request_ids(), self.connector.get_first_token_ids())
        return ModelRunnerOutput(sampled, conn)


def make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=16,
                   chunked=True, connector=None, policy="fail", caching=True) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          enable_chunked_prefill=chunked, max_model_len=4096)
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, hash_extra="test")
    return Scheduler(cfg, kv, connector, kv_load_failure_policy=policy)


# tests/core/conftest.py runs every test twice: with the synchronous loop and with async scheduling.
ASYNC_SCHEDULING = False


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000,
                      async_scheduling: bool | None = None):
    """Step until nothing is left; returns {request_id: (tokens, final status)}. async_scheduling:
    schedule step N+1 before step N's outputs are applied, as EngineCore does on CUDA."""
    if async_scheduling is None:
        async_scheduling = ASYNC_SCHEDULING
    results: dict[str, list] = {}
    statuses = {}
    inflight = None
    for _ in range(max_steps):
        if not scheduler.has_unfinished() and inflight is None:
            break
        out = scheduler.schedule()
        result = runner.execute(out)
        if async_scheduling:
            landed = [inflight] if inflight is not None else []
            inflight = None
            if out.is_empty:
                landed.append((out, result))
            else:
                inflight = (out, result)
        else:
            landed = [(out, result)]
        for landed_out, landed_result in landed:
            for update in scheduler.update_from_output(landed_out, landed_result):
                results.setdefault(update.request.request_id, []).extend(update.new_token_ids)
                if update.finished:
                    statuses[update.request.request_id] = (update.request.status, update.kv_transfer_params)
    else:
        raise AssertionError("scheduler did not drain")
    return results, statuses


def assert_no_leaks(scheduler: Scheduler) -> None:
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    assert not scheduler.held_for_transfer and not scheduler.aborted_while_loading
    assert not scheduler.kv.req_to_blocks and not scheduler.kv.req_to_block_ids
    assert not scheduler.kv.num_cached_blocks
    assert scheduler.kv.num_free_blocks == scheduler.kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in scheduler.kv.pool.blocks)
