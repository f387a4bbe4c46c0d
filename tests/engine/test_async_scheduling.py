"""Async scheduling (step N+1 scheduled and launched before step N lands; the default on CUDA) gives
the same tokens as the synchronous loop, on CPU where the engine can be made to run it."""
from __future__ import annotations

import pytest

from pdserve.core.batch import PLACEHOLDER_TOKEN_ID
from pdserve.engine.llm import LLM
from pdserve.sampling_params import SamplingParams
from pdserve.worker import model_runner

PROMPTS = ["The capital of France is", "def reverse(s):", "Once upon a time", "1, 2, 3, 4,",
           "A haiku about the sea:", "The three primary colours are"]


def _params():
    # The shortest request second: it finishes between two others, which leaves a gap in the rows
    # the next step fills its placeholders from.
    return [SamplingParams(max_tokens=n, temperature=0.0) for n in (9, 3, 15)] + [
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7),       # seeded: reproducible
        SamplingParams(max_tokens=24, temperature=0.0, stop=[" the", "\n"]),      # a stop string
        SamplingParams(max_tokens=1, temperature=0.0)]                           # done after its prompt


def _run(llm, async_scheduling: bool, params=None):
    llm.engine.async_scheduling = async_scheduling
    try:
        results = llm.run([llm.add(p, sp) for p, sp in zip(PROMPTS, params or _params())])
        return [(r.token_ids, r.text, r.finish_reason) for r in results]
    finally:
        llm.engine.async_scheduling = False


def test_same_outputs_as_synchronous_loop(default_llm, monkeypatch):
    sync = _run(default_llm, False)
    placeholders = []
    launch = default_llm.engine.runner.launch

    def spying_launch(out):
        placeholders.extend(s.request_id for s in out.scheduled if s.token_ids == [PLACEHOLDER_TOKEN_ID])
        return launch(out)
    fills = []  # (rows, sources) of each placeholder fill, each a slice or None
    original, build = model_runner.contiguous_run, default_llm.engine.runner._launch

    def spying_build(out):
        before = len(calls)
        handle = build(out)
        if len(calls) > before:
            fills.append(tuple(calls[before:]))
        return handle
    calls = []
    monkeypatch.setattr(model_runner, "contiguous_run", lambda values: calls.append(original(values)) or calls[-1])
    monkeypatch.setattr(default_llm.engine.runner, "_launch", spying_build)
    default_llm.engine.runner.launch = spying_launch
    try:
        assert _run(default_llm, True) == sync
    finally:
        del default_llm.engine.runner.launch
    assert placeholders  # decodes really were launched before their input token had landed
    # Both ways of filling placeholders ran: one copy of a run of rows from a run of sources, and an
    # index where a request finished between the steps and left a gap in the sources.
    assert any(all(isinstance(part, slice) for part in fill) for fill in fills)
    assert any(None in fill for fill in fills)
    assert not default_llm.engine.step_in_flight
    kv = default_llm.engine.scheduler.kv
    assert not kv.req_to_blocks and kv.num_free_blocks == kv.pool.num_blocks


@pytest.mark.parametrize("seeded", [False, True])
def test_same_outputs_under_preemption_and_chunked_prefill(seeded):
    """Seeded: a request preempted while its sample is in flight has that sample dropped, and its
    generator must rewind the draw, or the recomputed token comes from the next one."""
    llm = LLM("default", num_blocks=8, max_num_batched_tokens=7, enable_prefix_caching=False)
    params = [SamplingParams(max_tokens=40, temperature=0.8 if seeded else 0.0, seed=i if seeded else None,
                             ignore_eos=True) for i in range(6)]  # 18 blocks wanted
    try:
        sync = _run(llm, False, params)
        preemptions = llm.engine.scheduler.num_preemptions
        dropped = []
        launch = llm.engine.runner.launch
        llm.engine.runner.launch = lambda out: dropped.extend(out.dropped_sample_ids) or launch(out)
        assert _run(llm, True, params) == sync
        assert dropped  # some preemption did drop a sample in flight (the case the rewind is for)
        assert llm.engine.scheduler.num_preemptions > preemptions > 0
        assert llm.engine.scheduler.kv.num_free_blocks == 8
    finally:
        llm.shutdown()


def test_abort_while_a_step_is_in_flight(default_llm):
    engine = default_llm.engine
    engine.async_scheduling = True
    try:
        engine.add_request("x", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        engine.step()
        engine.step()
        assert engine.step_in_flight
        engine.abort(["x"])
        outputs = []
        while engine.has_work():
            outputs += engine.step()
        assert [o.finish_reason.value for o in outputs if o.request_id == "x" and o.finish_reason] == ["abort"]
        kv = engine.scheduler.kv
        assert not kv.req_to_blocks and kv.num_free_blocks == kv.pool.num_blocks
    finally:
        engine.async_scheduling = False


@pytest.mark.parametrize("flag, expected", [(None, False), (True, True), (False, False)])
def test_default_is_off_on_cpu(flag, expected):
    from pdserve.cli import build_parser, engine_config_from_args
    argv = ["serve"] + ({True: ["--async-scheduling"], False: ["--no-async-scheduling"]}.get(flag, []))
    config = engine_config_from_args(build_parser().parse_args(argv))
    assert config.scheduler.async_scheduling is flag
    from pdserve.engine.engine_core import EngineCore
    assert EngineCore.resolve_async_scheduling(config.scheduler.async_scheduling, "cpu") is expected
    assert EngineCore.resolve_async_scheduling(None, "cuda") is True


def test_contiguous_run():
    run = model_runner.contiguous_run
    assert run([3]) == slice(3, 4) and run([0, 1, 2]) == slice(0, 3)
    assert run([0, 2, 1]) is None and run([0, 1, 3]) is None and run([2, 1, 0]) is None
