"""Triton kernels for paged attention on the GPU: the fast path behind model/attention.py.

Kernels reading the one-tensor KV cache by strides (layer i = kv_cache[:, i], a strided view
[blocks, 2, slots, kv_heads, dim]) and the block table, never gathering K/V into new memory:

  write_kv_triton   this step's K/V into their slots; a negative slot is skipped (padded rows of a
                    CUDA-graph batch point there, so they write nothing).
  rope_write_kv_triton  the same, fused with the rotary embedding of q (in place) and k: one kernel
                    per layer instead of ~17.
  _attn_kernel      one kernel for a mixed batch (prefill chunks over a cached prefix + decodes).
                    A program owns BLOCK_Q query tokens of one sequence and ALL the query heads of one
                    KV head (GQA packed into the rows of the tile: row r = token r // GROUP_PAD,
                    head r % GROUP_PAD), so each K/V tile is loaded once for the whole group, and runs
                    a flash-attention loop (online softmax, exp2) over KV tiles of BLOCK_N tokens,
                    looking each token's block up in the block table. Tiles every row may fully see run
                    without a mask; only the diagonal tiles pay for the causal mask.
  _reduce_kernel    split-K (flash-decoding) for decode-only batches: with few sequences there are
                    too few (sequence, kv head) programs to fill 132 SMs, so each one's KV range is cut
                    into NUM_SPLITS parts whose partial (max, sum, acc) this kernel merges.

Grid of _attn_kernel for a mixed batch: num_tokens // BLOCK_Q + num_seqs programs on axis 0 (an upper
bound on the query tiles: sequence i's tiles start at query_start_loc[i] // BLOCK_Q + i); each program
finds its sequence by binary search, so the launch needs no host data beyond the token and sequence
counts and is safe to capture in a CUDA graph. Decode-only batches use one program per sequence.

Nothing here reads the host lists of AttentionMetadata except to choose tile shapes, and the split count
depends on the number of sequences only, so a captured decode graph is valid for any context lengths.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # the CPU machines need not have Triton: the reference path is used there
    HAS_TRITON = False


def is_available() -> bool:
    return HAS_TRITON


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Tile shapes: the fastest of the configurations benchmarks/gpu_bench.py and gpu_attention_sweep.py try
# on one H200 (2026-11-29; docs/gpu.md). Prefill: 333 TFLOP/s. Decode: 64-token KV tiles in two stages
# read KV at 4.25 TB/s at batch 256 x 2048 and 3.90 at batch 64; the 32-token, three-stage tiles used
# before read 3.58 / 3.48 (gpu-attention-sweep-2026-11-29.json, session 4). A second sweep put 64-token
# tiles with 2 warps and 3 stages 1 % ahead, within run-to-run noise. The layout of heads within a block
# (slots-major or heads-major) moved the chosen tiles by at most 2 %, so the cache keeps slots-major.
# Split-K decode (batch <= 4 on the 8B shape, at least SPLIT_CONFIG_MIN_SPLITS splits): light programs
# without a pipeline over 64-token tiles, with up to 64 splits at batch 1. The split count is fixed per
# batch size (a captured graph serves any context), so a split walks ceil(tiles / splits) tiles and the
# time steps up wherever that grows: 16 splits of 128-token tiles took 9.4 us per layer at batch 1 and
# 2,048 tokens but 13.2 at 2,064 and 24.3 at 8,192; 64 splits of 64-token tiles take 9.1, 9.2 and 15.8.
# At batch 4 (16 splits) the 64-token tiles won at every context up to 4,096 and were within 8 % past
# it (gpu-split-sweep-2026-11-30.json: 12 tile/split choices x 7 contexts, 32 distinct layers).
PREFILL_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}
# PREFILL_CONFIG's tiles take 160 KiB of shared memory at head_dim 128 (Triton's compile for sm_90): an
# A100 or H100/H200 holds them, a GPU with ~99 KiB per block (L4, A10G, consumer parts) does not and
# would fail at its first prefill. Those get 64 x 64 tiles (80 KiB).
PREFILL_SHARED_BYTES = 163_840
PREFILL_CONFIG_SMALL_SMEM = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
DECODE_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
DECODE_SPLIT_CONFIG = {"BLOCK_N": 64, "num_warps": 2, "num_stages": 1}
SPLIT_CONFIG_MIN_SPLITS = 16
MAX_SPLITS = 64
NUM_SMS_DEFAULT = 132


if HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, kv_ptr, slot_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_blk, stride_kv, stride_slot, stride_head,
                         block_size, num_kv_heads, head_dim,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        is_real = slot >= 0  # a padded row of a graph batch: slot -1, writes nothing
        slot = tl.maximum(slot, 0)
        block = slot // block_size
        offset = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim) & is_real
        k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
        dst = kv_ptr + block * stride_blk + offset * stride_slot + h * stride_head + d
        tl.store(dst, k, mask=mask)
        tl.store(dst + stride_kv, v, mask=mask)

    @triton.jit
    def _rotate_half(x1, x2, c, s, ROUND: tl.constexpr):
        """(x1 c - x2 s, x2 c + x1 s) in x1's dtype; c, s float32. ROUND: round every product and sum
        to that dtype, as the reference's elementwise ops do in bf16/fp16, so both give the same bits."""
        dtype = x1.dtype
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        if ROUND:
            r1 = (a1 * c).to(dtype).to(tl.float32) - (a2 * s).to(dtype).to(tl.float32)
            r2 = (a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)
        else:
            r1 = a1 * c - a2 * s
            r2 = a2 * c + a1 * s
        return r1.to(dtype), r2.to(dtype)

    @triton.jit
    def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kv_ptr, slot_ptr,
                              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
                              stride_blk, stride_kv, stride_slot, stride_head, block_size,
                              NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                              KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                              ROUND: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, HALF_PAD)[None, :]                      # [1, HALF] within each half
        c = tl.load(cos_ptr + token * stride_cs + j, mask=j < HALF)
        s = tl.load(sin_ptr + token * stride_cs + j, mask=j < HALF)
        c = c.to(q_ptr.dtype.element_ty).to(tl.float32)          # the reference casts cos/sin first
        s = s.to(q_ptr.dtype.element_ty).to(tl.float32)

        hq = tl.arange(0, HEADS_PAD)[:, None]                     # q: rotated in place
        q_mask = (hq < NUM_HEADS) & (j < HALF)
        q = q_ptr + token * stride_qt + hq * stride_qh + j
        q1, q2 = _rotate_half(tl.load(q, mask=q_mask), tl.load(q + HALF, mask=q_mask), c, s, ROUND)
        tl.store(q, q1, mask=q_mask)
        tl.store(q + HALF, q2, mask=q_mask)

        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:                                             # a padded graph row writes nothing
            hk = tl.arange(0, KV_HEADS_PAD)[:, None]
            kv_mask = (hk < NUM_KV_HEADS) & (j < HALF)
            k = k_ptr + token * stride_kt + hk * stride_kh + j
            k1, k2 = _rotate_half(tl.load(k, mask=kv_mask), tl.load(k + HALF, mask=kv_mask), c, s, ROUND)
            dst = kv_ptr + (slot // block_size) * stride_blk + (slot % block_size) * stride_slot + hk * stride_head + j
            tl.store(dst, k1, mask=kv_mask)
            tl.store(dst + HALF, k2, mask=kv_mask)
            v = v_ptr + token * stride_vt + hk * stride_vh + j
            tl.store(dst + stride_kv, tl.load(v, mask=kv_mask), mask=kv_mask)
            tl.store(dst + stride_kv + HALF, tl.load(v + HALF, mask=kv_mask), mask=kv_mask)

    @triton.jit
    def _find_seq(query_start_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
        """The sequence owning query tile `tile`: the last i with query_start[i] // BLOCK_Q + i <= tile."""
        lo: tl.int32 = 0
        hi: tl.int32 = num_seqs  # typed: a num_seqs of 1 arrives as a constexpr
        while lo < hi:
            mid = (lo + hi) // 2
            start = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
            if start <= tile:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _attn_tile(acc, m_i, l_i, q, kv_ptr, table_ptr, tile, kv_end, q_pos, kv_head,
                   scale_log2, block_size,
                   stride_blk, stride_kv, stride_slot, stride_head,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                   MASKED: tl.constexpr, IEEE: tl.constexpr):
        """One KV tile [tile*BLOCK_N, +BLOCK_N) of the online softmax. q: [M, D]; acc: [M, D] fp32."""
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)                                   # [N] key positions
        d = tl.arange(0, HEAD_DIM_PAD)
        n_ok = n < kv_end
        block = tl.load(table_ptr + n // block_size, mask=n_ok, other=0).to(tl.int64)
        base = block * stride_blk + (n % block_size) * stride_slot + kv_head * stride_head  # [N]
        kv_mask = n_ok[:, None] & (d[None, :] < HEAD_DIM)                           # [N, D]
        k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)   # [N, D]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2                                                           # [M, N], log2 units
        if MASKED:
            s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv_ptr + stride_kv + base[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return acc, m_new, l_i

    # Triton compiles a variant per value class of each int argument (== 1, divisible by 16, other):
    # the batch size and the block-table width change every step, and a new variant met while serving
    # costs a compile (about a second) inside one step. They are not specialized; the rest are fixed
    # per model.
    @triton.jit(do_not_specialize=["num_seqs", "seq_base", "tile_base", "stride_table"])
    def _attn_kernel(q_ptr, kv_ptr, out_ptr, table_ptr, seq_lens_ptr, query_start_ptr,
                     part_acc_ptr, part_ml_ptr,
                     scale_log2, num_seqs, seq_base, tile_base, block_size, num_heads,
                     stride_qt, stride_qh, stride_ot, stride_oh,
                     stride_blk, stride_kv, stride_slot, stride_head, stride_table,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                     NUM_SPLITS: tl.constexpr, IS_DECODE: tl.constexpr, IEEE: tl.constexpr):
        pid = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        if IS_DECODE:  # one query token per sequence, at row `seq`: no query_start loads in the latency chain
            seq = pid
            q_tile = 0
            q_start = seq
            query_len = 1
        else:  # sequences [seq_base, seq_base + num_seqs); their query tiles from tile_base on
            tile = pid + tile_base
            local = _find_seq(query_start_ptr + seq_base, tile, num_seqs, BLOCK_Q)
            q_tile = tile - (tl.load(query_start_ptr + seq_base + local) // BLOCK_Q + local)
            seq = seq_base + local
            q_start = tl.load(query_start_ptr + seq)
            query_len = tl.load(query_start_ptr + seq + 1) - q_start
            if q_tile * BLOCK_Q >= query_len:  # this sequence has fewer tiles than its reserved range
                return
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - query_len  # tokens cached before this step

        M: tl.constexpr = BLOCK_Q * GROUP_PAD
        rows = tl.arange(0, M)
        q_local = q_tile * BLOCK_Q + rows // GROUP_PAD         # [M] query index inside the sequence
        head_in_group = rows % GROUP_PAD
        head = kv_head * GROUP + head_in_group                  # [M] query head
        row_ok = (q_local < query_len) & (head_in_group < GROUP)
        d = tl.arange(0, HEAD_DIM_PAD)
        token = (q_start + q_local).to(tl.int64)                # [M] row of q / out
        io_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=io_mask, other=0.0)                    # [M, D]
        q_pos = context_len + q_local                           # [M] absolute position of the query

        # Keys this tile needs: [0, kv_end); keys every row sees: [0, kv_full).
        kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
        kv_full = context_len + q_tile * BLOCK_Q + 1
        num_tiles = tl.cdiv(kv_end, BLOCK_N)
        num_full = kv_full // BLOCK_N
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        t_lo = split * tiles_per_split
        t_hi = tl.minimum(t_lo + tiles_per_split, num_tiles)
        t_mid = tl.maximum(tl.minimum(num_full, t_hi), t_lo)

        table = table_ptr + seq.to(tl.int64) * stride_table
        acc = tl.zeros([M, HEAD_DIM_PAD], dtype=tl.float32)
        m_i = tl.full([M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([M], dtype=tl.float32)
        for tile in range(t_lo, t_mid):  # fully visible to every row: no mask
            acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, kv_ptr, table, tile, kv_end, q_pos, kv_head,
                                       scale_log2, block_size,
                                       stride_blk, stride_kv, stride_slot, stride_head,
                                       BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, False, IEEE)
        for tile in range(t_mid, t_hi):  # the diagonal: causal mask
            acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, kv_ptr, table, tile, kv_end, q_pos, kv_head,
                                       scale_log2, block_size,
                                       stride_blk, stride_kv, stride_slot, stride_head,
                                       BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, IEEE)

        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=io_mask)
        else:
            # part_acc: [T, heads, NUM_SPLITS, D] fp32; part_ml: [T, heads, NUM_SPLITS, 2] fp32
            part = (token[:, None] * num_heads + head[:, None]) * NUM_SPLITS + split   # [M, 1]
            tl.store(part_acc_ptr + part * HEAD_DIM_PAD + d[None, :], acc, mask=io_mask)
            ml = part_ml_ptr + (token * num_heads + head) * (NUM_SPLITS * 2) + split * 2
            tl.store(ml, m_i, mask=row_ok)
            tl.store(ml + 1, l_i, mask=row_ok)

    @triton.jit
    def _reduce_kernel(part_acc_ptr, part_ml_ptr, out_ptr, num_heads,
                       stride_ot, stride_oh,
                       NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        s = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, HEAD_DIM_PAD)
        row = token * num_heads + head
        m = tl.load(part_ml_ptr + row * (NUM_SPLITS * 2) + s * 2)       # [S] running max (log2 units)
        l = tl.load(part_ml_ptr + row * (NUM_SPLITS * 2) + s * 2 + 1)   # [S] running sum
        acc = tl.load(part_acc_ptr + (row * NUM_SPLITS + s[:, None]) * HEAD_DIM_PAD + d[None, :])  # [S, D]
        m_max = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))       # an empty split weighs 0
        total = tl.sum(w * l, 0)
        out = tl.sum(w[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_DIM)


def write_kv_triton(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor, block_size: int) -> None:
    """kv_layer: [blocks, 2, slots, kv_heads, dim] (strided); k, v: [T, kv_heads, dim], last dim
    contiguous; slot_mapping: [T] (a negative slot writes nothing)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    assert kv_layer.stride(-1) == 1, "KV cache: the head dim must be contiguous"
    _write_kv_kernel[(num_tokens,)](
        k, v, kv_layer, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_size, num_kv_heads, head_dim,
        BLOCK_H=_next_pow2(num_kv_heads), BLOCK_D=_next_pow2(head_dim), num_warps=1 if head_dim <= 64 else 2)


def rope_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
                         block_size: int) -> None:
    """Rotary embedding on q (in place) and k, and k, v into their cache slots, in one kernel (the
    unfused chain is ~16 elementwise kernels per layer, which dominate a small decode step).
    q: [T, heads, dim], k, v: [T, kv_heads, dim], each with a contiguous last dim (views of the fused
    qkv output are fine); cos, sin: [T, 1, dim/2] float32 (RotaryEmbedding); a negative slot writes
    nothing to the cache."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and kv_layer.stride(-1) == 1
    assert head_dim % 2 == 0 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    _rope_write_kv_kernel[(num_tokens,)](
        q, k, v, cos, sin, kv_layer, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3), block_size,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=_next_pow2(num_heads),
        KV_HEADS_PAD=_next_pow2(num_kv_heads), HALF=head_dim // 2, HALF_PAD=_next_pow2(head_dim // 2),
        ROUND=q.dtype != torch.float32, num_warps=4 if num_heads * head_dim >= 2048 else 1,
        enable_fp_fusion=False)  # a fused multiply-add would skip a rounding the reference makes


