"""Workloads: lengths, prompts, datasets and arrival processes."""
import json

import numpy as np
import pytest

from pdserve.bench.workloads import (ASSISTANT_TURN, COMMON_WORDS, USER_TURN, arrival_times, jsonl_requests,
                                     mixed_requests, multi_turn_conversations, sample_lengths, synthetic_requests)


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


# ---- mixed --------------------------------------------------------------------------------------

def mixed(**overrides):
    base = dict(endpoint="completions", num_prompts=200, output_len=16, seed=0)
    return mixed_requests(**{**base, **overrides})


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_mixed_is_the_asked_fraction_of_short_prompts_within_their_lengths(endpoint):
    specs = mixed(endpoint=endpoint, short_fraction=0.8, short_len=(32, 128), long_len=(1024, 2048))
    lengths = [len(s.prompt) if endpoint == "completions" else len(s.messages[0]["content"].split())
               for s in specs]
    assert lengths == [s.prompt_len for s in specs]
    short = [n for n in lengths if n <= 128]
    assert len(short) == 160 and min(short) >= 32                       # exactly 80 % of 200
    assert all(1024 <= n <= 2048 for n in lengths if n > 128)
    assert 0 < lengths.index(max(lengths)) and lengths[-20:] != sorted(lengths[-20:])   # interleaved, not sorted
    assert {s.output_len for s in specs} == {16}
    assert len(mixed(num_prompts=10, short_fraction=0.25)) == 10
    assert sum(s.prompt_len <= 128 for s in mixed(num_prompts=10, short_fraction=0.25)) == 2   # round(2.5)
    assert all(s.prompt_len > 128 for s in mixed(num_prompts=5, short_fraction=0.0))
    assert all(s.prompt_len <= 128 for s in mixed(num_prompts=5, short_fraction=1.0))


def test_mixed_is_seeded_and_its_output_lengths_vary_by_their_ratio():
    assert mixed(endpoint="chat", num_prompts=20) == mixed(endpoint="chat", num_prompts=20)
    assert mixed(num_prompts=20) == mixed(num_prompts=20) != mixed(num_prompts=20, seed=1)
    outputs = [s.output_len for s in mixed(output_len=100, output_range_ratio=0.5)]
    assert min(outputs) >= 50 and max(outputs) <= 150 and len(set(outputs)) > 10


# ---- multi-turn ---------------------------------------------------------------------------------

def conversations(**overrides):
    base = dict(num_users=6, num_turns=4, num_groups=3, system_len=200, turn_len=20, output_len=30, seed=0)
    return multi_turn_conversations(**{**base, **overrides})


def test_multi_turn_users_share_their_groups_system_prompt():
    convs = conversations()
    assert [c.user for c in convs] == list(range(6)) and [c.group for c in convs] == [0, 1, 2, 0, 1, 2]
    assert convs[0].system == convs[3].system and len({c.system for c in convs}) == 3
    assert all(len(c.system.split()) == 200 and set(c.system.split()) <= set(COMMON_WORDS) for c in convs)
    first = [c.requests(endpoint="completions")[0].prompt for c in convs]
    assert first[0].startswith(convs[0].system) and first[0] != first[3]   # same system prompt, own message


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_multi_turn_prompts_grow_each_starting_with_the_previous_turns_prompt_and_answer(endpoint):
    conv = conversations(range_ratio=0.5)[1]
    answers = [" sure, here is answer %d." % k for k in range(conv.num_turns)]   # what a server streamed back
    specs = [conv.request(k, answers, endpoint=endpoint) for k in range(conv.num_turns)]
    assert [s.output_len for s in specs] == list(conv.output_lens)
    if endpoint == "completions":
        prompts = [s.prompt for s in specs]
        for k in range(1, conv.num_turns):
            assert prompts[k].startswith(prompts[k - 1] + answers[k - 1])        # character for character
            assert prompts[k].endswith(conv.user_messages[k] + ASSISTANT_TURN)
        assert prompts[0] == conv.system + USER_TURN + conv.user_messages[0] + ASSISTANT_TURN
    else:
        histories = [s.messages for s in specs]
        assert histories[0] == [{"role": "system", "content": conv.system},
                                {"role": "user", "content": conv.user_messages[0]}]
        for k in range(1, conv.num_turns):
            assert histories[k][:len(histories[k - 1])] == histories[k - 1]
            assert histories[k][len(histories[k - 1]):] == [{"role": "assistant", "content": answers[k - 1]},
                                                            {"role": "user", "content": conv.user_messages[k]}]
        prompts = ["".join(m["content"] for m in h) for h in histories]
        assert all(prompts[k].startswith(prompts[k - 1]) for k in range(1, conv.num_turns))
    assert all(len(prompts[k]) > len(prompts[k - 1]) for k in range(1, conv.num_turns))
    # prompt_len counts the words of the whole history
    assert specs[-1].prompt_len == len(conv.system.split()) + sum(len(m.split()) for m in conv.user_messages) \
        + sum(len(a.split()) for a in answers[:-1])


def test_multi_turn_placeholder_answers_have_the_turns_output_length():
    conv = conversations(output_len=40, range_ratio=0.5)[0]
    assert [len(a.split()) for a in conv.placeholder_answers] == list(conv.output_lens)
    assert all(a.startswith(" ") for a in conv.placeholder_answers)   # as a completion after "Assistant:"
    assert min(conv.output_lens) >= 20 and max(conv.output_lens) <= 60
    specs = conv.requests(endpoint="completions")
    assert specs[1].prompt.startswith(specs[0].prompt + conv.placeholder_answers[0] + USER_TURN)
    with pytest.raises(ValueError, match="turn 2"):
        conv.request(2, conv.placeholder_answers[:1], endpoint="chat")


def test_multi_turn_is_seeded_and_lengths_follow_the_turn_len():
    assert conversations() == conversations() != conversations(seed=1)
    lens = [len(m.split()) for c in conversations(num_users=50, range_ratio=0.5) for m in c.user_messages]
    assert min(lens) >= 10 and max(lens) <= 30 and len(set(lens)) > 5
    assert {len(m.split()) for c in conversations() for m in c.user_messages} == {20}


def test_common_words_are_about_one_token_each_for_the_default_models_tokenizer():
    # the text datasets aim at token counts through word counts; check it holds for SmolLM2
    try:
        from pdserve.model.loader import load_tokenizer
        tokenizer = load_tokenizer("default")
    except Exception as e:  # noqa: BLE001 - no torch/transformers or no model package here
        pytest.skip(f"default model's tokenizer not available: {e}")
    conv = conversations(num_users=1, system_len=1000, turn_len=100)[0]
    texts = [conv.system, *conv.user_messages, *(s.messages[0]["content"] for s in mixed(endpoint="chat",
                                                                                      num_prompts=10))]
    for text in texts:
        num_tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
        assert 0.9 <= num_tokens / len(text.split()) <= 1.15, (num_tokens, len(text.split()))
    prompt = conv.requests(endpoint="completions")[-1]
    num_tokens = len(tokenizer(prompt.prompt, add_special_tokens=False).input_ids)
    assert 0.9 <= num_tokens / prompt.prompt_len <= 1.15   # the transcript's markers add a few tokens per turn
