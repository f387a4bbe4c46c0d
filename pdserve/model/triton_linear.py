"""Triton kernel for y = x W^T with few rows of x, for the o and down projections of small decode steps.

With 1 .. 16 rows a matmul reads every weight once and does almost no arithmetic per byte. cuBLAS
runs the o and down projections of Llama-3.1-8B as split-K GEMMs plus a reduction kernel: in a
batch-1 step of ~400 kernels each kernel's launch gap and ramp count. This kernel streams W once per
call: a program owns BLOCK_N output features and walks the whole K dimension in BLOCK_K tiles,
software-pipelined num_stages deep; no split, no second kernel. The tile product runs on the tensor
cores with the rows padded to 16 (even for one row: Triton pipelines only the loads that feed a
tl.dot, and the padding costs nothing in a kernel bound by the weight bytes). Measured on one H200 as
the model calls them (benchmarks/gpu_gemv_sweep.py, one row, each time a graph of calls): o 10.9 us
against cuBLAS's 12.6; down, with the SwiGLU kernel before it, 34.7 against 35.0. qkv, gate_up and
lm_head are single cuBLAS kernels at 3.1-4.2 TB/s that this kernel does not beat, so they stay on
cuBLAS. A variant that formed SwiGLU inside the down kernel (one kernel fewer) was several times
slower in a trial and was dropped (docs/gpu.md).

The sums are taken in another order than cuBLAS's, so results differ from F.linear in the last bits:
model/layers.py routes here only bf16/fp16 (float32 stays on cuBLAS, bit-comparable with transformers).
"""
from __future__ import annotations

import torch

from pdserve.model import triton_attention

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

MAX_ROWS = 16
# One H200 (gpu_gemv_sweep.py, 2026-11-29): the fastest tiles for the o and down projections of the
# Llama-3.1-8B shape with one row, in the tile sweep (11.6 and 31.8 us; cuBLAS 12.6 and 31.9 us, each two
# kernels); the call-site figures in the docstring above are from a later run of the same script.
CONFIG = {"BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 4, "num_stages": 4}


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_rows"])
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, num_rows, N, K, stride_xm, stride_wn, stride_ym,
                     ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr):
        """y[:num_rows] = x W^T (+ b)."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        m = tl.arange(0, ROWS_PAD)
        m_ok = m < num_rows
        w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
        x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([ROWS_PAD, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            if EVEN_K:
                w_mask = n_ok[:, None]
                x_mask = m_ok[:, None]
            else:
                w_mask = n_ok[:, None] & (k[None, :] < K)
                x_mask = m_ok[:, None] & (k[None, :] < K)
            w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)
            x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)                                # [ROWS_PAD, BLOCK_N]
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def shared_memory_bytes(cfg: dict) -> int:
    """Shared memory a program of `cfg` takes with 16-bit inputs: num_stages - 1 tiles of W and x in
    flight (147,456 B for CONFIG, as Triton's compile for sm_90 reports)."""
    return (cfg["num_stages"] - 1) * (cfg["BLOCK_N"] + MAX_ROWS) * cfg["BLOCK_K"] * 2


def fits(max_shared_mem: int, cfg: dict | None = None) -> bool:
    """Whether a GPU with this much shared memory per block (opt-in) can run the kernel: an H100/H200
    (227 KiB) or A100 (163 KiB) can; a GPU with ~99 KiB (most consumer and L-series parts) cannot, and
    keeps cuBLAS rather than failing at its first small step."""
    return max_shared_mem >= shared_memory_bytes(cfg or CONFIG)


def enough_programs(out_features: int, num_sms: int, cfg: dict | None = None) -> bool:
    """Whether the output features give about one program per SM. A program streams its rows of W at
    what one SM can pull, so fewer programs leave bandwidth unused (a 896-wide projection would run 28
    programs on 132 SMs). Measured only on the 8B shapes: 4,096 features, 128 programs on 132 SMs."""
    return -(-out_features // (cfg or CONFIG)["BLOCK_N"]) >= 0.9 * num_sms


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear_triton serves this product: CUDA, 16-bit floats, 2-D x of 1 .. MAX_ROWS rows,
    contiguous last dims, enough output features to fill the GPU, the shared memory the tiles need."""
    return (HAS_TRITON and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(-1) == 1 and weight.stride(-1) == 1
            and enough_programs(weight.shape[0], triton_attention.num_sms(x.device))
            and fits(triton_attention.max_shared_memory(x.device)))


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M <= MAX_ROWS, K], weight [N, K] (see supports())."""
    cfg = config or CONFIG
    num_rows = x.shape[0]
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"linear_triton: x has {x.shape[1]} columns for a weight of {k} inputs")
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, y, num_rows, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        ROWS_PAD=MAX_ROWS, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], EVEN_K=k % cfg["BLOCK_K"] == 0,
        HAS_BIAS=bias is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y
