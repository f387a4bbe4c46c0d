"""One request must never take an instance down: a failed engine step fails that step's requests with
an error and frees their blocks, the engine serves the next request, a fault that outlives its
requests marks the engine degraded (unhealthy, serving on), and AsyncEngine.health() says when the
engine process is dead, broken, degraded or silent."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from pdserve.config import EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine_core import MAX_CONSECUTIVE_FAILED_STEPS, EngineCore
from pdserve.model.sampler import sample
from pdserve.outputs import FinishReason
from pdserve.sampling_params import SamplingParams

from tests.helpers_models import VOCAB_SIZE, make_tiny_hf_model

FAULT = OverflowError("Python int too large to convert to C long")


class RaisingInStep(SamplingParams):
    """Params that pass validation and break the step that samples for them: the model runner's read
    of is_greedy (for a seeded, non-greedy request) raises, as a value that overflows a tensor would.
    Defined at module level so that the spawned engine process unpickles it."""

    @property
    def is_greedy(self) -> bool:
        raise OverflowError("Python int too large to convert to C long")


class RaisingOnAdd(SamplingParams):
    """Params the engine cannot take in: once armed (after construction, so only the engine's own
    check sees it) their validation raises something other than ValueError."""
    armed = False

    def validate(self) -> None:
        super().validate()
        if self.armed:
            raise RuntimeError("params the engine cannot take")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("step-failure"), "llama")


def _config(path: str, async_scheduling: bool = False) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=path),
                        scheduler=SchedulerConfig(max_num_seqs=2, async_scheduling=async_scheduling),
                        num_threads=1)


def _core(path: str, async_scheduling: bool = False) -> EngineCore:
    core = EngineCore(_config(path, async_scheduling), num_blocks=32)
    assert core.async_scheduling is async_scheduling
    return core


def _drain(core: EngineCore) -> dict[str, list]:
    """Step until nothing is left; each request's (token ids, text, finish reason, error)."""
    results: dict[str, list] = {}
    for _ in range(200):
        if not core.has_work():
            return results
        for out in core.step():
            r = results.setdefault(out.request_id, [[], "", None, None])
            r[0] += out.new_token_ids
            r[1] += out.new_text
            if out.finished:
                r[2], r[3] = out.finish_reason, out.error
    raise AssertionError("engine did not drain")


def _assert_nothing_held(core: EngineCore) -> None:
    s, kv = core.scheduler, core.scheduler.kv
    assert not s.requests and not s.waiting and not s.running and not s.held_for_transfer
    assert not kv.req_to_blocks and kv.num_free_blocks == kv.pool.num_blocks and kv.usage == 0
    assert not core.step_in_flight and not core.detokenizers and not core.runner.generators


