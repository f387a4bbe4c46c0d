"""RMSNorm, with the residual add before it, as one single-pass Triton kernel per row, for 16-bit models
on CUDA.

A program holds its whole row in registers: one load of x and the residual, one store of each result.
Against the torch.compile kernel it replaces (model/layers.py, compiled for any shape), one H200, one
call in a CUDA graph (benchmarks/gpu_step_overhead.py): 9.5 vs 10.3 us at 1 row (the graph's launch
included), 72 vs 116 us at 8,192 rows; a batch-1 decode step of the 8B shape runs 65 of them. The
arithmetic is HF's, rounding included: the residual sum rounded to the model's dtype, the mean square
and the scaling in float32, rounded, then multiplied by the weight and rounded again. The mean
square's own rounding (sum order, division) differs from torch's, so a normed value may differ in the
last bit.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

MAX_HIDDEN = 16384  # a row in registers: up to 64 values a thread at 8 warps


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, n_cols, eps,
                         stride_x, stride_r, stride_out, stride_r_out,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(r_out_ptr + row * stride_r_out + cols, x, mask=mask)
        xf = x.to(tl.float32)
        mean_square = tl.sum(xf * xf, axis=0) / n_cols
        y = (xf * tl.math.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * y.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """CUDA, 16-bit (float32 stays on the compiled path, which the fp32 transformers-equality tests
    cover), 2-D rows with a contiguous last dim, a hidden size that fits a program's registers."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    return (HAS_TRITON and x.is_cuda and x.dim() == 2 and x.shape[0] > 0 and x.shape[1] <= MAX_HIDDEN
            and x.dtype in (torch.bfloat16, torch.float16) and all(t.dtype == x.dtype for t in tensors)
            and all(t.stride(-1) == 1 for t in tensors) and weight.shape == (x.shape[1],)
            and (residual is None or residual.shape == x.shape))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    """norm(x), or with residual (norm(x + residual), x + residual), for x [T, hidden] (see supports())."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    r_out = torch.empty_like(x) if residual is not None else out
    block = triton.next_power_of_2(hidden)
    r = residual if residual is not None else x
    _rms_norm_kernel[(rows,)](x, r, weight, out, r_out, hidden, eps,
                              x.stride(0), r.stride(0), out.stride(0), r_out.stride(0),
                              HAS_RESIDUAL=residual is not None, BLOCK=block,
                              num_warps=max(1, min(8, block // 512)))
    return out if residual is None else (out, r_out)
