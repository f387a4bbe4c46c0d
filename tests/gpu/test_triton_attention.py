"""The Triton paged-attention kernels against the torch reference path, on random data: mixed
batches, cached prefixes, block boundaries, odd lengths, GQA groups, split-K decode, fp32 and bf16,
and the CUDA-graph padding convention (a negative slot writes nothing)."""
from __future__ import annotations

import random

import pytest
import torch

from pdserve.model import triton_attention
from pdserve.model.attention import paged_attention_reference, write_kv
from tests.helpers_models import make_attn_metadata

pytestmark = [pytest.mark.gpu, pytest.mark.interpret_ok]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only under TRITON_INTERPRET=1
# Triton's CPU interpreter gets bf16 tl.dot wrong (3.6): there, bf16 is checked on the GPU only.
DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]


def make_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0,
               num_layers=2, layer=1):
    """A scattered, non-monotonic block assignment; never-written cache memory is NaN."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    block_ids = list(range(1, num_blocks))
    rng.shuffle(block_ids)
    tables = [[block_ids.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    kv_cache = torch.full((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), float("nan"),
                          dtype=dtype, device=DEVICE)
    kv_layer = kv_cache[:, layer]
    total = sum(seq_lens)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    full = make_attn_metadata(seq_lens, seq_lens, tables, block_size, DEVICE)
    write_kv_reference(kv_layer, k, v, full.slot_mapping, block_size)
    md = make_attn_metadata(query_lens, seq_lens, tables, block_size, DEVICE)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return q, kv_cache, kv_layer, md


def write_kv_reference(kv_layer, k, v, slot_mapping, block_size):
    block_ids, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_layer[block_ids, 0, offsets] = k
    kv_layer[block_ids, 1, offsets] = v


def run_both(query_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
             dtype=torch.float32, seed=0, num_splits=None):
    q, _, kv_layer, md = make_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                                    dtype, seed)
    scale = head_dim ** -0.5
    ref = paged_attention_reference(q.float(), kv_layer.float(), md, scale)
    out = triton_attention.paged_attention_triton(q, kv_layer, md.query_start_loc, md.seq_lens,
                                                  md.block_tables, block_size, scale, max(query_lens),
                                                  num_splits=num_splits, num_decodes=md.num_decodes)
    return out, ref


def assert_close(out, ref, dtype):
    assert not out.isnan().any()
    err = (out.float() - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), float(err)


MIXED = [
    # prefill over a cached prefix crossing blocks, decodes at and past block boundaries, short chunk
    ([7, 5, 1, 1, 1, 3, 4], [7, 13, 9, 1, 16, 4, 12]),
    ([1, 6, 1], [17, 6, 5]),
    ([1] * 6, [1, 4, 5, 8, 13, 30]),                  # decode only
    ([9, 4, 2], [9, 4, 2]),                           # prefill only
    ([130, 1, 77], [300, 64, 77]),                    # long chunk over a long prefix, several q tiles
    ([33, 1, 1, 17], [33, 129, 257, 50]),
    # decodes first, as the runner orders a batch: their own launch, the prefill tiles start after them
    ([1, 1, 1, 5, 17, 1], [40, 3, 100, 20, 17, 9]),
    ([1] * 5 + [130, 2], [16, 17, 1, 64, 300, 130, 40]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_lens, seq_lens", MIXED)
def test_mixed_batch_matches_reference(query_lens, seq_lens, dtype):
    out, ref = run_both(query_lens, seq_lens, dtype=dtype)
    assert out.shape == (sum(query_lens), 8, 64)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_on_a_gpu_with_99_kib_of_shared_memory(monkeypatch, dtype):
    """An L4 / A10G-class GPU cannot hold the default prefill tiles: the smaller ones run, correctly."""
    monkeypatch.setattr(triton_attention, "max_shared_memory", lambda device: 101_376)
    assert triton_attention.prefill_config(torch.device(DEVICE)) is triton_attention.PREFILL_CONFIG_SMALL_SMEM
    out, ref = run_both([130, 1, 77, 9], [300, 64, 77, 9], 32, 8, 128, 16, dtype, seed=5)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [
    (32, 8, 128, 16),   # Llama-3-8B
    (4, 4, 32, 8),      # MHA, small blocks
    (12, 4, 16, 4),     # group of 3 (padded to 4), head_dim 16
    (6, 2, 80, 16),     # head_dim not a power of two
])
def test_shapes_match_reference(num_heads, num_kv_heads, head_dim, block_size):
    for dtype in DTYPES:
        out, ref = run_both([5, 1, 19, 1], [40, 33, 19, 2], num_heads, num_kv_heads, head_dim,
                            block_size, dtype, seed=3)
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 4, 16, 64])
def test_split_k_decode_matches_reference(num_splits):
    seq_lens = [1, 15, 16, 17, 100, 1000, 2049]
    for dtype in DTYPES:
        out, ref = run_both([1] * len(seq_lens), seq_lens, 32, 8, 128, 16, dtype, seed=4,
                            num_splits=num_splits)
        assert_close(out, ref, dtype)


def test_write_kv_skips_negative_slots_and_matches_reference():
    num_blocks, block_size, heads, dim = 6, 4, 2, 32
    cache = torch.randn(num_blocks, 3, 2, block_size, heads, dim, device=DEVICE)
    expected = cache.clone()
    qkv = torch.randn(5, (4 + 2 * heads) * dim, device=DEVICE)  # k, v as strided views, like the model
    k = qkv[:, 4 * dim:(4 + heads) * dim].view(5, heads, dim)
    v = qkv[:, (4 + heads) * dim:].view(5, heads, dim)
    slots = torch.tensor([7, -1, 0, 23, -1], device=DEVICE)
    write_kv(cache[:, 2], k, v, slots, block_size)
    real = slots >= 0
    write_kv_reference(expected[:, 2], k[real], v[real], slots[real], block_size)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 2, 64), (6, 3, 80), (32, 8, 128)])
def test_fused_rope_write_kv_matches_rotary_then_write_kv(num_heads, num_kv_heads, head_dim, dtype):
    from pdserve.model.layers import RotaryEmbedding, apply_rotary
    num_tokens, num_blocks, block_size = 7, 5, 4
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)  # views of the fused output, as in the model
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    rotary = RotaryEmbedding(head_dim, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                             torch.device(DEVICE))
    cos, sin = rotary(torch.tensor([0, 1, 2, 17, 300, 4095, 9], device=DEVICE))
    slots = torch.tensor([3, -1, 0, 19, 8, -1, 12], device=DEVICE)  # -1: a padded graph row
    cache = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    expected = cache.clone()

    q_ref, k_ref = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    real = slots >= 0
    write_kv_reference(expected[:, 1], k_ref[real], v[real], slots[real], block_size)
    triton_attention.rope_write_kv_triton(q, k, v, cos, sin, cache[:, 1], slots, block_size)

    # every product and sum rounded as the reference rounds them (no fused multiply-add): the same bits
    assert torch.equal(q, q_ref)
    assert torch.equal(cache, expected)
