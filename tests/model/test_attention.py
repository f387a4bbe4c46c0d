"""paged_attention against a dense causal reference on random data."""
import random

import pytest
import torch

from pdserve.model import attention, cpu_kernels
from pdserve.model.attention import paged_attention, write_kv
from tests.helpers_models import make_attn_metadata

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 40, 2, 4, 6, 2, 16
SCALE = HEAD_DIM ** -0.5


def dense_attention(q, k, v, query_len, seq_len):
    """q: [query_len, heads, dim]; k, v: [seq_len, kv_heads, dim] (every position); plain softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [seq_len, heads, dim]
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE  # [heads, query_len, seq_len]
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_batch(query_lens, seq_lens, seed=0):
    """Random K/V for every position of every sequence; the cached prefix written beforehand, this
    step's K/V written by write_kv as the model does; returns (paged output, dense output)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    block_ids = list(range(1, NUM_BLOCKS))
    rng.shuffle(block_ids)  # scattered, non-monotonic blocks
    block_tables = []
    for seq_len in seq_lens:
        num_blocks = -(-seq_len // BLOCK_SIZE)
        block_tables.append([block_ids.pop() for _ in range(num_blocks)])
    # Never-written memory may hold NaN: the padded decode gather must not let it through.
    kv_cache = torch.full((NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    kv_layer = kv_cache[:, 1]  # a non-contiguous layer view, as the model uses
    ks = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=gen) for s in seq_lens]
    qs = [torch.randn(q, NUM_HEADS, HEAD_DIM, generator=gen) for q in query_lens]
    prefix = make_attn_metadata([s - q for q, s in zip(query_lens, seq_lens)],
                                [s - q for q, s in zip(query_lens, seq_lens)], block_tables, BLOCK_SIZE)
    write_kv(kv_layer, torch.cat([k[: s - q] for k, q, s in zip(ks, query_lens, seq_lens)]),
             torch.cat([v[: s - q] for v, q, s in zip(vs, query_lens, seq_lens)]), prefix.slot_mapping, BLOCK_SIZE)
    md = make_attn_metadata(query_lens, seq_lens, block_tables, BLOCK_SIZE)
    write_kv(kv_layer, torch.cat([k[s - q:] for k, q, s in zip(ks, query_lens, seq_lens)]),
             torch.cat([v[s - q:] for v, q, s in zip(vs, query_lens, seq_lens)]), md.slot_mapping, BLOCK_SIZE)
    out = paged_attention(torch.cat(qs), kv_layer, md, SCALE)
    expected = torch.cat([dense_attention(q, k, v, len(q), s) for q, k, v, s in zip(qs, ks, vs, seq_lens)])
    return out, expected


@pytest.fixture(params=["auto", "reference"])
def backend(request, monkeypatch):
    """Each test once with the CPU decode kernel (auto) and once in plain torch; counts the kernel's runs."""
    monkeypatch.setattr(attention, "BACKEND", request.param)
    runs = []
    real = cpu_kernels.decode_attention

    def counted(*args):
        done = real(*args)
        runs.append(done)
        return done
    monkeypatch.setattr(cpu_kernels, "decode_attention", counted)
    return request.param, runs


def expect_kernel(backend, num_decodes_first):
    """In auto mode the leading decodes went through the kernel (when it builds here), else never."""
    name, runs = backend
    if name == "reference" or not num_decodes_first:
        assert runs == []
    elif cpu_kernels.available():
        assert runs == [True]


def test_write_kv_lands_in_the_right_block_and_slot():
    kv_cache = torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k, v = torch.randn(3, NUM_KV_HEADS, HEAD_DIM), torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.tensor([7 * BLOCK_SIZE + 3, 2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 1])
    write_kv(kv_cache[:, 1], k, v, slots, BLOCK_SIZE)
    assert torch.equal(kv_cache[7, 1, 0, 3], k[0]) and torch.equal(kv_cache[2, 1, 1, 0], v[1])
    assert torch.equal(kv_cache[2, 1, 0, 1], k[2])
    assert kv_cache[:, 0].abs().sum() == 0  # the other layer untouched


@pytest.mark.parametrize("query_lens, seq_lens", [
    # full prefill, prefill chunk over a cached prefix crossing blocks, decodes (first token, at and
    # past a block boundary), a short chunk, a chunk ending exactly on a block boundary
    ([7, 5, 1, 1, 1, 3, 4], [7, 13, 9, 1, 16, 4, 12]),
    ([1, 6, 1], [17, 6, 5]),  # decodes around a prefill
])
def test_mixed_batch_matches_dense(query_lens, seq_lens, backend):
    out, expected = run_batch(query_lens, seq_lens)
    assert out.shape == (sum(query_lens), NUM_HEADS, HEAD_DIM)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    expect_kernel(backend, query_lens[0] == 1)


def test_decodes_first_then_prefill_chunks_match_dense(backend):
    """The runner's order: the kernel takes the leading decodes, plain torch the chunks after them."""
    query_lens, seq_lens = [1, 1, 1, 6, 3], [17, 1, 33, 6, 9]
    out, expected = run_batch(query_lens, seq_lens, seed=3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    expect_kernel(backend, 3)


def test_pure_decode_batch_matches_dense(backend):
    out, expected = run_batch([1] * 6, [1, 4, 5, 8, 13, 30], seed=1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    expect_kernel(backend, 6)


def test_pure_prefill_batch_matches_dense(backend):
    out, expected = run_batch([9, 4, 2], [9, 4, 2], seed=2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    expect_kernel(backend, 0)
