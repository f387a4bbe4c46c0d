"""A request resumed with the tokens another instance generated before it died (the router's stream
recovery): the rest of its output, text and usage counts are the uninterrupted run's, greedy or
seeded, with a stop string across the boundary too."""
from __future__ import annotations

import pytest

from pdserve.engine.llm import GenerationResult
from pdserve.outputs import FinishReason
from pdserve.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "Write two sentences about the sea."}]
PARAMS = {
    "greedy": SamplingParams(max_tokens=24, temperature=0.0),
    "seeded": SamplingParams(max_tokens=24, temperature=0.9, seed=1234),
    "seeded_top_k_top_p": SamplingParams(max_tokens=24, temperature=1.1, top_k=40, top_p=0.9, seed=99),
}


def run(llm, prompt, params, resumed=None) -> tuple[GenerationResult, list]:
    request_id = f"r{next(llm._ids)}"
    llm.engine.add_request(request_id, prompt, params, resumed_token_ids=resumed)
    outputs, result = [], GenerationResult(request_id, prompt)
    while True:
        for out in llm.engine.step():
            assert out.request_id == request_id
            outputs.append(out)
            result.token_ids += out.new_token_ids
            result.text += out.new_text
            result.finish_reason = out.finish_reason
        if result.finish_reason is not None and not llm.engine.step_in_flight:
            return result, outputs


def text_of_first(llm, prompt, params, k) -> str:
    """What a client had after k tokens (no stop strings: nothing held back)."""
    return run(llm, prompt, SamplingParams(**{**vars(params), "max_tokens": k}))[0].text


@pytest.mark.parametrize("name", list(PARAMS))
def test_resumed_output_is_the_uninterrupted_one(default_llm, name):
    llm, params = default_llm, PARAMS[name]
    prompt = llm.chat_prompt(MESSAGES)
    whole, _ = run(llm, prompt, params)
    n = len(whole.token_ids)   # 24, or fewer when it sampled the end of sequence
    assert n >= 10 and len(set(whole.token_ids)) > 5
    for k in (1, n // 2, n - 1):
        resumed, outputs = run(llm, prompt, params, whole.token_ids[:k])
        assert resumed.token_ids == whole.token_ids[k:], (name, k)
        assert text_of_first(llm, prompt, params, k) + resumed.text == whole.text, (name, k)
        assert resumed.finish_reason == whole.finish_reason
        # usage: the original prompt, and every output token (those resumed from included)
        assert outputs[-1].num_prompt_tokens == len(prompt) and outputs[-1].num_output_tokens == n
        assert outputs[-1].num_cached_tokens <= len(prompt)


def test_a_stop_string_across_the_boundary_stops_the_resumed_request(default_llm):
    llm, greedy = default_llm, PARAMS["greedy"]
    prompt = llm.chat_prompt(MESSAGES)
    whole, _ = run(llm, prompt, greedy)
    k = 12
    before = text_of_first(llm, prompt, greedy, k)
    stop = before[-3:] + whole.text[len(before):len(before) + 3]   # 3 characters either side
    assert len(stop) == 6 and whole.text.find(stop) == len(before) - 3
    params = SamplingParams(**{**vars(greedy), "stop": [stop]})
    uninterrupted, _ = run(llm, prompt, params)
    assert uninterrupted.finish_reason == FinishReason.STOP and uninterrupted.text == before[:-3]
    # the client had the text up to the last 5 characters (held back: a stop string could be forming)
    resumed, _ = run(llm, prompt, params, whole.token_ids[:k])
    assert resumed.finish_reason == FinishReason.STOP
    assert resumed.token_ids == uninterrupted.token_ids[k:]
    assert before[:-(len(stop) - 1)] + resumed.text == uninterrupted.text


def test_a_resume_the_engine_cannot_run_is_refused(default_llm):
    llm = default_llm
    prompt = llm.chat_prompt(MESSAGES)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.engine.add_request("full", prompt, SamplingParams(max_tokens=3), resumed_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="token ids"):
        llm.engine.add_request("vocab", prompt, SamplingParams(max_tokens=9), resumed_token_ids=[10**9])
    with pytest.raises(ValueError, match="kv_transfer_params"):
        llm.engine.add_request("kv", prompt, SamplingParams(max_tokens=9), {"do_remote_decode": True},
                               resumed_token_ids=[5])
    assert not llm.engine.scheduler.requests and not llm.engine.detokenizers
