"""The CPU decode attention kernel (model/csrc/cpu_decode_attention.c) against plain torch, and its ways
out: inputs it refuses, and no compiler at all."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.model import cpu_kernels
from pdserve.model.attention import _prefill_attention

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler here")


def paged_case(seq_lens, num_heads, num_kv_heads, head_dim=64, block_size=16, num_layers=2, seed=0):
    """A layer view of a cache with scattered blocks, queries, block tables and lengths."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + 3
    kv = torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(seq_lens), max(per_seq) + 2, dtype=torch.int32)   # padded with 0, as the runner does
    for i, n in enumerate(per_seq):
        table[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    return q, kv[:, num_layers - 1], table, torch.tensor(seq_lens, dtype=torch.int32)


def torch_decode(q, kv_layer, table, seq_lens, scale):
    block_size = kv_layer.shape[2]
    return torch.cat([_prefill_attention(q[i:i + 1], kv_layer, table[i], int(seq_lens[i]), block_size, scale)
                      for i in range(q.shape[0])])


@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 4), (32, 8), (8, 1)])
def test_the_kernel_matches_torch(num_heads, num_kv_heads):
    # lengths: one token, a block boundary either side, and a long one
    seq_lens = [1, 15, 16, 17, 300, 2500]
    q, kv_layer, table, lens = paged_case(seq_lens, num_heads, num_kv_heads)
    out = torch.full_like(q, float("nan"))
    assert cpu_kernels.decode_attention(q, kv_layer, table, lens, 0.125, out)
    torch.testing.assert_close(out, torch_decode(q, kv_layer, table, lens, 0.125), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("block_size, head_dim", [(1, 64), (5, 16), (8, 32), (12, 128), (32, 64)])
def test_eight_keys_at_a_time_cross_blocks_of_any_size(block_size, head_dim):
    """The kernel scores keys eight at a time, and eight keys may straddle blocks of any size."""
    q, kv_layer, table, lens = paged_case([1, 7, 8, 9, 23, 64, 101], 8, 2, head_dim=head_dim,
                                          block_size=block_size)
    out = torch.full_like(q, float("nan"))
    assert cpu_kernels.decode_attention(q, kv_layer, table, lens, 0.125, out)
    torch.testing.assert_close(out, torch_decode(q, kv_layer, table, lens, 0.125), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (32, 8)])
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(num_heads, num_kv_heads):
    """A batch runs a task per sequence, a lone sequence a task per KV head (to keep every thread busy):
    each query head's sums run in the same order either way, so a stream's answer cannot depend on the
    others in its step."""
    seq_lens = [300, 1, 17, 64] * 32   # 128 sequences: a task each on up to 32 threads
    q, kv_layer, table, lens = paged_case(seq_lens, num_heads, num_kv_heads)
    batched = torch.empty_like(q)
    assert cpu_kernels.decode_attention(q, kv_layer, table, lens, 0.125, batched)
    for i in range(4):
        alone = torch.empty_like(q[i:i + 1])
        assert cpu_kernels.decode_attention(q[i:i + 1], kv_layer, table[i:i + 1], lens[i:i + 1], 0.125, alone)
        assert torch.equal(alone, batched[i:i + 1])


