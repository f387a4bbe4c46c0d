"""LlamaModel (loaded by load_model from a HF directory) against transformers on tiny random models."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.model.loader import load_model
from tests.helpers_models import PagedRunner

ARCHS = ["llama", "qwen2", "qwen3"]
PROMPT = [(i * 37 + 11) % 256 for i in range(37)]  # 37 tokens: crosses four 8-slot blocks


@pytest.fixture(scope="module")
def models(tiny_model_paths):
    """arch -> (ours, HF's), both fp32 on CPU."""
    loaded = {}
    for arch in ARCHS:
        ours, _ = load_model(tiny_model_paths[arch], torch.float32, torch.device("cpu"))
        theirs = AutoModelForCausalLM.from_pretrained(tiny_model_paths[arch], local_files_only=True,
                                                      dtype=torch.float32).eval()
        loaded[arch] = (ours, theirs)
    return loaded


@torch.inference_mode()
def hf_logits(hf_model, token_ids):
    return hf_model(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_hf(models, arch):
    ours, theirs = models[arch]
    runner = PagedRunner(ours)
    logits = runner.step([PROMPT], [len(PROMPT)], [runner.blocks_for(len(PROMPT))])
    expected = hf_logits(theirs, PROMPT)
    assert expected.std() > 1.0  # the tiny model's logits are peaked enough for greedy to be stable
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_over_cached_prefix_matches_hf(models, arch):
    ours, theirs = models[arch]
    runner = PagedRunner(ours)
    blocks = runner.blocks_for(len(PROMPT))
    runner.step([PROMPT[:20]], [20], [blocks])  # the prefix, cached
    logits = runner.step([PROMPT[20:]], [len(PROMPT)], [blocks])
    torch.testing.assert_close(logits, hf_logits(theirs, PROMPT)[20:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_20_tokens_match_hf(models, arch):
    ours, theirs = models[arch]
    runner = PagedRunner(ours)
    blocks = runner.blocks_for(len(PROMPT) + 20)
    token_ids = list(PROMPT)
    next_id = int(runner.step([token_ids], [len(token_ids)], [blocks])[-1].argmax())
    for _ in range(20):  # one decode step per token over the paged cache
        token_ids.append(next_id)
        next_id = int(runner.step([[next_id]], [len(token_ids)], [blocks])[0].argmax())
    ours_out = token_ids[len(PROMPT):] + [next_id]

    hf_ids = list(PROMPT)
    for _ in range(21):  # HF recomputes the whole sequence each step: an independent path
        hf_ids.append(int(hf_logits(theirs, hf_ids)[-1].argmax()))
    assert ours_out == hf_ids[len(PROMPT):]


def test_mixed_batch_equals_each_sequence_alone(models):
    """A step holding a prefill chunk over a cached prefix, a fresh prefill and a decode gives each
    sequence the logits it gets alone."""
    ours, theirs = models["llama"]
    runner = PagedRunner(ours)
    a, b, c = PROMPT[:30], PROMPT[5:17], PROMPT[3:12]
    blocks_a, blocks_b, blocks_c = (runner.blocks_for(len(s)) for s in (a, b, c))
    runner.step([a[:18], c[:8]], [18, 8], [blocks_a, blocks_c])  # cache a's prefix and c's first 8
    logits = runner.step([a[18:], b, c[8:]], [30, 12, 9], [blocks_a, blocks_b, blocks_c])
    torch.testing.assert_close(logits[:12], hf_logits(theirs, a)[18:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[12:24], hf_logits(theirs, b), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[24:], hf_logits(theirs, c)[8:], atol=1e-4, rtol=1e-4)
