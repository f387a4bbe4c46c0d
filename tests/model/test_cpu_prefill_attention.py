"""The CPU prefill attention kernel (model/csrc/cpu_prefill_attention.c): against plain torch, the same
bits however the prompt is chunked or batched, and the inputs it refuses."""
import itertools

import pytest
import torch

from pdserve.model import attention, cpu_kernels
from pdserve.model.attention import AttentionMetadata, paged_attention, paged_attention_reference

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler here")


def make_cache(seq_lens, num_kv_heads, head_dim, block_size, seed=0, fill=None):
    """A layer view of a cache with scattered blocks (slots past each sequence filled with `fill`, when
    given) and a block table padded with 0, as the runner pads it."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + 3
    kv = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(seq_lens), max(per_seq) + 2, dtype=torch.int32)
    for i, n in enumerate(per_seq):
        table[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
        if fill is not None and seq_lens[i] % block_size:
            kv[table[i, n - 1], :, :, seq_lens[i] % block_size:] = fill
    return kv[:, 1], table


def metadata(query_lens, seq_lens, table, block_size, decodes=None):
    starts = [0, *itertools.accumulate(query_lens)]
    return AttentionMetadata(torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                             table, torch.zeros(starts[-1], dtype=torch.long), list(query_lens), list(seq_lens),
                             block_size, decodes=decodes)


def fused_queries(tokens, num_heads, head_dim, num_kv_heads, seed=1):
    """q as the model passes it: a view of the fused qkv output, rows wider than the heads."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    return qkv[:, :num_heads * head_dim].view(tokens, num_heads, head_dim)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [
    (9, 3, 64, 16),      # the default model
    (32, 8, 128, 16),    # the 8B shapes
    (4, 4, 32, 5),       # no GQA, blocks that split the key tiles
    (32, 2, 16, 1),      # a group of 16, one slot per block
    (8, 1, 64, 48),
])
def test_the_kernel_matches_torch(num_heads, num_kv_heads, head_dim, block_size):
    # two decodes first (the runner's order), then whole prompts and chunks over a cached prefix,
    # lengths either side of the key tiles (32) and the task's positions (96 rows)
    query_lens = [1, 1, 1, 31, 33, 100, 7, 300]
    seq_lens = [20, 70, 1, 31, 80, 100, 207, 300]
    kv_layer, table = make_cache(seq_lens, num_kv_heads, head_dim, block_size)
    q = fused_queries(sum(query_lens), num_heads, head_dim, num_kv_heads)
    md = metadata(query_lens, seq_lens, table, block_size)
    out = paged_attention(q, kv_layer, md, head_dim ** -0.5)
    torch.testing.assert_close(out, paged_attention_reference(q, kv_layer, md, head_dim ** -0.5),
                               rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (32, 2, 16), (8, 1, 128), (4, 4, 32)])
def test_every_count_of_row_vectors_a_task_can_have(num_heads, num_kv_heads, head_dim):
    """A task holds its rows in vectors of 8 or 16 lanes, in micro-tiles of up to three: chunks of 1 to 40
    tokens give every count from one partly filled vector to a task's full six (twelve with AVX2) and every
    remainder, each against torch, each over keys that do not fill the last tile."""
    block_size = 16
    query_lens = list(range(1, 41))
    seq_lens = [q + 37 for q in query_lens]
    kv_layer, table = make_cache(seq_lens, num_kv_heads, head_dim, block_size, fill=float("nan"))
    q = fused_queries(sum(query_lens), num_heads, head_dim, num_kv_heads)
    md = metadata(query_lens, seq_lens, table, block_size)
    out = paged_attention(q, kv_layer, md, head_dim ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, paged_attention_reference(q, kv_layer, md, head_dim ** -0.5),
                               rtol=1e-5, atol=2e-6)


def test_the_kernel_serves_the_step(monkeypatch):
    """(Else every case here compares torch with itself.)"""
    calls = []
    real = cpu_kernels.prefill_attention
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda *a: calls.append(a[4].tolist()) or real(*a))
    kv_layer, table = make_cache([9, 40], 3, 64, 16)
    md = metadata([1, 12], [9, 40], table, 16)
    q = fused_queries(13, 9, 64, 3)
    torch.testing.assert_close(paged_attention(q, kv_layer, md, 0.125),
                               paged_attention_reference(q, kv_layer, md, 0.125), rtol=1e-5, atol=2e-6)
    assert calls == [[40]]


