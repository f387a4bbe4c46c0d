"""On CUDA, a seeded request resumed after k tokens continues the random stream of the run it resumes:
skip_draws advances a CUDA generator as k sampling steps did (model/sampler.py), in a batch of other
rows as well, with the vocabulary of the 8B shapes."""
from __future__ import annotations

import pytest
import torch

from pdserve.model.sampler import sample, skip_draws

pytestmark = pytest.mark.gpu
VOCAB = 128256


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 0), (0.8, 0.9, 50)])
def test_skip_draws_on_cuda_continues_the_uninterrupted_stream(temperature, top_p, top_k):
    gen = torch.Generator(device="cuda").manual_seed(3)
    steps = [torch.randn(4, VOCAB, device="cuda", generator=gen) for _ in range(10)]

    def run(generator, logits_steps):
        # row 1 is the seeded request; rows 0, 2 and 3: unseeded, greedy, another seeded one
        return [int(sample(logits, [1.0, temperature, 0.0, 0.9], [1.0, top_p, 1.0, 0.8], [0, top_k, 0, 3],
                           [None, generator, None, _seeded(5)])[1]) for logits in logits_steps]

    whole = run(_seeded(77), steps)
    assert len(set(whole)) > 1
    for k in (1, 4, 9):
        generator = _seeded(77)
        skip_draws(generator, VOCAB, k, torch.device("cuda"))
        assert run(generator, steps[k:]) == whole[k:], k
