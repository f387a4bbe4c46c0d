"""GET /v1/load's body (docs/router.md, "What an instance reports"): the front's numbered ring of KV event
batches with its reset/snapshot rules, the engine's stats fields and counters, the scheduler's prefill
queue, and one real engine process whose reported hashes are the ones the router computes."""
from __future__ import annotations

import asyncio
import json
import re

import pytest

from pdserve.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig
from pdserve.core.block_pool import REMOVED, SNAPSHOT, STORED
from pdserve.core.request import Request, RequestStatus
from pdserve.engine.async_engine import LOAD_REPORT_STATS, AsyncEngine, KVEventLog
from pdserve.engine.engine_core import EngineCore
from pdserve.hashing import hash_prompt_blocks
from pdserve.sampling_params import SamplingParams

from tests.core.helpers import FakeRunner, make_scheduler
from tests.helpers_models import make_tiny_hf_model, tiny_hf_config

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


# ----------------------------------------------------------------------------- the ring

def test_batches_after_events_after_in_order():
    log = KVEventLog()
    log.apply([(STORED, [1, 2]), (REMOVED, [1])])
    log.apply([(STORED, [3])])
    assert log.last_seq == 3 and log.cached == {2, 3}
    assert log.report(0) == {"last_seq": 3, "reset": False, "snapshot": None,
                             "batches": [[1, STORED, [1, 2]], [2, REMOVED, [1]], [3, STORED, [3]]]}
    assert log.report(2)["batches"] == [[3, STORED, [3]]]
    assert log.report(3) == {"last_seq": 3, "reset": False, "snapshot": None, "batches": []}


def test_no_events_after_resets_with_the_whole_set():
    log = KVEventLog()
    assert log.report(None) == {"last_seq": 0, "reset": True, "snapshot": [], "batches": []}
    assert log.report(0)["reset"] is False   # a reader at seq 0 of a log with no events is up to date
    log.apply([(STORED, [30, 10, 20]), (REMOVED, [20])])
    assert log.report(None) == {"last_seq": 2, "reset": True, "snapshot": [10, 30], "batches": []}


def test_events_after_newer_than_last_seq_resets():
    """Another boot's seq (the router missed the restart): the whole set, never an empty answer."""
    log = KVEventLog()
    log.apply([(STORED, [5])])
    report = log.report(2)
    assert report["reset"] is True and report["snapshot"] == [5] and report["batches"] == []


def test_events_after_older_than_the_ring_resets():
    log = KVEventLog(max_hashes=4)
    for i in range(5):
        log.apply([(STORED, [10 * i, 10 * i + 1])])   # seqs 1..5, two hashes each: the ring keeps 4 and 5
    assert log.floor == 3
    assert log.report(3)["batches"] == [[4, STORED, [30, 31]], [5, STORED, [40, 41]]]
    report = log.report(2)
    assert report["reset"] is True and report["batches"] == []
    assert report["snapshot"] == sorted(h for i in range(5) for h in (10 * i, 10 * i + 1))


def test_a_batch_larger_than_the_ring_is_still_served():
    log = KVEventLog(max_hashes=2)
    log.apply([(STORED, [1]), (STORED, [2, 3, 4])])
    assert log.floor == 1 and log.report(1)["batches"] == [[2, STORED, [2, 3, 4]]]


def test_an_engine_snapshot_replaces_the_set_and_resets_every_reader():
    log = KVEventLog()
    log.apply([(STORED, [1, 2])])
    log.apply([(SNAPSHOT, [7, 2]), (STORED, [8]), (STORED, [])])   # an empty batch takes no seq
    assert log.cached == {2, 7, 8} and log.last_seq == 3 and log.floor == 2
    for events_after in (None, 0, 1):
        report = log.report(events_after)
        assert report["reset"] is True and report["snapshot"] == [2, 7, 8] and report["batches"] == []
    assert log.report(2)["batches"] == [[3, STORED, [8]]]


# ----------------------------------------------------------------------------- the front

def test_load_report_of_the_front_from_the_engine_stats():
    stats = {name: i + 1 for i, name in enumerate(LOAD_REPORT_STATS)}
    engine = AsyncEngine(EngineConfig())
    engine._dispatch(("stats", {**stats, "kv_cache_usage_perc": 0.5, "kv_events": [(STORED, [9])]}))
    report = engine.load_report(0)
    assert re.fullmatch(r"[0-9a-f]{16}", report["boot_id"])
    assert report["boot_id"] != AsyncEngine(EngineConfig()).boot_id   # one per start
    assert report["kv_role"] is None   # no KV connector: colocated
    assert (report["healthy"], report["health"]) == (False, "engine not started")
    assert {name: report[name] for name in LOAD_REPORT_STATS} == stats
    assert report["kv_events"] == {"last_seq": 1, "reset": False, "snapshot": None, "batches": [[1, STORED, [9]]]}
    assert set(report) == {"boot_id", "kv_role", "healthy", "health", *LOAD_REPORT_STATS, "kv_events"}
    assert "kv_events" not in engine.stats()   # /metrics never sees the events