@pytest.mark.parametrize("chunks", [[2, 98], [37, 63], [32, 32, 36], [96, 4], [2] * 5 + [90]])
def test_a_prompt_gets_the_same_bits_whole_or_in_chunks(chunks):
    """Chunked prefill (a budget, a prefix-cache hit) must not change a bit: P's prefill and a colocated
    one agree only if each row's numbers depend on its position alone. (A one-token query is a decode
    row, the decode kernel's, in any step.)"""
    length = sum(chunks)
    kv_layer, table = make_cache([length], 3, 64, 16)
    q = fused_queries(length, 9, 64, 3)
    whole = paged_attention(q, kv_layer, metadata([length], [length], table, 16), 0.125)
    done = 0
    for chunk in chunks:
        md = metadata([chunk], [done + chunk], table, 16)
        part = paged_attention(q[done:done + chunk], kv_layer, md, 0.125)
        assert torch.equal(part, whole[done:done + chunk]), (chunks, done)
        done += chunk


def test_a_sequence_gets_the_same_bits_alone_in_a_batch_and_on_any_number_of_threads():
    seq_lens = [150, 40, 9]
    kv_layer, table = make_cache(seq_lens, 3, 64, 16)
    q = fused_queries(sum(seq_lens), 9, 64, 3)
    batch = paged_attention(q, kv_layer, metadata(seq_lens, seq_lens, table, 16), 0.125)
    first = 0
    for i, n in enumerate(seq_lens):
        alone = paged_attention(q[first:first + n], kv_layer, metadata([n], [n], table[i:i + 1], 16), 0.125)
        assert torch.equal(alone, batch[first:first + n]), i
        first += n
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(paged_attention(q, kv_layer, metadata(seq_lens, seq_lens, table, 16), 0.125), batch)
    finally:
        torch.set_num_threads(threads)


def test_slots_past_the_sequence_are_never_read():
    """The last block's unwritten slots hold whatever a freed block held: NaN must not reach the output."""
    clean, table = make_cache([70], 3, 64, 16)
    dirty, _ = make_cache([70], 3, 64, 16, fill=float("nan"))
    q = fused_queries(70, 9, 64, 3)
    md = metadata([70], [70], table, 16)
    out = paged_attention(q, dirty, md, 0.125)
    assert torch.equal(out, paged_attention(q, clean, md, 0.125)) and not out.isnan().any()


def test_scores_far_apart_keep_their_weights():
    """A huge score next to small ones (the running maximum jumps tile after tile) still matches torch."""
    kv_layer, table = make_cache([200], 1, 64, 16)
    q = fused_queries(200, 4, 64, 1)
    q.mul_(20.0)
    md = metadata([200], [200], table, 16)
    torch.testing.assert_close(paged_attention(q, kv_layer, md, 0.125),
                               paged_attention_reference(q, kv_layer, md, 0.125), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spoil", ["block id past the cache", "negative block id", "prefix longer than the table",
                                   "head_dim 48"])
def test_inputs_it_cannot_serve_are_refused_not_read(spoil):
    head_dim = 48 if spoil == "head_dim 48" else 64
    kv_layer, table = make_cache([40], 3, head_dim, 16)
    q = fused_queries(8, 9, head_dim, 3)
    starts, lens = torch.tensor([0, 8], dtype=torch.int32), torch.tensor([40], dtype=torch.int32)
    if spoil == "block id past the cache":
        table[0, 1] = kv_layer.shape[0]
    elif spoil == "negative block id":
        table[0, 2] = -1
    elif spoil == "prefix longer than the table":
        lens[0] = table.shape[1] * 16 + 1
    out = torch.full_like(q.contiguous(), 7.0)
    assert not cpu_kernels.prefill_attention(q, kv_layer, table, starts, lens, 0.125, out)
    assert (out == 7.0).all()


def test_the_reference_backend_takes_torch(monkeypatch):
    monkeypatch.setattr(attention, "BACKEND", "reference")
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda *a: pytest.fail("the kernel ran"))
    kv_layer, table = make_cache([30], 3, 64, 16)
    q = fused_queries(30, 9, 64, 3)
    paged_attention(q, kv_layer, metadata([30], [30], table, 16), 0.125)