def decode_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int | None = None) -> int:
    """Split-K factor for a decode-only batch: enough (sequence, kv head, split) programs for about two
    waves over the SMs. Depends on the batch shape only (so a captured graph fits any context)."""
    num_sms = num_sms or NUM_SMS_DEFAULT
    programs = num_seqs * num_kv_heads
    splits = 1
    while splits < MAX_SPLITS and programs * splits < 2 * num_sms:
        splits *= 2
    return splits


def paged_attention_triton(q: torch.Tensor, kv_layer: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                           scale: float, max_query_len: int, num_splits: int | None = None,
                           num_decodes: int = 0) -> torch.Tensor:
    """q: [T, heads, dim]; kv_layer: [blocks, 2, slots, kv_heads, dim]; query_start_loc: [S+1];
    seq_lens: [S]; block_tables: [S, width]. max_query_len is a host int (1 = decode-only batch).
    num_decodes: how many leading sequences of a mixed batch have one query token: those get the
    decode kernel (one program per sequence and KV head) instead of the prefill tiles, whose query
    rows they would fill to 1/BLOCK_Q (compute-bound on padding). Decode programs take sequence i's query
    from row i without reading query_start_loc: decode sequences must come first, one row each.
    Returns [T, heads, dim] in q's dtype."""
    num_tokens = q.shape[0]
    num_seqs = seq_lens.shape[0]
    q = _last_dim_contiguous(q)
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    assert kv_layer.stride(-1) == 1 and block_tables.stride(-1) == 1
    args = (q, kv_layer, out, query_start_loc, seq_lens, block_tables, block_size, scale)
    if max_query_len == 1:
        assert num_tokens == num_seqs
        _launch_decode(*args, num_seqs, num_splits)
    elif 0 < num_decodes < num_seqs:
        _launch_decode(*args, num_decodes, None)
        _launch_prefill(*args, num_decodes, max_query_len)
    else:
        _launch_prefill(*args, 0, max_query_len)
    return out


