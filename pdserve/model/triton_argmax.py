"""Row-wise argmax over a large vocabulary in two Triton kernels, for sampling on CUDA.

torch reduces a row of logits.argmax(-1) in one thread block, so a batch of one 128,256-wide row keeps
one SM busy for ~30 us while the rest wait (one H200, benchmarks/gpu_step_overhead.py). Here the first
kernel takes the maximum of every CHUNK-wide slice of every row on its own program, the second picks
the winning slice of each row. The result is torch.argmax's: the first index of the maximum, and the
first NaN where a row holds one (torch counts NaN as the largest value).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

CHUNK = 1024
MAX_CHUNKS = 1024  # the second kernel holds one row's chunk results in one block: vocabularies to 1M


if HAS_TRITON:

    @triton.jit
    def _first_max(values, index, mask, BIG: tl.constexpr):
        """(the maximum, its first index) over a block, NaN counted as the largest value; masked-out
        lanes count for nothing (an empty or all -inf block gives -inf and its first valid index)."""
        is_nan = (values != values) & mask
        first_nan = tl.min(tl.where(is_nan, index, BIG), axis=0)
        values = tl.where(mask & ~is_nan, values, float("-inf"))
        peak = tl.max(values, axis=0)
        first_peak = tl.min(tl.where(mask & (values == peak), index, BIG), axis=0)
        has_nan = first_nan < BIG
        return tl.where(has_nan, float("nan"), peak), tl.where(has_nan, first_nan, first_peak)

    @triton.jit
    def _chunk_argmax_kernel(x_ptr, val_ptr, idx_ptr, n_cols, stride_x, num_chunks,
                             CHUNK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
        peak, first = _first_max(x, cols, mask, 2**31 - 1)
        tl.store(val_ptr + row * num_chunks + chunk, peak)
        tl.store(idx_ptr + row * num_chunks + chunk, first)

    @triton.jit
    def _row_argmax_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunks = tl.arange(0, BLOCK)
        mask = chunks < num_chunks
        values = tl.load(val_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
        # Chunks cover the row in order, so the first winning chunk holds the first winning index.
        _, best = _first_max(values, chunks, mask, BLOCK)
        tl.store(out_ptr + row, tl.load(idx_ptr + row * num_chunks + best).to(tl.int64))


def supports(x: torch.Tensor) -> bool:
    return (HAS_TRITON and x.is_cuda and x.dim() == 2 and x.shape[0] > 0 and x.shape[1] > 0 and x.stride(-1) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and triton.cdiv(x.shape[1], CHUNK) <= MAX_CHUNKS)


def argmax_triton(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for x [N, V] on CUDA (see supports()); [N] int64."""
    rows, n_cols = x.shape
    num_chunks = triton.cdiv(n_cols, CHUNK)
    values = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    index = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _chunk_argmax_kernel[(rows, num_chunks)](x, values, index, n_cols, x.stride(0), num_chunks,
                                             CHUNK=CHUNK, num_warps=4)
    _row_argmax_kernel[(rows,)](values, index, out, num_chunks,
                                BLOCK=max(16, triton.next_power_of_2(num_chunks)), num_warps=4)
    return out