@pytest.mark.skipif("avx512f" not in cpu_kernels.cpu_flags(), reason="the AVX-512 build is made only here")
@pytest.mark.parametrize("query_lens, seq_lens", [([40, 130], [40, 200]),
                                                  (list(range(1, 34)), list(range(50, 83)))])
def test_the_avx512_build_gives_the_avx2_builds_numbers_to_the_bit(tmp_path, query_lens, seq_lens):
    """P on an AVX2 machine and D on an AVX-512 one must agree on a prompt's KV and first token (the
    second case: every count of row vectors either build's tasks can have)."""
    import ctypes
    import itertools
    import shutil
    import subprocess
    compiler = shutil.which("gcc") or shutil.which("cc")
    kv_layer, table = make_cache(seq_lens, 3, 64, 16)
    q = fused_queries(sum(query_lens), 9, 64, 3)
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    outputs = []
    for name, arch in (("avx2", ["-mavx2", "-mfma"]), ("avx512", ["-march=native"])):
        lib_path = tmp_path / f"{name}.so"
        subprocess.run([compiler, "-O3", *arch, "-fopenmp", "-std=c11", "-ffp-contract=off", "-shared", "-fPIC",
                        str(cpu_kernels.CSRC / "cpu_prefill_attention.c"), "-o", str(lib_path), "-lm"],
                       check=True, capture_output=True, timeout=120)
        fn = ctypes.CDLL(str(lib_path)).pdserve_prefill_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3 + [
            ctypes.c_int64] * 2 + [ctypes.c_int] * 4 + [ctypes.c_float]
        out = torch.empty(q.shape)
        assert fn(q.data_ptr(), q.stride(0), kv_layer.data_ptr(), table.data_ptr(), starts.data_ptr(),
                  lens.data_ptr(), out.data_ptr(), len(seq_lens), table.shape[1], kv_layer.shape[0], kv_layer.stride(0),
                  kv_layer.stride(1), 16, 9, 3, 64, 0.125) == 0
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])
    md = metadata(query_lens, seq_lens, table, 16)
    torch.testing.assert_close(outputs[1], paged_attention_reference(q, kv_layer, md, 0.125), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("spoil", ["tokens past q", "out shorter than q", "out of another dtype", "short query_start",
                                   "fewer tables than sequences", "negative first token"])
def test_offsets_outside_q_and_out_are_refused_not_followed(spoil):
    """query_start, the tables and out come to C as raw pointers: rows past q or out, or a sequence without a
    table, must be refused, not read or written (review: they were followed). Every tensor here is a view of
    a larger one, so that the kernel's reads and writes before the check stayed inside real memory."""
    kv_layer, table = make_cache([40, 30], 3, 64, 16)
    q = fused_queries(32, 9, 64, 3)[8:24]
    starts_buf = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
    starts, lens = starts_buf[:3], torch.tensor([40, 30], dtype=torch.int32)
    out_buf = torch.full((32, 9, 64), 7.0)
    out = out_buf[8:24]
    if spoil == "tokens past q":
        starts = torch.tensor([0, 8, 20], dtype=torch.int32)
    elif spoil == "out shorter than q":
        out = out_buf[8:20]
    elif spoil == "out of another dtype":
        out = torch.full((16, 9, 64), 7.0, dtype=torch.float64)
    elif spoil == "short query_start":
        starts = starts_buf[:2]
    elif spoil == "fewer tables than sequences":
        table = torch.cat([table, table])[:3][:1]
    elif spoil == "negative first token":
        starts = torch.tensor([-4, 8, 16], dtype=torch.int32)
    assert not cpu_kernels.prefill_attention(q, kv_layer, table, starts, lens, 0.125, out)
    assert (out_buf == 7.0).all() and (out == 7.0).all()


def test_shapes_the_c_side_cannot_take_are_refused_not_a_crash():
    """Called straight (as a caller other than the wrapper may): no query heads divided by zero (SIGFPE, review);
    a context near 2^31 overflows an int block count (undefined behaviour that GCC 12 happened to compile
    into a working check; the count is now 64-bit), and its bad block ids must still be refused. Run in a
    child so that a crash fails this test rather than ending the session."""
    import subprocess
    import sys
    code = r"""
import ctypes, torch
from pdserve.model import cpu_kernels
lib = cpu_kernels._load()
kv = torch.zeros(1, 2, 1 << 16, 1, 16)
q = torch.zeros(1, 1, 16)
out = torch.zeros(1, 1, 16)
starts = torch.tensor([0, 1], dtype=torch.int32)
def call(table, seq_len, num_heads):
    return lib.pdserve_prefill_attention(q.data_ptr(), 16, kv.data_ptr(), table.data_ptr(), starts.data_ptr(),
        torch.tensor([seq_len], dtype=torch.int32).data_ptr(), out.data_ptr(), 1, table.shape[1], 1, kv.stride(0),
        kv.stride(1), 1 << 16, num_heads, 1, 16, 0.25)
print(call(torch.zeros(1, 1, dtype=torch.int32), 1, 0), flush=True)
table = torch.full((1, 1 << 15), -1, dtype=torch.int32)
print(call(table, 2 ** 31 - 1, 1), flush=True)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["-1", "-1"], (result.returncode, result.stdout,
                                                                             result.stderr[-2000:])


@pytest.mark.parametrize("length", [17, 300])
def test_a_one_token_last_chunk_gets_the_bits_of_the_whole_prompt(length):
    """The last chunk of a prompt is one token whenever the budget leaves one over (a 2,049-token prompt at
    2,048, or at 2,048 minus the running decodes on a colocated instance, where P, with no decodes, takes it
    whole) and on every whole-block prefix-cache hit of a 16k + 1-token prompt. That row is the one whose
    logits give the first token, and its K and V feed every later step: P/D equals colocated, and a
    repeated prompt its first answer, only if it gets the bits it gets inside a longer chunk."""
    kv_layer, table = make_cache([length], 3, 64, 16)
    q = fused_queries(length, 9, 64, 3)
    whole = paged_attention(q, kv_layer, metadata([length], [length], table, 16), 0.125)
    # the runner says it is a prefill chunk, not a decode (decodes=0)
    last = paged_attention(q[-1:], kv_layer, metadata([1], [length], table, 16, decodes=0), 0.125)
    assert torch.equal(last, whole[-1:])
    # beside a decode, which still takes the decode kernel
    both = torch.cat([q[:1], q[-1:]])
    table2 = torch.cat([table, table])
    mixed = paged_attention(both, kv_layer, metadata([1, 1], [1, length], table2, 16, decodes=1), 0.125)
    assert torch.equal(mixed[1:], whole[-1:])


@pytest.mark.parametrize("last_chunk_is_prefill", [True, False])
def test_the_runner_sends_a_one_token_prompt_chunk_to_the_prefill_kernel(tiny_model_paths, last_chunk_is_prefill):
    """Through the model runner: a 40-token prompt as 39 + 1 tokens writes the KV the whole prompt writes,
    to the bit, in every layer (the last token's K and V past layer 0 come from its attention output), and
    beside a running decode, which the runner sorts first. Marked as a decode instead (what the runner did
    before ScheduledRequest.prefill), that token's later layers differ: the test can tell."""
    from pdserve.core.batch import ScheduledRequest, SchedulerOutput
    from pdserve.engine.llm import LLM
    from pdserve.sampling_params import SamplingParams
    llm = LLM(tiny_model_paths["llama"], dtype="float32", block_size=8, num_blocks=64)
    runner, params = llm.engine.runner, SamplingParams(temperature=0.0, max_tokens=4)
    prompt = [(7 * i) % 200 + 3 for i in range(40)]

    def run(out):
        runner.collect(runner.launch(out))

    run(SchedulerOutput([ScheduledRequest("whole", prompt, 0, list(range(5)), params, do_sample=True,
                                          prefill=True)], 40))
    run(SchedulerOutput([ScheduledRequest("other", prompt[:20], 0, [10, 11, 12], params, do_sample=True,
                                          prefill=True)], 20))
    run(SchedulerOutput([ScheduledRequest("chunked", prompt[:39], 0, list(range(5, 10)), params, do_sample=False,
                                          prefill=True)], 39))
    last = ScheduledRequest("chunked", prompt[39:], 39, list(range(5, 10)), params, do_sample=True,
                            prefill=last_chunk_is_prefill)
    decode = ScheduledRequest("other", [prompt[20]], 20, [10, 11, 12], params, do_sample=True)
    run(SchedulerOutput([last, decode], 2))
    kv = runner.kv_cache
    same = torch.equal(kv[0:5], kv[5:10])
    assert same == last_chunk_is_prefill


def test_the_softmax_exponential_is_within_an_ulp_and_exact_at_zero(tmp_path):
    """The kernel's own e^x (fused multiply-adds, no clamp above): within 1 ulp of e^x over [-87.3, 0], and
    e^0 exactly 1, which keeps a tile past a row's position from changing its numbers (a rescale by 1)."""
    import shutil
    import subprocess
    import numpy as np
    compiler = shutil.which("gcc") or shutil.which("cc")
    harness = tmp_path / "harness.c"
    harness.write_text(f'#include "{cpu_kernels.CSRC / "cpu_prefill_attention.c"}"\n' + r'''
#include <stdio.h>
int main(void) {
    float x[LANES];
    while (fread(x, sizeof(float), LANES, stdin) == LANES) {
        vv v;
        memcpy(&v, x, sizeof v);
        v = vexp_nonpositive(v);
        fwrite(&v, sizeof v, 1, stdout);
    }
    return 0;
}
''')
    binary = tmp_path / "harness"
    subprocess.run([compiler, *(f for f in cpu_kernels.FLAGS if f not in ("-shared", "-fPIC")), str(harness), "-o",
                    str(binary), "-lm"], check=True, capture_output=True, timeout=120)
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.uniform(-87.3, 0.0, 1 << 20), rng.uniform(-1.0, 0.0, 1 << 18),
                         np.array([0.0, -0.0, -87.3, -87.29, -1e-30, -0.34657359, -0.34657361])]).astype(np.float32)
    xs = np.concatenate([xs, np.zeros(-len(xs) % 16, np.float32)])
    got = np.frombuffer(subprocess.run([str(binary)], input=xs.tobytes(), capture_output=True, check=True,
                                       timeout=60).stdout, dtype=np.float32)
    exact = np.exp(xs.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - exact) / ulp) < 1.0
    assert got[xs == 0.0].tolist() == [1.0] * int(np.sum(xs == 0.0))


