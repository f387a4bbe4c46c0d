"""Workloads: lengths, prompts, datasets and arrival processes."""
import json

import numpy as np
import pytest

from pdserve.bench.workloads import (COMMON_WORDS, arrival_times, jsonl_requests, sample_lengths,
                                     synthetic_requests)


def test_lengths_are_uniform_within_the_range_ratio():
    rng = np.random.default_rng(0)
    lengths = sample_lengths(rng, 2000, 100, 0.1)
    assert min(lengths) == 90 and max(lengths) == 110     # both ends reachable, nothing outside
    assert sample_lengths(rng, 5, 100, 0.0) == [100] * 5
    assert min(sample_lengths(rng, 100, 2, 0.9)) >= 1


def test_output_lengths_can_vary_by_their_own_ratio():
    # the decode-heavy workload of the GPU comparison: input 256-1,024, output 512-1,024
    specs = synthetic_requests(endpoint="completions", num_prompts=2000, input_len=640, output_len=768,
                               range_ratio=0.6, output_range_ratio=1 / 3, seed=0)
    inputs, outputs = [s.prompt_len for s in specs], [s.output_len for s in specs]
    assert (min(inputs), max(inputs)) == (256, 1024) and (min(outputs), max(outputs)) == (512, 1024)
    same = synthetic_requests(endpoint="completions", num_prompts=50, input_len=64, output_len=64,
                              range_ratio=0.5, seed=0)
    assert same == synthetic_requests(endpoint="completions", num_prompts=50, input_len=64, output_len=64,
                                      range_ratio=0.5, output_range_ratio=None, seed=0)


def test_random_completions_prompts_are_token_ids_in_the_vocab_range_and_seeded():
    specs = synthetic_requests(endpoint="completions", num_prompts=4, input_len=32, output_len=8,
                               vocab_range=(1000, 1100), seed=1)
    assert all(len(s.prompt) == 32 == s.prompt_len and s.output_len == 8 and s.messages is None for s in specs)
    assert all(1000 <= t < 1100 for s in specs for t in s.prompt)
    again = synthetic_requests(endpoint="completions", num_prompts=4, input_len=32, output_len=8,
                               vocab_range=(1000, 1100), seed=1)
    other = synthetic_requests(endpoint="completions", num_prompts=4, input_len=32, output_len=8,
                               vocab_range=(1000, 1100), seed=2)
    assert specs == again and specs != other


def test_random_chat_prompts_are_common_words():
    specs = synthetic_requests(endpoint="chat", num_prompts=3, input_len=20, output_len=4)
    for s in specs:
        assert s.prompt is None and s.messages[0]["role"] == "user"
        words = s.messages[0]["content"].split()
        assert len(words) == 20 and set(words) <= set(COMMON_WORDS)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prefix_shared_prompts_share_the_prefix_and_differ_after_it(endpoint):
    specs = synthetic_requests(endpoint=endpoint, num_prompts=3, input_len=16, output_len=4, prefix_len=24)
    if endpoint == "completions":
        seqs = [s.prompt for s in specs]
    else:
        seqs = [s.messages[0]["content"].split() for s in specs]
    assert all(len(x) == 40 for x in seqs)
    assert seqs[0][:24] == seqs[1][:24] == seqs[2][:24]
    assert len({tuple(x[24:]) for x in seqs}) == 3


def test_jsonl_dataset_reads_prompts_messages_and_output_len_and_repeats(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "hello there", "output_len": 7}) + "\n\n"
                    + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    chat = jsonl_requests(path, endpoint="chat", num_prompts=3, output_len=5)
    assert [s.output_len for s in chat] == [7, 5, 7]
    assert chat[0].messages == [{"role": "user", "content": "hello there"}]
    assert chat[1].messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"d.jsonl:3: endpoint completions needs \"prompt\""):
        jsonl_requests(path, endpoint="completions", num_prompts=2, output_len=5)
    with pytest.raises(ValueError, match="cannot read"):
        jsonl_requests(tmp_path / "missing.jsonl", endpoint="chat", num_prompts=1, output_len=5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        jsonl_requests(bad, endpoint="chat", num_prompts=1, output_len=5)


def test_arrivals_have_the_requested_rate_and_burstiness():
    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5), (0.25, 2.0)):  # gamma: CV = 1 / sqrt(shape)
        t = arrival_times(20000, request_rate=10.0, burstiness=burstiness, seed=0)
        gaps = np.diff(t)
        assert t[0] == 0.0
        assert gaps.mean() == pytest.approx(0.1, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    assert arrival_times(5, 2.0, seed=3) == arrival_times(5, 2.0, seed=3)
