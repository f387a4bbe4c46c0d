"""layers.linear on CPU: MKL's packed GEMM on Intel, else oneDNN where it measured faster, ATen's F.linear
elsewhere; the same numbers every way up to float32 summation order."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import layers


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


needs_packed = pytest.mark.skipif(not (layers._intel_cpu() and layers._mkl_packed_works()),
                                  reason="MKL's packed GEMM is used on Intel CPUs only")


@needs_packed
def test_packed_path_serves_every_weight_at_every_batch(monkeypatch):
    calls = []
    real = layers._packed_linear
    monkeypatch.setattr(layers, "_packed_linear", lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b))
    for rows in (1, 3, 64, 300):
        for w in (torch.randn(2048, 576), torch.randn(96, 576)):
            x = torch.randn(rows, 576)
            torch.testing.assert_close(layers.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert calls == [1, 1, 3, 3, 64, 64, 300, 300]


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