def test_a_sequence_near_ints_end_is_refused_not_looped_over():
    """A length near 2^31 (one huge block, every table entry valid) was taken: the tile loop's start would
    wrap past int's end after minutes of work (review). Lengths past 2^30 are refused at once."""
    import subprocess
    import sys
    script = r'''
import torch
from pdserve.model import cpu_kernels
block_size, length = 1 << 16, (1 << 31) - 1
kv = torch.zeros(1, 2, block_size, 1, 16)
table = torch.zeros(1, -(-length // block_size), dtype=torch.int32)
q = torch.zeros(1, 1, 16)
out = torch.empty(1, 1, 16)
print(cpu_kernels.prefill_attention(q, kv, table, torch.tensor([0, 1], dtype=torch.int32),
                                    torch.tensor([length], dtype=torch.int32), 0.25, out))
'''
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert result.stdout.strip() == "False", result.stderr[-2000:]


def test_a_zero_keeps_its_sign_whole_or_in_chunks():
    """O could hold -0 (a product too small for a float rounds to -0), which a later masked key of the same
    tile turned into +0: one row's bits then depended on its chunk (review; torch.equal sees -0 == +0, so
    the bits are compared as integers)."""
    kv = torch.zeros(1, 2, 16, 1, 16)
    kv[0, 0, 1, 0, 0] = 10.0     # key 1 . q = 100: row 1's p0 = e^-87.3 (the clamp), p1 = 1
    kv[0, 1, 0, 0, 0] = -1e-10   # p0 * v0 rounds to -0
    kv[0, 1, 1, 0, 0] = -0.0
    kv[0, 1, 2, 0, 0] = 1.0      # a key past row 1's position
    q = torch.zeros(3, 1, 16)
    q[:, 0, 0] = 10.0
    table = torch.zeros(1, 1, dtype=torch.int32)
    whole = paged_attention(q, kv, metadata([3], [3], table, 16), 1.0)
    chunk = paged_attention(q[:2], kv, metadata([2], [2], table, 16), 1.0)
    assert torch.equal(whole[:2].view(torch.int32), chunk.view(torch.int32))