def _fail_once(monkeypatch, obj, name: str) -> list:
    """obj.<name> raises FAULT on its next call, then works again."""
    original, calls = getattr(obj, name), []

    def failing(*args):
        calls.append(1)
        if len(calls) == 1:
            raise FAULT
        return original(*args)
    monkeypatch.setattr(obj, name, failing)
    return calls


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, top_p=0.9, seed=3, ignore_eos=True)
LATER = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["runner._launch", "runner.collect", "core._make_output"])
def test_failed_step_fails_its_requests_frees_their_blocks_and_the_engine_serves_on(
        tiny_model, monkeypatch, async_scheduling, where):
    core = _core(tiny_model, async_scheduling)
    core.add_request("a", [1, 2, 3, 4, 5], GREEDY)
    core.add_request("b", [6, 7, 8], SEEDED)
    core.add_request("c", [9, 10, 11, 12], LATER)  # waits: max_num_seqs=2
    core.step()
    core.step()
    assert [r.request_id for r in core.scheduler.running] == ["a", "b"] and core.runner.generators
    assert core.step_in_flight is async_scheduling  # async: the failure also meets a step in flight
    owner, name = where.split(".")  # the model, landing a step, or the outputs after the update
    _fail_once(monkeypatch, core.runner if owner == "runner" else core, name)

    failed = core.step()  # must not raise

    errors = {o.request_id: o for o in failed if o.finished}
    assert set(errors) == {"a", "b"}
    for out in errors.values():
        assert out.finish_reason is FinishReason.ERROR
        assert out.error == "engine step failed: OverflowError"  # what failed, not a traceback
    assert core.num_consecutive_failed_steps == 1 and core.broken is None
    assert not core.step_in_flight and "a" not in core.detokenizers and "b" not in core.detokenizers
    assert core.scheduler.kv.num_blocks_of("a") == 0 == core.scheduler.kv.num_blocks_of("b")

    later = _drain(core)  # the request that was not in the failed step runs to its end
    assert set(later) == {"c"} and later["c"][2] is FinishReason.LENGTH and later["c"][3] is None
    assert core.num_consecutive_failed_steps == 0
    _assert_nothing_held(core)
    core.add_request("b", [6, 7, 8], SEEDED)  # the failed request's id and seed, from scratch
    again = _drain(core)
    _assert_nothing_held(core)

    fresh = _core(tiny_model, async_scheduling)
    fresh.add_request("c", [9, 10, 11, 12], LATER)
    expected_c = _drain(fresh)
    fresh.add_request("b", [6, 7, 8], SEEDED)
    expected_b = _drain(fresh)
    assert later == expected_c
    assert again == expected_b  # a generator the failed step advanced would change this


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_whose_finish_the_failure_lost_still_gets_a_final_output(tiny_model, monkeypatch,
                                                                            async_scheduling):
    core = _core(tiny_model, async_scheduling)
    core.add_request("one", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0))
    _fail_once(monkeypatch, core, "_make_output")  # after the update that finished the request
    outputs = _drain(core)
    assert outputs == {"one": [[], "", FinishReason.ERROR, "engine step failed: OverflowError"]}
    _assert_nothing_held(core)


def test_a_fault_that_outlives_its_requests_marks_the_engine_degraded_until_a_step_computes(tiny_model,
                                                                                            monkeypatch):
    core = _core(tiny_model)

    def always_fails(out):
        raise RuntimeError("CUDA error: device lost")
    real_launch = core.runner._launch
    monkeypatch.setattr(core.runner, "_launch", always_fails)
    for i in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
        core.add_request(f"r{i}", [1, 2, 3], GREEDY)
        assert _drain(core)[f"r{i}"][2] is FinishReason.ERROR
    assert core.degraded is None and core.num_consecutive_failed_steps == MAX_CONSECUTIVE_FAILED_STEPS - 1

    monkeypatch.setattr(core.runner, "_launch", real_launch)  # a step that computes resets the count
    core.add_request("ok", [1, 2, 3], GREEDY)
    assert _drain(core)["ok"][2] is FinishReason.LENGTH and core.num_consecutive_failed_steps == 0

    monkeypatch.setattr(core.runner, "_launch", always_fails)
    for i in range(MAX_CONSECUTIVE_FAILED_STEPS):
        assert core.degraded is None
        core.add_request(f"s{i}", [1, 2, 3], GREEDY)
        assert _drain(core)[f"s{i}"][3] == "engine step failed: RuntimeError"
    assert core.degraded == f"{MAX_CONSECUTIVE_FAILED_STEPS} engine steps failed in a row"
    assert core.broken is None   # it serves on: a few bad requests in a row must not end the instance
    _assert_nothing_held(core)

    monkeypatch.setattr(core.runner, "_launch", real_launch)   # the fault went away
    core.add_request("again", [1, 2, 3], GREEDY)
    assert _drain(core)["again"][2] is FinishReason.LENGTH and core.degraded is None
    _assert_nothing_held(core)


def test_huge_top_k_and_seed_are_refused_and_the_sampler_clamps_top_k(tiny_model):
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=10_000_000_000_000_000_000)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    SamplingParams(top_k=2**31 - 1, seed=2**64 - 1)
    SamplingParams(seed=-2**63)

    # Params changed after construction are checked again where they enter the engine.
    from pdserve.engine.llm import LLM
    llm = LLM(tiny_model, num_blocks=16, num_threads=1)
    bypass = SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9)
    bypass.top_k = 10_000_000_000_000_000_000
    with pytest.raises(ValueError, match="top_k"):
        llm.generate([[1, 2, 3]], bypass)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 2, VOCAB_SIZE]], SamplingParams(max_tokens=2))
    assert not llm.engine.scheduler.requests and not llm.engine.detokenizers

    # The sampler alone (a caller that skips validation) cuts nothing for a top_k past the vocabulary.
    logits = torch.randn(2, VOCAB_SIZE)
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)]
    huge = sample(logits, [1.0, 1.0], [0.9, 0.9], [10_000_000_000_000_000_000, 2**70], gens)
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)]
    assert torch.equal(huge, sample(logits, [1.0, 1.0], [0.9, 0.9], [0, VOCAB_SIZE], gens))