def decode_launch_config(num_splits: int, ieee: bool) -> dict:
    """Tiles of a decode launch. DECODE_SPLIT_CONFIG from SPLIT_CONFIG_MIN_SPLITS splits on (batch <= 4 on
    the 8B shape), where a split of a 2,048-token context is one to two tiles (batch 1 to 4) and light
    programs won in the sweep (batches 1 and 4 measured, 2 between them); with fewer splits each program
    walks many tiles, and DECODE_CONFIG's pipeline pays. fp32 (ieee, the tests) keeps the tiles small
    enough for registers and shared memory."""
    cfg = dict(DECODE_SPLIT_CONFIG if num_splits >= SPLIT_CONFIG_MIN_SPLITS else DECODE_CONFIG)
    if ieee:
        cfg.update(BLOCK_N=min(cfg["BLOCK_N"], 32), num_stages=max(1, min(cfg["num_stages"], 2)),
                   num_warps=max(cfg["num_warps"], 4))
    return cfg


def _launch_decode(q, kv_layer, out, query_start_loc, seq_lens, block_tables, block_size, scale,
                   num_decodes: int, num_splits: int | None) -> None:
    """Sequences [0, num_decodes), one query token each (at rows 0 .. num_decodes - 1)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, _next_pow2(head_dim))
    ieee = q.dtype == torch.float32
    if num_splits is None:
        num_splits = decode_num_splits(num_decodes, num_kv_heads, num_sms(q.device))
    cfg = decode_launch_config(num_splits, ieee)
    block_n, num_stages, num_warps = cfg["BLOCK_N"], cfg["num_stages"], cfg["num_warps"]
    if num_splits > 1:
        part_acc = torch.empty(num_decodes, num_heads, num_splits, head_dim_pad, dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty(num_decodes, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _attn_kernel[(num_decodes, num_kv_heads, num_splits)](
        q, kv_layer, out, block_tables, seq_lens, query_start_loc, part_acc, part_ml,
        scale * 1.4426950408889634, num_decodes, 0, 0, block_size, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, _next_pow2(group)),  # tl.dot needs 16 rows: pad the group
        BLOCK_Q=1, BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits,
        IS_DECODE=True, IEEE=ieee, num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _reduce_kernel[(num_decodes, num_heads)](
            part_acc, part_ml, out, num_heads, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, num_warps=4)


def prefill_config(device: torch.device) -> dict:
    """PREFILL_CONFIG where the GPU's shared memory holds its tiles, else PREFILL_CONFIG_SMALL_SMEM."""
    return PREFILL_CONFIG if max_shared_memory(device) >= PREFILL_SHARED_BYTES else PREFILL_CONFIG_SMALL_SMEM