def test_kv_role_is_the_connectors_role():
    config = EngineConfig(kv_transfer=KVTransferConfig(kv_connector="loopback", kv_role="consumer"))
    assert AsyncEngine(config).load_report()["kv_role"] == "consumer"
    role_without_connector = EngineConfig(kv_transfer=KVTransferConfig(kv_role="producer"))
    assert AsyncEngine(role_without_connector).load_report()["kv_role"] is None


def test_every_connector_is_reported_with_its_side_channel_where_it_has_one():
    """A store instance has no side channel, and before it reported no connector: the router took it for
    a pull instance (/cluster said "pull", and a store P beside a pull D was not refused at start)."""
    from pdserve.router.instances import LoadReport
    store = AsyncEngine(EngineConfig(kv_transfer=KVTransferConfig(kv_connector="store", kv_role="both",
                                                                  kv_store="127.0.0.1:9")))
    assert "kv_connector" not in store.load_report()   # (not started: no engine id yet)
    store.engine_id = "both-1"
    assert store.load_report()["kv_connector"] == {"name": "store", "engine_id": "both-1", "tp_size": 1}
    push = AsyncEngine(EngineConfig(kv_transfer=KVTransferConfig(kv_connector="nixl-push", kv_role="producer")))
    push.engine_id, push.kv_side_channel = "p-1", {"host": "127.0.0.1", "port": 7001, "boot_id": "b"}
    assert push.load_report()["kv_connector"] == {"name": "nixl-push", "engine_id": "p-1", "tp_size": 1,
                                                  "host": "127.0.0.1", "port": 7001, "boot_id": "b"}
    for engine in (store, push):   # the router takes both
        report = {**engine.load_report(), "kv_events": None}
        assert LoadReport.parse(json.loads(json.dumps(report))).kv_connector == engine.load_report()["kv_connector"]


# ----------------------------------------------------------------------------- the scheduler's prefill queue

def test_prefill_tokens_waiting_follows_chunks_hits_and_decodes():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=6)
    runner = FakeRunner(64)

    def step():
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))

    s.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=3)))
    assert s.num_prefill_tokens_waiting == 10
    step()                                      # a chunk of 6
    assert s.num_prefill_tokens_waiting == 4
    step()                                      # the last 4, and a's first token: a decodes now
    assert s.num_prefill_tokens_waiting == 0
    s.add_request(Request("b", list(range(8)) + [50, 51, 52], SamplingParams(max_tokens=3)))
    assert s.num_prefill_tokens_waiting == 11   # hits are not known before admission
    step()                                      # b admitted: 8 tokens (two blocks) hit a's cache
    assert s.kv.prefix_cache_hits == 8
    assert s.num_prefill_tokens_waiting == 0


def test_prefill_tokens_waiting_counts_a_preempted_requests_context():
    s = make_scheduler(num_blocks=64, block_size=4)
    s.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=5)))
    runner = FakeRunner(64)
    for _ in range(3):
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
    request = s.running[0]
    s._preempt(request)   # the path a full cache takes
    assert request.status == RequestStatus.PREEMPTED
    assert s.num_prefill_tokens_waiting == request.num_tokens == 13


# ----------------------------------------------------------------------------- a real engine

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("load-report"), "llama")


def _config(path: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=path), cache=CacheConfig(kv_cache_memory=8 << 20),
                        scheduler=SchedulerConfig(max_num_seqs=4), num_threads=1)


def _drain(core: EngineCore) -> None:
    for _ in range(200):
        if not core.has_work():
            return
        core.step()
    raise AssertionError("engine did not drain")


def _stored(events) -> list[int]:
    return [h for kind, hashes in events if kind == STORED for h in hashes]