def test_async_engine_survives_a_failing_step_and_reports_a_persistent_fault(tiny_model):
    async def collect(engine, request_id, params, prompt=(1, 2, 3)):
        outs = [o async for o in engine.generate(request_id, list(prompt), params)]
        return outs[-1], sum(len(o.new_token_ids) for o in outs)

    async def main():
        engine = AsyncEngine(_config(tiny_model))
        await engine.start()
        try:
            boom = RaisingInStep(max_tokens=4, temperature=1.0, seed=1)
            last, _ = await collect(engine, "boom", boom)
            assert last.finish_reason is FinishReason.ERROR and last.error == "engine step failed: OverflowError"
            last, n = await collect(engine, "ok", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            assert last.finish_reason is FinishReason.LENGTH and n == 4 and engine.health() == (True, "ok")

            # Any exception from add_request (not only ValueError) fails that request alone.
            odd = SamplingParams(max_tokens=4)
            odd.top_k = "5"
            last, _ = await collect(engine, "odd", odd)
            assert last.finish_reason is FinishReason.ERROR and "top_k" in last.error
            unreadable = RaisingOnAdd(max_tokens=4)
            unreadable.armed = True
            last, _ = await collect(engine, "unreadable", unreadable)
            assert last.finish_reason is FinishReason.ERROR
            assert last.error == "engine could not add the request: RuntimeError"
            assert engine.health() == (True, "ok")

            for i in range(MAX_CONSECUTIVE_FAILED_STEPS):  # a fault every step meets: degraded
                last, _ = await collect(engine, f"boom{i}", boom)
                assert last.finish_reason is FinishReason.ERROR
            for _ in range(100):
                if not engine.health()[0]:
                    break
                await asyncio.sleep(0.05)
            healthy, reason = engine.health()
            assert not healthy
            assert reason == f"engine degraded: {MAX_CONSECUTIVE_FAILED_STEPS} engine steps failed in a row"
            # It serves on, and a request that computes makes it healthy again.
            last, n = await collect(engine, "after", SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            assert last.finish_reason is FinishReason.LENGTH and n == 2
            for _ in range(100):
                if engine.health()[0]:
                    break
                await asyncio.sleep(0.05)
            assert engine.health() == (True, "ok") and engine.process.is_alive()
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_health_reports_a_silent_and_a_dead_engine_process(tiny_model):
    with pytest.raises(ValueError, match="stall_timeout_s"):
        AsyncEngine(_config(tiny_model), stall_timeout_s=0)

    async def wait_for(engine, healthy: bool) -> tuple[bool, str]:
        for _ in range(100):
            if engine.health()[0] is healthy:
                break
            await asyncio.sleep(0.05)
        return engine.health()

    async def main():
        engine = AsyncEngine(_config(tiny_model), stall_timeout_s=1.0)
        assert engine.health() == (False, "engine not started")
        await engine.start()
        try:
            await asyncio.sleep(1.5)  # idle for longer than the bound: the stats keep coming
            assert engine.health() == (True, "ok")
            os.kill(engine.process.pid, signal.SIGSTOP)  # alive, but silent
            try:
                healthy, reason = await wait_for(engine, False)
                assert not healthy and reason.startswith("engine stalled: no word from the engine process for ")
                assert engine.process.is_alive()
            finally:
                os.kill(engine.process.pid, signal.SIGCONT)
            assert await wait_for(engine, True) == (True, "ok")  # it spoke again

            os.kill(engine.process.pid, signal.SIGKILL)
            start = time.monotonic()
            healthy, reason = await wait_for(engine, False)
            assert not healthy and reason == "engine process exited (code -9)", reason
            assert time.monotonic() - start < 5
            out = [o async for o in engine.generate("late", [1, 2], SamplingParams(max_tokens=2))][-1]
            assert out.finish_reason is FinishReason.ERROR
        finally:
            await engine.shutdown()

    asyncio.run(main())
