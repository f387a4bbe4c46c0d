"""Greedy output of the whole engine equals Hugging Face transformers, and stays identical under
prefix-cache hits, chunked prefill, preemption and concurrency."""
from __future__ import annotations

import pytest

from pdserve.engine.llm import LLM
from pdserve.outputs import FinishReason
from pdserve.sampling_params import SamplingParams

from tests.conftest import hf_greedy

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a Python function that reverses a string.",
    "What is 17 times 23?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "Suggest a name for a friendly robot.",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


@pytest.fixture(scope="module")
def chat_prompts(default_llm):
    return [default_llm.chat_prompt([{"role": "user", "content": c}]) for c in CHATS]


@pytest.fixture(scope="module")
def reference(default_llm, hf_default_model, chat_prompts):
    eos = default_llm.engine.eos_token_ids
    return [hf_greedy(hf_default_model, p, 32, eos) for p in chat_prompts]


def test_default_model_matches_transformers(default_llm, chat_prompts, reference):
    results = default_llm.generate(chat_prompts, GREEDY)
    same = sum(r.token_ids == ref for r, ref in zip(results, reference))
    assert same >= 9, [(r.token_ids, ref) for r, ref in zip(results, reference) if r.token_ids != ref]
    assert all(r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for r in results)
    assert "Paris" in results[0].text


def _assert_same_as(results, expected):
    assert [r.token_ids for r in results] == expected


@pytest.fixture(scope="module")
def alone(default_llm, chat_prompts):
    """Each chat prompt run by itself, nothing cached: what every other configuration must match."""
    default_llm.engine.scheduler.kv.reset_prefix_cache()
    return [default_llm.generate([p], GREEDY)[0].token_ids for p in chat_prompts]


def test_identical_with_prefix_cache_hits(default_llm, chat_prompts):
    system = [{"role": "system", "content": "You are a concise assistant who answers in plain English "
                                            "without any preamble, lists or markdown formatting."}]
    prompts = [default_llm.chat_prompt(system + [{"role": "user", "content": c}]) for c in CHATS[:4]]
    first = [default_llm.generate([p], GREEDY)[0].token_ids for p in prompts]  # one at a time
    hits_before = default_llm.engine.scheduler.kv.prefix_cache_hits
    again = default_llm.generate(prompts, GREEDY)
    assert default_llm.engine.scheduler.kv.prefix_cache_hits - hits_before >= 4 * 16
    assert all(r.num_cached_tokens > 0 for r in again)
    _assert_same_as(again, first)


def test_identical_with_chunked_prefill_tiny_budget(chat_prompts, alone):
    llm = LLM("default", max_num_batched_tokens=7, kv_cache_memory=64 << 20, enable_prefix_caching=False)
    _assert_same_as(llm.generate(chat_prompts[:5], GREEDY), alone[:5])


def test_identical_under_preemption_with_tiny_kv_cache(chat_prompts, alone):
    llm = LLM("default", num_blocks=12, enable_prefix_caching=False)  # 192 token slots for 6 requests
    _assert_same_as(llm.generate(chat_prompts[:6], GREEDY), alone[:6])
    assert llm.engine.scheduler.num_preemptions > 0


def test_identical_with_32_concurrent_mixed_lengths(default_llm, chat_prompts):
    prompts = []
    for i in range(32):
        ids = chat_prompts[i % 10]
        prompts.append(ids[: max(1, len(ids) - (i * 7) % len(ids))] if i >= 10 else ids)
    params = [SamplingParams(max_tokens=4 + (i * 5) % 17, temperature=0.0) for i in range(32)]
    alone = [default_llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    default_llm.engine.scheduler.kv.reset_prefix_cache()
    together = default_llm.run([default_llm.add(p, sp) for p, sp in zip(prompts, params)])
    _assert_same_as(together, alone)


def test_slow_steps_are_logged_with_their_batch(default_llm, monkeypatch, caplog):
    engine = default_llm.engine
    monkeypatch.setattr(engine, "slow_step_s", 0.0)  # as PDSERVE_LOG_SLOW_STEP_MS=0: every step is slow
    with caplog.at_level("WARNING", logger="pdserve.engine.engine_core"):
        default_llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    slow = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow step")]
    assert len(slow) == 2, slow
    assert "5 tokens from 1 sequences (0 decodes; longest chunks [5])" in slow[0]
    assert "1 tokens from 1 sequences (1 decodes" in slow[1]


def test_slow_step_threshold_comes_from_the_environment(monkeypatch):
    from pdserve.engine.engine_core import _slow_step_seconds
    monkeypatch.delenv("PDSERVE_LOG_SLOW_STEP_MS", raising=False)
    assert _slow_step_seconds() is None
    monkeypatch.setenv("PDSERVE_LOG_SLOW_STEP_MS", "250")
    assert _slow_step_seconds() == 0.25
    monkeypatch.setenv("PDSERVE_LOG_SLOW_STEP_MS", "fast")
    with pytest.raises(ValueError, match="PDSERVE_LOG_SLOW_STEP_MS"):
        _slow_step_seconds()