def test_engine_stats_fields_counters_and_events(tiny_model):
    core = EngineCore(_config(tiny_model), num_blocks=32)
    assert core.take_kv_events() == [] and not core.scheduler.kv.pool.events_enabled   # off unless served
    core.enable_kv_events()
    prompt = list(range(1, 41))   # 40 tokens: two full blocks of 16
    core.add_request("a", prompt, GREEDY)
    assert core.stats()["num_prefill_tokens_waiting"] == 40
    _drain(core)
    stats = core.stats()
    hf = tiny_hf_config("llama")
    head_dim = hf.hidden_size // hf.num_attention_heads
    element_size = core.runner.kv_cache.element_size()
    assert stats["kv_bytes_per_token"] == hf.num_hidden_layers * 2 * hf.num_key_value_heads * head_dim * element_size
    assert (stats["num_blocks"], stats["num_free_blocks"], stats["block_size"]) == (32, 32, 16)
    assert (stats["max_num_seqs"], stats["max_num_batched_tokens"], stats["max_model_len"]) == \
        (4, 2048, core.max_model_len)
    assert (stats["num_prompt_tokens_computed_total"], stats["num_output_tokens_total"]) == (40, 4)
    assert stats["num_prefill_tokens_waiting"] == 0 and stats["busy_seconds_total"] > 0
    assert (stats["kv_transfer_bytes_total"], stats["kv_transfer_seconds_total"]) == (0, 0.0)
    # The router hashes the prompt with the reported parameters: the same hashes the engine stored.
    router_hashes = hash_prompt_blocks(prompt, stats["block_size"], stats["hash_extra"])
    assert _stored(core.take_kv_events()) == router_hashes

    # A prompt sharing a's first block computes only the rest: hits are not prompt work.
    core.add_request("b", prompt[:16] + [99, 98, 97], GREEDY)
    busy = stats["busy_seconds_total"]
    _drain(core)
    stats = core.stats()
    assert (stats["num_prompt_tokens_computed_total"], stats["num_output_tokens_total"]) == (43, 8)
    assert stats["busy_seconds_total"] > busy
    assert _stored(core.take_kv_events()) == []   # b's only full block is a's first

    # A resumed request's context is its prompt and the tokens generated elsewhere: only the prompt counts.
    core.add_request("c", [7] * 20, GREEDY, resumed_token_ids=[8, 9])
    _drain(core)
    stats = core.stats()
    assert (stats["num_prompt_tokens_computed_total"], stats["num_output_tokens_total"]) == (63, 10)

    class Connector:   # a D's worker half: its transfer histogram gives the seconds total
        def get_stats(self):
            return {"kv_transfer_bytes_total": 4096, "num_blocks_held_for_transfer": 99,
                    "kv_transfer_seconds": {"buckets": [0.1], "counts": [2], "sum": 0.25, "count": 2}}

    core.connector_worker = Connector()
    stats = core.stats()
    assert (stats["kv_transfer_bytes_total"], stats["kv_transfer_seconds_total"]) == (4096, 0.25)
    assert stats["num_blocks_held_for_transfer"] == 0   # the scheduler's count, not the worker's
    core.connector_worker = None
    core.shutdown()


def test_served_engine_reports_its_cache_through_load_report(tiny_model):
    """The engine process, the pipe and the front: what GET /v1/load serialises."""
    async def settle(engine, predicate):
        for _ in range(100):
            report = engine.load_report(None)
            if predicate(report):
                return report
            await asyncio.sleep(0.05)
        raise AssertionError(f"load report never settled: {report}")

    async def generate(engine, request_id, prompt):
        async for _ in engine.generate(request_id, prompt, GREEDY):
            pass

    async def main():
        engine = AsyncEngine(_config(tiny_model))
        await engine.start()
        try:
            first = engine.load_report(None)   # whole from the start: the first stats come with "ready"
            assert all(first[name] is not None for name in LOAD_REPORT_STATS), first
            assert first["kv_events"] == {"last_seq": 0, "reset": True, "snapshot": [], "batches": []}
            assert first["healthy"] is True and first["health"] == "ok" and first["kv_role"] is None

            a = list(range(1, 41))
            await generate(engine, "a", a)
            a_hashes = hash_prompt_blocks(a, first["block_size"], first["hash_extra"])
            report = await settle(engine, lambda r: r["kv_events"]["snapshot"] == sorted(a_hashes))
            seq = report["kv_events"]["last_seq"]
            assert seq >= 1 and engine.load_report(seq)["kv_events"]["batches"] == []

            b = list(range(100, 148))   # three full blocks
            await generate(engine, "b", b)
            b_hashes = hash_prompt_blocks(b, first["block_size"], first["hash_extra"])
            await settle(engine, lambda r: set(b_hashes) <= set(r["kv_events"]["snapshot"]))
            events = engine.load_report(seq)["kv_events"]
            assert events["reset"] is False
            assert [h for _, kind, hashes in events["batches"] if kind == STORED for h in hashes] == b_hashes
        finally:
            await engine.shutdown()

    asyncio.run(main())