def _launch_prefill(q, kv_layer, out, query_start_loc, seq_lens, block_tables, block_size, scale,
                    seq_base: int, max_query_len: int) -> None:
    """Sequences [seq_base, S) of any query length; the ones before seq_base are decodes whose one
    token each fills rows [0, seq_base)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    num_seqs = seq_lens.shape[0] - seq_base
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    head_dim_pad = max(16, _next_pow2(head_dim))
    ieee = q.dtype == torch.float32
    cfg = prefill_config(q.device)
    block_q = max(1, min(cfg["BLOCK_M"] // group_pad, _next_pow2(max_query_len)))
    if block_q * group_pad < 16:
        block_q = 16 // group_pad
    block_n, num_stages = cfg["BLOCK_N"], cfg["num_stages"]
    if ieee:
        block_n, num_stages = min(block_n, 32), min(num_stages, 2)
        while block_q * group_pad > 64:
            block_q //= 2
    # Sequence i's tiles start at query_start_loc[i] // block_q + i (i counted from seq_base), and the
    # first of them at tile_base: query_start_loc[seq_base] = seq_base, one token per decode before it.
    tile_base = seq_base // block_q
    grid0 = num_tokens // block_q + num_seqs - tile_base
    _attn_kernel[(grid0, num_kv_heads, 1)](
        q, kv_layer, out, block_tables, seq_lens, query_start_loc, out, out,
        scale * 1.4426950408889634, num_seqs, seq_base, tile_base, block_size, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=1, IS_DECODE=False, IEEE=ieee,
        num_warps=cfg["num_warps"], num_stages=num_stages)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


_SM_COUNTS: dict[int, int] = {}
_SHARED_MEMORY: dict[int, int] = {}


def max_shared_memory(device: torch.device) -> int:
    """Shared memory a program may use on this GPU (the opt-in maximum Triton checks launches against)."""
    if device.type != "cuda":  # the interpreter: no limit to respect
        return 1 << 30
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SHARED_MEMORY:
        _SHARED_MEMORY[index] = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return _SHARED_MEMORY[index]


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return NUM_SMS_DEFAULT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
