"""Every Triton kernel compiles for Hopper (sm_90) with the constants serving uses, here, without a GPU:
the Triton interpreter (tests/gpu under TRITON_INTERPRET=1) runs kernels as numpy and so accepts
programs the compiler rejects (a variable that changes shape inside an `if`, say). Skipped where
Triton is not installed (CI installs the CPU stack only)."""
from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pdserve.model import triton_attention as ta  # noqa: E402
from pdserve.model import triton_argmax, triton_linear, triton_norm  # noqa: E402

FLOATS = {"scale_log2", "eps"}


def compile_for_hopper(kernel, pointers: dict[str, str], constexprs: dict, aligned: tuple[str, ...] = (),
                       **options):
    """aligned: arguments to declare multiples of 16 (16-byte aligned pointers), as Triton's launcher
    finds them at run time; only with those does the compiler pipeline loads through shared memory."""
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, pointers["default"])
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
        if name in aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 128), (6, 3, 80)])
def test_rope_write_kv_kernel_compiles(dtype, heads, kv_heads, head_dim):
    half = head_dim // 2
    kernel = compile_for_hopper(
        ta._rope_write_kv_kernel,
        {"default": f"*{dtype}", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64"},
        dict(NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEADS_PAD=ta._next_pow2(heads),
             KV_HEADS_PAD=ta._next_pow2(kv_heads), HALF=half, HALF_PAD=ta._next_pow2(half), ROUND=dtype != "fp32"),
        enable_fp_fusion=False, num_warps=4)
    # Bit-identical to the reference means no contraction: each product rounded before the sum. With
    # fusion on (Triton's default), the compiler emitted fma.rn.bf16 and the H200 run differed in ulps.
    assert "fma." not in kernel.asm["ptx"]


@pytest.mark.parametrize("dtype, ieee", [("bf16", False), ("fp32", True)])
@pytest.mark.parametrize("is_decode, block_q, num_splits", [(True, 1, 1), (True, 1, 4), (True, 1, 16), (True, 1, 64),
                                                            (False, 32, 1), (False, 2, 1)])
def test_attention_kernels_compile(dtype, ieee, is_decode, block_q, num_splits):
    if is_decode:
        cfg = ta.decode_launch_config(num_splits, ieee)
    else:  # as _launch_prefill sets them
        cfg = dict(ta.PREFILL_CONFIG, **({"BLOCK_N": 32, "num_stages": min(ta.PREFILL_CONFIG["num_stages"], 2)}
                                         if ieee else {}))
    pointers = {"default": f"*{dtype}", "table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32",
                "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
    # With the alignment Triton's launcher finds at run time (the 8B shapes), so the variant that serves,
    # software pipelining included, is the one compiled.
    aligned = tuple(a for a in ta._attn_kernel.arg_names
                    if a not in ("num_seqs", "seq_base", "tile_base", "stride_table", "scale_log2"))
    compile_for_hopper(ta._attn_kernel, pointers,
                       dict(GROUP=4, GROUP_PAD=16 if is_decode else 4, BLOCK_Q=block_q,
                            BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=128, HEAD_DIM_PAD=128,
                            NUM_SPLITS=num_splits, IS_DECODE=is_decode, IEEE=ieee),
                       aligned=aligned, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if num_splits > 1:
        compile_for_hopper(ta._reduce_kernel, {"default": "*fp32", "out_ptr": f"*{dtype}"},
                           dict(NUM_SPLITS=num_splits, HEAD_DIM=128, HEAD_DIM_PAD=128))


def test_write_kv_kernel_compiles():
    compile_for_hopper(ta._write_kv_kernel, {"default": "*bf16", "slot_ptr": "*i64"}, dict(BLOCK_H=8, BLOCK_D=128))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("even_k, bias", [(True, False), (False, True)])
def test_small_batch_linear_kernel_compiles(dtype, even_k, bias):
    cfg = triton_linear.CONFIG
    # The 8B shapes: every pointer, N, K and stride a multiple of 16 (num_rows is not specialized).
    aligned = tuple(a for a in triton_linear._gemv_kernel.arg_names if a != "num_rows")
    kernel = compile_for_hopper(triton_linear._gemv_kernel, {"default": f"*{dtype}"},
                                dict(ROWS_PAD=triton_linear.MAX_ROWS, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                                     EVEN_K=even_k, HAS_BIAS=bias),
                                aligned=aligned, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    # The weight stream is pipelined, and triton_linear.fits() counts the shared memory that takes.
    assert "cp.async" in kernel.asm["ptx"]
    assert kernel.metadata.shared == triton_linear.shared_memory_bytes(cfg)


def test_prefill_tiles_fit_the_shared_memory_they_are_chosen_for():
    """triton_attention.prefill_config() picks tiles by the GPU's shared memory: the default ones take
    PREFILL_SHARED_BYTES at head_dim 128, the fallback fits a 99 KiB GPU."""
    pointers = {"default": "*bf16", "table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32",
                "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
    aligned = tuple(a for a in ta._attn_kernel.arg_names
                    if a not in ("num_seqs", "seq_base", "tile_base", "stride_table", "scale_log2"))
    shared = {}
    for name, cfg in (("default", ta.PREFILL_CONFIG), ("small", ta.PREFILL_CONFIG_SMALL_SMEM)):
        kernel = compile_for_hopper(
            ta._attn_kernel, pointers,
            dict(GROUP=4, GROUP_PAD=4, BLOCK_Q=cfg["BLOCK_M"] // 4, BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=128,
                 HEAD_DIM_PAD=128, NUM_SPLITS=1, IS_DECODE=False, IEEE=False),
            aligned=aligned, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        shared[name] = kernel.metadata.shared
    assert shared["default"] == ta.PREFILL_SHARED_BYTES
    assert shared["small"] <= 101_376


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_argmax_kernels_compile(dtype):
    # A 128,256-wide vocabulary: pointers, width and row stride multiples of 16, 126 chunks.
    chunk_kernel = triton_argmax._chunk_argmax_kernel
    compile_for_hopper(chunk_kernel, {"default": f"*{dtype}", "val_ptr": "*fp32", "idx_ptr": "*i32"},
                       dict(CHUNK=triton_argmax.CHUNK), num_warps=4,
                       aligned=tuple(a for a in chunk_kernel.arg_names if a != "num_chunks"))
    compile_for_hopper(triton_argmax._row_argmax_kernel,
                       {"default": "*fp32", "idx_ptr": "*i32", "out_ptr": "*i64"}, dict(BLOCK=128), num_warps=4,
                       aligned=("val_ptr", "idx_ptr", "out_ptr"))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_kernel_compiles(dtype, residual):
    kernel = triton_norm._rms_norm_kernel
    compile_for_hopper(kernel, {"default": f"*{dtype}"}, dict(HAS_RESIDUAL=residual, BLOCK=4096), num_warps=8,
                       aligned=tuple(a for a in kernel.arg_names if a != "eps"))
