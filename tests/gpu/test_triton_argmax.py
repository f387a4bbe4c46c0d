"""The Triton argmax (model/triton_argmax.py) gives torch.argmax's index: the first maximum, also when
it repeats within a chunk and across chunks, the first NaN of a row holding one, a row of -inf, a last
chunk cut short; and the sampler uses it on CUDA."""
from __future__ import annotations

import pytest
import torch

from pdserve.model import triton_argmax

pytestmark = [pytest.mark.gpu, pytest.mark.interpret_ok]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only under TRITON_INTERPRET=1
CHUNK = triton_argmax.CHUNK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab", [(1, 128256), (6, 3 * CHUNK + 5), (3, 100)])
def test_matches_torch_argmax(dtype, rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=gen)
    peak = x.max() + 1
    ties = [CHUNK + 3, CHUNK + 7, 2 * CHUNK] if vocab > 2 * CHUNK else [3, 7, vocab - 1]
    x[0, ties] = peak                                                # ties in a chunk and across chunks
    if rows > 1:
        x[1, [vocab - 1, min(CHUNK, vocab) - 1]] = peak              # in the short last chunk too
    if rows > 2:
        x[2, [vocab // 2, 10]] = float("nan")                        # NaN wins, the first one
    if rows > 3:
        x[3] = float("-inf")                                         # nothing larger: index 0
    if rows > 4:
        x[4, vocab - 1] = float("inf")
    x = x.to(DEVICE, dtype)
    assert torch.equal(triton_argmax.argmax_triton(x).cpu(), x.float().cpu().argmax(-1))


def test_strided_rows():
    x = torch.randn(4, 2 * CHUNK + 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    view = x[:, 32:32 + 2 * CHUNK]
    assert torch.equal(triton_argmax.argmax_triton(view).cpu(), view.cpu().argmax(-1))


@pytest.mark.skipif(DEVICE != "cuda", reason="the sampler routes here on CUDA only")
def test_greedy_sampling_uses_it(monkeypatch):
    from pdserve.model import sampler
    calls = []
    original = triton_argmax.argmax_triton
    monkeypatch.setattr(triton_argmax, "argmax_triton", lambda x: calls.append(x.shape) or original(x))
    logits = torch.randn(3, 5000, device=DEVICE)
    tokens = sampler.sample(logits, [0.0] * 3, [1.0] * 3, [0] * 3, [None] * 3)
    assert torch.equal(tokens, logits.argmax(-1)) and calls == [(3, 5000)]
