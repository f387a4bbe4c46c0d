"""The Triton RMSNorm (model/triton_norm.py) against the eager reference the model uses on CPU: the
same residual sum bit for bit, the normed rows equal but for a rare last-bit difference (the order
of the mean-square sum); and RMSNorm routes 16-bit CUDA rows there."""
from __future__ import annotations

import pytest
import torch

from pdserve.model import layers, triton_norm

pytestmark = [pytest.mark.gpu, pytest.mark.interpret_ok]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only under TRITON_INTERPRET=1
# Triton's CPU interpreter (3.6) rounds float32 to bf16 by truncation: there, fp16 only.
DTYPES = [torch.float16] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]


def _close_in_last_bit(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one unit in the last place of `want`, and mostly equal."""
    assert got.shape == want.shape and got.dtype == want.dtype
    _, exponent = torch.frexp(want.float())  # |want| = m * 2**exponent, m in [0.5, 1)
    half_eps = torch.full(exponent.shape, torch.finfo(want.dtype).eps / 2, device=want.device)
    ulp = torch.ldexp(half_eps, exponent).clamp(min=torch.finfo(want.dtype).tiny)   # (same shapes: no resize)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 4096), (5, 576), (3, 100)])
def test_matches_the_reference(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=gen)
    x[-1] *= 1e-3  # a mean square of 1e-6, where eps (1e-5) sets the scale
    x = x.to(DEVICE, dtype)
    residual = (4 * torch.randn(rows, hidden, generator=gen)).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    _close_in_last_bit(triton_norm.rms_norm_triton(x, weight, 1e-5), layers._rms_norm(x, weight, 1e-5))
    out, new_residual = triton_norm.rms_norm_triton(x, weight, 1e-5, residual)
    want_out, want_residual = layers._add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, want_residual)
    _close_in_last_bit(out, want_out)


def test_a_row_of_zeros_stays_zero():
    """eps keeps 0 / rms finite: a zero row (a padded token) normalises to zeros, not NaN."""
    x = torch.zeros(2, 128, device=DEVICE, dtype=torch.float16)
    weight = torch.ones(128, device=DEVICE, dtype=torch.float16)
    assert torch.equal(triton_norm.rms_norm_triton(x, weight, 1e-6), x)


def test_strided_rows():
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16)
    view, weight = x[:, 22:278], torch.ones(256, device=DEVICE, dtype=torch.float16)
    _close_in_last_bit(triton_norm.rms_norm_triton(view, weight, 1e-6), layers._rms_norm(view, weight, 1e-6))


@pytest.mark.skipif(DEVICE != "cuda", reason="RMSNorm routes here on CUDA only")
def test_rmsnorm_module_routes_16_bit_rows_here(monkeypatch):
    calls = []
    original = triton_norm.rms_norm_triton
    monkeypatch.setattr(triton_norm, "rms_norm_triton", lambda *a: calls.append(a[0].dtype) or original(*a))
    for dtype in (torch.bfloat16, torch.float32):
        norm = layers.RMSNorm(64, 1e-6, dtype, torch.device(DEVICE))
        norm.weight.data.fill_(1.0)
        x = torch.randn(3, 64, device=DEVICE, dtype=dtype)
        norm(x)
        out, residual = norm(x, x.clone())
        assert torch.equal(residual, x + x)
    assert calls == [torch.bfloat16] * 2  # with and without the residual; float32 stays compiled
