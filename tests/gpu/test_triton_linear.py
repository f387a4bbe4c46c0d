"""The small-batch Triton matmul (model/triton_linear.py) against F.linear: every row count it serves,
ragged and tile-aligned shapes, a bias, strided rows; and the model's Linear picks it only where it
may."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import layers, triton_attention, triton_linear
from pdserve.model.layers import Linear

pytestmark = [pytest.mark.gpu, pytest.mark.interpret_ok]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only under TRITON_INTERPRET=1
# Triton's CPU interpreter gets bf16 tl.dot wrong (3.6): there, fp16 only.
DTYPES = [torch.float16] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 16])
@pytest.mark.parametrize("n, k, bias", [(96, 512, False), (50, 200, True), (50, 512, True),
                                        (4096 + 16, 1024 + 64, False)])
def test_matches_f_linear(dtype, rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    got = triton_linear.linear_triton(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (rows, n) and got.dtype == dtype
    # fp32 accumulation in another order than cuBLAS: equal to within one rounding of the output
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_wrong_input_width_is_refused():
    x = torch.zeros(2, 64, device=DEVICE, dtype=torch.float16)
    w = torch.zeros(8, 32, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="64 columns"):
        triton_linear.linear_triton(x, w)


def test_strided_rows():
    """Rows of a wider buffer (a view with stride(0) > K), as the model's fused outputs give."""
    dtype = DTYPES[-1]
    big = torch.randn(4, 300, device=DEVICE).to(dtype)
    x = big[:, 20:276]
    w = torch.randn(64, 256, device=DEVICE).to(dtype) / 16
    torch.testing.assert_close(triton_linear.linear_triton(x, w).float(), F.linear(x.float(), w.float()),
                               rtol=1e-2, atol=1e-2)


def _fits_here() -> bool:
    return DEVICE == "cuda" and triton_linear.fits(triton_attention.max_shared_memory(torch.device("cuda")))


@pytest.mark.skipif(not _fits_here(), reason="routed to on CUDA only, where its tiles fit")
def test_supports_only_what_it_serves():
    w16 = torch.zeros(4096, 64, device=DEVICE, dtype=torch.float16)
    x16 = torch.zeros(17, 64, device=DEVICE, dtype=torch.float16)
    assert triton_linear.supports(x16[:16], w16)
    assert not triton_linear.supports(x16[:16], w16[:896])           # too few output features to fill the GPU
    assert not triton_linear.supports(x16, w16)                       # more rows than MAX_ROWS
    assert not triton_linear.supports(x16[:4].float(), w16.float())   # float32 stays on cuBLAS
    assert not triton_linear.supports(x16[:0], w16)                   # nothing to do


@pytest.mark.skipif(not _fits_here(), reason="Linear routes to Triton on CUDA only, where its tiles fit")
def test_linear_module_routes_small_batches(monkeypatch):
    monkeypatch.setattr(layers, "SMALL_BATCH_TRITON_LINEAR", True)  # whatever the environment says
    calls = []
    kernel = triton_linear.linear_triton
    monkeypatch.setattr(triton_linear, "linear_triton", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    lin = Linear(256, 4096, False, torch.bfloat16, torch.device("cuda"), small_batch_triton=True)
    plain = Linear(256, 4096, False, torch.bfloat16, torch.device("cuda"))
    fp32 = Linear(256, 4096, False, torch.float32, torch.device("cuda"), small_batch_triton=True)
    plain.weight.data.normal_(0, 0.05)
    lin.weight.data.copy_(plain.weight)
    fp32.weight.data.copy_(plain.weight)
    for rows in (1, 16, 17, 64):
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(lin(x).float(), F.linear(x.float(), lin.weight.float()), rtol=2e-2, atol=2e-2)
        plain(x)
        fp32(x.float())
    assert calls == [1, 16]  # 17 and 64 rows, the unflagged Linear and float32 stay on cuBLAS
