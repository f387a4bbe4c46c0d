"""layers.linear on CPU: a packed GEMM (pdserve's own on AVX2 without AVX-512, MKL's on Intel, oneDNN's
elsewhere), else oneDNN where it measured faster, ATen's F.linear elsewhere; the same numbers every way up
to float32 summation order."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import cpu_kernels, layers


@pytest.mark.parametrize("rows, out_features, in_features", [
    (1, 96, 64),        # a small weight: F.linear
    (1, 2048, 576),     # a weight past ONEDNN_MIN_WEIGHT_ELEMENTS: oneDNN
    (70, 2048, 576),
    (70, 300, 130),
])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    torch.testing.assert_close(layers.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_the_cpu_build_has_onednn():
    assert layers._onednn_linear_works()   # else every case here silently tests F.linear against itself


def test_the_choice_goes_by_the_weight_never_by_the_batch(monkeypatch):
    monkeypatch.setattr(layers, "CPU_PACKED_LINEAR", False)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(layers, "_onednn", lambda *a: calls.append(a[0].shape[0]) or real(*a), raising=False)
    big, small = torch.randn(2048, 576), torch.randn(96, 576)
    for rows in (1, 15, 16, 64):
        x = torch.randn(rows, 576)
        row_of_batch = layers.linear(x, big)[:1]
        torch.testing.assert_close(row_of_batch, layers.linear(x[:1], big), rtol=1e-5, atol=1e-4)
        layers.linear(x, small)
    assert calls == [1, 1, 15, 1, 16, 1, 64, 1]   # the big weight at every batch size, the small never


def test_non_contiguous_input_and_off_switch(monkeypatch):
    x = torch.randn(64, 1100)[:, :1024]     # a strided view, as a split of a fused output is
    w = torch.randn(1024, 1024)
    torch.testing.assert_close(layers.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(layers, "CPU_ONEDNN_LINEAR", False)
    monkeypatch.setattr(layers, "CPU_PACKED_LINEAR", False)
    assert torch.equal(layers.linear(x, w), F.linear(x, w))


needs_packed = pytest.mark.skipif(layers.packer() is None, reason="this torch build has no packed GEMM")


@pytest.mark.parametrize("intel, flags, kernels, expected", [
    (False, {"avx2", "fma"}, True, ["pdserve", "onednn"]),
    (False, {"avx2", "fma", "avx512f"}, True, ["pdserve", "onednn"]),   # AMD EPYC with AVX-512: not oneDNN
    (True, {"avx2", "fma"}, True, ["pdserve", "mkl", "onednn"]),
    (True, {"avx2", "fma", "avx512f"}, True, ["mkl", "pdserve", "onednn"]),
    (False, {"avx2", "fma"}, False, ["onednn"]),                        # no C compiler
    (True, {"sse4_2"}, True, ["mkl", "onednn"]),
])
def test_the_packer_follows_the_cpu(monkeypatch, intel, flags, kernels, expected):
    monkeypatch.delenv("PDSERVE_CPU_GEMM", raising=False)
    monkeypatch.setattr(layers, "_intel_cpu", lambda: intel)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_kernels, "available", lambda: kernels)
    assert layers._preferred_packers() == expected


def test_this_cpu_gets_the_first_packer_that_works():
    assert layers.packer() in layers._preferred_packers()
    if {"avx2", "fma"} <= cpu_kernels.cpu_flags() and cpu_kernels.available() and not layers._intel_cpu():
        assert layers.packer() == "pdserve"


def test_the_gemm_can_be_chosen_and_a_wrong_name_is_refused(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_GEMM", "onednn")
    assert layers._preferred_packers() == ["onednn"]
    monkeypatch.setenv("PDSERVE_CPU_GEMM", "blas")
    with pytest.raises(ValueError, match="PDSERVE_CPU_GEMM='blas': expected one of pdserve, mkl, onednn"):
        layers._preferred_packers()


needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler here")


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 11, 12, 13, 25, 100, 128, 131, 200])
@pytest.mark.parametrize("out_features, in_features", [(16, 8), (37, 13), (200, 576), (48, 3000)])
@pytest.mark.parametrize("bias", [False, True])
def test_our_gemm_matches_f_linear_at_every_edge(rows, out_features, in_features, bias):
    """Row tails (tiles of 6), column tails (panels of 16), odd K, K past the row block's budget, bias,
    and rows read through a stride (a slice of a wider activation)."""
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    wide = torch.randn(rows, in_features + 5, generator=gen)
    x = wide[:, 2:2 + in_features]
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    y = cpu_kernels.linear(x, cpu_kernels.pack_linear(w), w, b)
    # one chain of additions over K: its rounding grows with K (BLAS sums in blocks)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4 * max(1.0, in_features / 576))


@needs_packed
def test_packed_path_serves_every_weight_at_every_batch(monkeypatch):
    calls = []
    pack, real = layers.PACKERS[layers.packer()]
    monkeypatch.setitem(layers.PACKERS, layers.packer(), (pack, lambda x, *a: calls.append(x.shape[0]) or real(x, *a)))
    for rows in (1, 3, 64, 300):
        for w in (torch.randn(2048, 576), torch.randn(96, 576)):
            x = torch.randn(rows, 576)
            torch.testing.assert_close(layers.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert calls == [1, 1, 3, 3, 64, 64, 300, 300]


@needs_packed
@pytest.mark.parametrize("name", sorted(layers.PACKERS))
def test_a_rows_numbers_do_not_depend_on_its_batch(name):
    """P/D output equals colocated output only if a request's logits are the same whatever shares its
    step: a row alone and the same row inside batches of 3 to 2,048 rows, bit for bit."""
    if name == "mkl" and not layers._intel_cpu():
        pytest.skip("MKL's packed GEMM is used on Intel only")
    if name == "pdserve" and not cpu_kernels.available():
        pytest.skip("no C compiler here")
    if name == "onednn" and layers.packer() != "onednn":
        # On an AVX-512/AMX Xeon (2026-12-04) oneDNN picks kernels by the batch and a row's last bits
        # move with it; there MKL serves (or ours), and oneDNN only when forced (PDSERVE_CPU_GEMM).
        pytest.skip(f"oneDNN's packed GEMM is not the one this CPU uses ({layers.packer()} is)")
    pack, run = layers.PACKERS[name]
    gen = torch.Generator().manual_seed(1)
    for out_features, in_features in [(3072, 576), (576, 1536), (960, 576)]:
        w = torch.randn(out_features, in_features, generator=gen)
        packed = pack(w)
        x = torch.randn(2048, in_features, generator=gen)
        # rows of a tile of 6 (AVX2) or 12 (AVX-512), and of the halved last tiles of 16 and 256 rows
        for row in (0, 2, 7, 11, 14, 250):
            alone = run(x[row:row + 1].clone(), packed, w, None)
            for rows in (3, 8, 16, 17, 64, 65, 256, 2048):
                if row < rows:
                    batch = run(x[:rows].contiguous(), packed, w, None)
                    assert torch.equal(batch[row:row + 1], alone), (name, out_features, rows, row)


@needs_kernels
@pytest.mark.parametrize("m, n, k", [(256, 3072, 576), (131, 200, 96), (64, 576, 1536), (7, 40, 64)])
def test_our_gemm_gives_the_same_bits_on_any_number_of_threads(m, n, k):
    """The threads split the work by rows x panels, a task on the border between two threads' shares cut
    by rows: an element's sum must not depend on the split, and every element must be written once."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=gen)
    packed = cpu_kernels.pack_linear(w)
    x = torch.randn(m, k, generator=gen)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            results.append(cpu_kernels.linear(x, packed, w, None))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])
    torch.testing.assert_close(results[0], F.linear(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler here")
@pytest.mark.parametrize("m, n, k", [(1, 3072, 576), (12, 49, 576), (256, 960, 576), (2048, 70, 96)])
def test_the_weight_prefetch_changes_no_bit(m, n, k):
    """The first row tile of each run of panels prefetches the next run (cpu_linear.c), where all of its
    panels exist (70 columns: 5 panels, no whole run after the first 4), and a prefetch never stores: the
    output is the same with it off."""
    import ctypes
    flag = ctypes.c_int.in_dll(cpu_kernels._library(), "pdserve_linear_prefetch")
    gen = torch.Generator().manual_seed(m + n)
    w, x, b = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    packed = cpu_kernels.pack_linear(w)
    assert flag.value == 1   # on by default
    try:
        on = cpu_kernels.linear(x, packed, w, b)
        flag.value = 0
        off = cpu_kernels.linear(x, packed, w, b)
    finally:
        flag.value = 1
    assert torch.equal(on, off)


@needs_packed
def test_a_weight_written_in_place_is_packed_again():
    """A reload copies into the same tensor: the packed copy made before must not be served after."""
    w = torch.randn(512, 576)
    x = torch.randn(8, 576)
    layers.linear(x, w)
    w.copy_(torch.randn(512, 576))
    torch.testing.assert_close(layers.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_packed
def test_a_new_weight_at_a_freed_weights_address_gets_its_own_packing():
    """(A first version keyed the packed copies by address: a tensor allocated where a freed one lay
    was served the freed one's weights.)"""
    for seed in range(6):
        w = torch.randn(512, 576, generator=torch.Generator().manual_seed(seed))
        x = torch.randn(8, 576)
        torch.testing.assert_close(layers.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
        del w


def test_other_dtypes_and_empty_batches_take_f_linear():
    w = torch.randn(8, 4, dtype=torch.bfloat16)
    x = torch.randn(20, 4, dtype=torch.bfloat16)
    assert torch.equal(layers.linear(x, w), F.linear(x, w))
    assert layers.linear(torch.randn(0, 4), torch.randn(8, 4)).shape == (0, 8)


@needs_packed
def test_a_reload_through_the_loader_is_packed_again(tiny_model_paths):
    """load_weights writes through .data, which leaves the version alone: the packings made before a
    reload must not be served after it (review of the C GEMM: they were)."""
    from pdserve.model.loader import load_model
    from tests.helpers_models import PagedRunner
    model, _ = load_model(tiny_model_paths["llama"], torch.float32, torch.device("cpu"))
    other, _ = load_model(tiny_model_paths["llama"], torch.float32, torch.device("cpu"), load_format="dummy", seed=3)
    prompt = list(range(60, 80))
    PagedRunner(model).step([prompt], [20], [[0, 1, 2]])          # packs every weight
    model.load_weights(other.state_dict().items())
    reloaded = PagedRunner(model).step([prompt], [20], [[0, 1, 2]])
    assert torch.equal(reloaded, PagedRunner(other).step([prompt], [20], [[0, 1, 2]]))


@needs_packed
def test_new_storage_under_the_same_tensor_is_packed_again():
    w = torch.randn(64, 576)
    x = torch.randn(3, 576)
    layers.linear(x, w)
    w.data = torch.randn(128, 576)              # same tensor object and version, new storage and shape
    torch.testing.assert_close(layers.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", ["narrow_x", "float64_weight", "float64_bias", "short_bias"])
def test_mismatched_operands_never_reach_the_kernel(case):
    """Shapes and dtypes that do not belong together get F.linear's error or its answer, never a read
    past a buffer (review of the C GEMM: they were passed to C as raw pointers)."""
    x, w, b = torch.randn(4, 576), torch.randn(96, 576), None
    if case == "narrow_x":
        x = torch.randn(4, 500)
    elif case == "float64_weight":
        w = w.double()
    elif case == "float64_bias":
        b = torch.randn(96, dtype=torch.float64)
    elif case == "short_bias":
        b = torch.randn(95)
    try:
        expected = F.linear(x, w, b)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            layers.linear(x, w, b)
    else:
        torch.testing.assert_close(layers.linear(x, w, b), expected)


@needs_kernels
@pytest.mark.parametrize("case", ["float64_x", "short_bias", "float64_bias", "bfloat16_weight"])
def test_the_kernels_own_entry_points_refuse_what_does_not_belong_together(case):
    """cpu_kernels.linear / pack_linear called directly (layers.linear guards its own calls): a float64 x
    gave NaN, a short bias was read past, a bfloat16 weight was packed as garbage."""
    x, w, b = torch.randn(4, 576), torch.randn(96, 576), None
    if case == "bfloat16_weight":
        with pytest.raises(ValueError, match="pack_linear"):
            cpu_kernels.pack_linear(w.bfloat16())
        return
    if case == "float64_x":
        x = x.double()
    elif case == "short_bias":
        b = torch.randn(3)
    else:
        b = torch.randn(96, dtype=torch.float64)
    with pytest.raises(ValueError, match="do not belong together"):
        cpu_kernels.linear(x, cpu_kernels.pack_linear(w), w, b)


def test_a_wrong_gemm_name_fails_the_engines_start(monkeypatch, tiny_model_paths):
    """PDSERVE_CPU_GEMM=garbage used to pass the start (health 200) and fail every request's step."""
    from pdserve.engine.llm import LLM
    monkeypatch.setenv("PDSERVE_CPU_GEMM", "garbage")
    layers.packer.cache_clear()
    try:
        with pytest.raises(ValueError, match="PDSERVE_CPU_GEMM='garbage': expected one of"):
            LLM(str(tiny_model_paths["llama"]), dtype="float32", device="cpu")
    finally:
        layers.packer.cache_clear()


@needs_kernels
def test_the_kernel_refuses_a_packing_of_another_weight():
    w = torch.randn(96, 576)
    with pytest.raises(ValueError, match="do not belong together"):
        cpu_kernels.linear(torch.randn(2, 576), cpu_kernels.pack_linear(torch.randn(48, 576)), w, None)


def test_a_forced_gemm_that_does_not_work_is_an_error(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_GEMM", "mkl")
    broken = (lambda w: (_ for _ in ()).throw(RuntimeError("no MKL here")), layers.PACKERS["mkl"][1])
    monkeypatch.setitem(layers.PACKERS, "mkl", broken)
    layers.packer.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="PDSERVE_CPU_GEMM=mkl: it does not work here: no MKL here"):
            layers.packer()
    finally:
        layers.packer.cache_clear()


@needs_kernels
@pytest.mark.skipif("avx512f" not in cpu_kernels.cpu_flags(), reason="the AVX-512 tiles are built only here")
@pytest.mark.parametrize("n, m", [(200, 37), (248, 131), (200, 300)])
def test_the_avx512_tiles_give_the_avx2_tiles_numbers_to_the_bit(tmp_path, n, m):
    """P on an AVX2 machine and D on an AVX-512 one must agree: the same GEMM built both ways, same bits.
    Past 128 rows the AVX-512 build takes tiles of four panels (the last one partial at n = 248)."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path
    compiler = shutil.which("gcc") or shutil.which("cc")
    source = Path(cpu_kernels.__file__).parent / "csrc" / "cpu_linear.c"
    gen = torch.Generator().manual_seed(3)
    k = 576   # n: a partial last panel, odd pairs of panels; m = 37: tiles of 12 and their tail
    w, x, b = (torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen), torch.randn(n, generator=gen))
    outputs = []
    for name, arch in (("avx2", ["-mavx2", "-mfma"]), ("avx512", ["-march=native"])):
        lib_path = tmp_path / f"{name}.so"
        subprocess.run([compiler, "-O3", *arch, "-fopenmp", "-std=c11", "-ffp-contract=off", "-shared", "-fPIC",
                        str(source), "-o", str(lib_path)], check=True, capture_output=True, timeout=120)
        lib = ctypes.CDLL(str(lib_path))
        packed = torch.zeros(-(-n // 16) * k * 16)
        ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
        lib.pdserve_pack_linear(ptr(w), ptr(packed), n, k)
        y = torch.empty(m, n)
        lib.pdserve_linear(ptr(x), ctypes.c_int64(k), ptr(packed), ptr(b), ptr(y), ctypes.c_int64(n), m, n, k)
        outputs.append(y)
    assert torch.equal(outputs[0], outputs[1])
    torch.testing.assert_close(outputs[1], F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@needs_kernels
def test_the_driver_takes_zero_rows_as_it_did_before_the_even_split():
    """Before the rows x panels split, m = 0 was an empty loop; since, (m + 0 - 1) / 0 is a SIGFPE. Run in a
    child so that the crash fails this test rather than ending the session."""
    import subprocess
    import sys
    code = r"""
import torch
from pdserve.model import cpu_kernels
lib = cpu_kernels._load()
w = torch.randn(16, 64)
packed = cpu_kernels.pack_linear(w)
x, y = torch.zeros(1, 64), torch.full((1, 16), 7.0)
lib.pdserve_linear(x.data_ptr(), 64, packed.data_ptr(), None, y.data_ptr(), 16, 0, 16, 64)
print((y == 7.0).all().item(), flush=True)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["True"], (result.returncode, result.stderr[-2000:])


@needs_kernels
@pytest.mark.parametrize("m", [1, 13, 64, 131])
@pytest.mark.parametrize("bias", [False, True])
def test_the_tiles_write_only_their_columns(m, bias):
    """The tiles store straight from their registers (masked on the last, partial panel): every column
    past n of a row of y, and every row past m, must keep what it held."""
    lib = cpu_kernels._load()
    gen = torch.Generator().manual_seed(5)
    n, k, ldy = 200, 96, 232   # 12.5 panels: the last one has 8 columns; 32 spare columns a row
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    packed = cpu_kernels.pack_linear(w)
    y = torch.full((m + 2, ldy), 7.0)
    lib.pdserve_linear(x.data_ptr(), k, packed.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), ldy,
                       m, n, k)
    assert (y[:m, n:] == 7.0).all() and (y[m:] == 7.0).all()
    torch.testing.assert_close(y[:m, :n], F.linear(x, w, b), rtol=1e-4, atol=1e-4)