def test_the_largest_score_anywhere_in_the_row():
    """The softmax's maximum, taken eight lanes at a time: the largest score in each lane and in the tail
    past the last eight."""
    for position in (0, 5, 8, 15, 16, 19):
        q, kv_layer, table, lens = paged_case([20], 1, 1, head_dim=16, block_size=4)
        kv_layer[table[0, position // 4], 0, position % 4, 0] = q[0, 0] * 3   # this key's score stands out
        out = torch.empty_like(q)
        assert cpu_kernels.decode_attention(q, kv_layer, table, lens, 0.125, out)
        torch.testing.assert_close(out, torch_decode(q, kv_layer, table, lens, 0.125), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("scale", [4.0, 12.0])
def test_softmax_over_a_wide_range_of_scores(scale):
    """The kernel's own vector exp: scores spanning hundreds (most weights underflow past e^-87, a few
    dominate) and lengths not a multiple of its 8 lanes, against torch's softmax."""
    q, kv_layer, table, lens = paged_case([1, 7, 9, 23, 300], 9, 3)
    out = torch.empty_like(q)
    assert cpu_kernels.decode_attention(q, kv_layer, table, lens, scale, out)
    # Scores of hundreds make float32 itself inexact here: on an AVX-512 Xeon (2026-12-04) torch was 4.4e-5
    # and the kernel 4.8e-5 from the float64 answer, 9e-5 from each other. So both are held to float64.
    exact = torch_decode(q.double(), kv_layer.double(), table, lens, scale)
    torch_error = (torch_decode(q, kv_layer, table, lens, scale).double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= max(2e-5, 2 * torch_error)


def test_a_non_contiguous_query_is_read_right():
    q, kv_layer, table, lens = paged_case([40, 7], 6, 2, head_dim=32)
    wide = torch.randn(2, 6, 96)
    wide[:, :, 16:48] = q   # q as a strided view, like the slice of a fused projection
    out = torch.empty_like(q)
    assert cpu_kernels.decode_attention(wide[:, :, 16:48], kv_layer, table, lens, 0.2, out)
    torch.testing.assert_close(out, torch_decode(q, kv_layer, table, lens, 0.2), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("spoil", ["block id past the cache", "negative block id", "zero length",
                                   "length past the table", "heads not a multiple", "head_dim 48",
                                   "17 query heads per KV head"])
def test_inputs_it_cannot_serve_are_refused_not_read(spoil):
    q, kv_layer, table, lens = paged_case([20, 33], 6, 2)
    if spoil == "block id past the cache":
        table[1, 2] = kv_layer.shape[0]
    elif spoil == "negative block id":
        table[0, 0] = -1
    elif spoil == "zero length":
        lens[0] = 0
    elif spoil == "length past the table":
        lens[1] = table.shape[1] * kv_layer.shape[2] + 1
    elif spoil == "heads not a multiple":
        q = torch.randn(2, 5, 64)
    elif spoil == "head_dim 48":
        q, kv_layer, table, lens = paged_case([20, 33], 6, 2, head_dim=48)
    else:
        q, kv_layer, table, lens = paged_case([20, 33], 17, 1)
    out = torch.zeros_like(q)
    assert not cpu_kernels.decode_attention(q, kv_layer, table, lens, 0.125, out)


def test_other_dtypes_go_to_torch():
    q, kv_layer, table, lens = paged_case([5], 4, 2)
    out = torch.empty_like(q, dtype=torch.bfloat16)
    assert not cpu_kernels.decode_attention(q.bfloat16(), kv_layer.bfloat16(), table, lens, 0.125, out)


def test_no_compiler_means_plain_torch_and_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="pdserve.model.cpu_kernels"):
        assert not cpu_kernels.available()
        q, kv_layer, table, lens = paged_case([5], 4, 2)
        assert not cpu_kernels.decode_attention(q, kv_layer, table, lens, 0.125, torch.empty_like(q))
    assert len(caplog.records) == 1 and "plain torch" in caplog.records[0].getMessage()
    assert list(tmp_path.iterdir()) == []   # no half-built library left behind


def test_the_library_is_built_once_and_reused(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    assert cpu_kernels.available()
    built = sorted(tmp_path.iterdir())
    assert [path.name.split(".", 1)[1] for path in built] == ["so", "so.sha256"]
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    assert cpu_kernels.available()
    assert sorted(tmp_path.iterdir()) == built and built[0].stat().st_mtime_ns == stamp


def test_a_cached_library_cut_short_is_rebuilt_not_loaded(monkeypatch, tmp_path):
    """A library truncated in the cache (a crash before its pages reached the disk) used to load and then
    kill the process with SIGBUS at its first call, on every restart. Run in a child: that is the crash."""
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    assert cpu_kernels.available()
    library = next(tmp_path.glob("*.so"))
    library.write_bytes(library.read_bytes()[:4096])
    script = ("import torch; from pdserve.model import cpu_kernels as ck; from tests.model.test_cpu_kernels import "
              "paged_case; q, kv, t, n = paged_case([20, 3], 4, 2); out = torch.empty_like(q); "
              "print(ck.decode_attention(q, kv, t, n, 0.125, out))")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PDSERVE_KERNEL_CACHE": str(tmp_path)}, cwd=ROOT)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == "True" and "rebuilding it" in child.stderr
    assert len(library.read_bytes()) > 4096


@pytest.mark.parametrize("case", ["head_dim", "out_rows", "out_dtype", "few_lengths", "few_tables"])
def test_inputs_that_do_not_belong_together_are_refused(case):
    """The C side sees raw pointers: a q whose head size is not the cache's, an out too small or of another
    dtype, fewer lengths or table rows than sequences would be read or written past (a segfault)."""
    q, kv_layer, table, lens = paged_case([20, 3, 40], 4, 2)
    out = torch.empty_like(q)
    if case == "head_dim":
        q = q[:, :, :32].contiguous()
        out = torch.empty_like(q)
    elif case == "out_rows":
        out = torch.empty(1, 4, 64)
    elif case == "out_dtype":
        out = torch.empty(q.shape, dtype=torch.float64)
    elif case == "few_lengths":
        lens = lens[:1]
    else:
        table = table[:1]
    assert not cpu_kernels.decode_attention(q, kv_layer, table, lens, 0.125, out)


@pytest.mark.parametrize("rows, heads, kv_heads, head_dim, block_size", [(1, 9, 3, 64, 16), (37, 9, 3, 64, 16),
                                                                          (70, 8, 2, 128, 5), (3, 4, 4, 16, 1)])
def test_rope_and_kv_write_equal_torch_bit_for_bit(rows, heads, kv_heads, head_dim, block_size):
    """The fused rotary + cache write (cpu_rope.c) against apply_rotary and write_kv: the same numbers to
    the bit, q rotated in place in its strided view of the fused qkv rows, nothing else in the cache
    touched. Above 32 rows it runs on the OpenMP threads."""
    from pdserve.model.attention import write_kv
    from pdserve.model.layers import apply_rotary

    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(rows, -1, head_dim) for t in (q, k, v))
    num_blocks = -(-rows // block_size) + 4
    kv = torch.randn(num_blocks, 3, 2, block_size, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    freqs = torch.rand(rows, head_dim // 2, generator=gen) * 100
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    want_q, want_kv = apply_rotary(q, cos, sin), kv.clone()
    write_kv(want_kv[:, 1], apply_rotary(k, cos, sin), v, slots, block_size)
    assert cpu_kernels.rope_write_kv(q, k, v, cos, sin, kv[:, 1], slots)
    assert torch.equal(q, want_q) and torch.equal(kv, want_kv)


def test_rope_and_kv_write_refuse_a_slot_outside_the_cache():
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    kv = torch.zeros(3, 2, 2, 4, 2, 16)
    cos = sin = torch.ones(2, 1, 8)
    before = q.clone()
    for bad in (12, -1):
        assert not cpu_kernels.rope_write_kv(q, k, v, cos, sin, kv[:, 0], torch.tensor([0, bad]))
        assert torch.equal(q, before) and not kv.any()


def test_rope_and_kv_write_refuse_layouts_they_would_write_outside():
    """A cache view without both K and V halves (the V write would land past its end), a broadcast q (rows
    rotated in place, several times, in parallel), float slots, or cos of the wrong size: refused, nothing
    written, the caller runs torch."""
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    kv = torch.zeros(3, 2, 2, 4, 2, 16)
    cos = sin = torch.ones(2, 1, 8)
    slots = torch.tensor([0, 5])
    assert not cpu_kernels.rope_write_kv(q, k, v, cos, sin, kv[:, 0, 1:], slots)           # V half missing
    assert not cpu_kernels.rope_write_kv(q[:1].expand(2, 4, 16), k, v, cos, sin, kv[:, 0], slots)
    assert not cpu_kernels.rope_write_kv(q, k, v, cos, sin, kv[:, 0], slots.float())
    assert not cpu_kernels.rope_write_kv(q, k, v, torch.ones(3, 1, 8), sin, kv[:, 0], slots)
    assert not kv.any()
    assert cpu_kernels.rope_write_kv(q, k, v, cos, sin, kv[:, 0], slots)   # the same, well formed
