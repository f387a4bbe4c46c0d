"""The CPU elementwise kernels (model/csrc/cpu_norm.c) against the eager torch they replace."""
import pytest
import torch

from pdserve.model import cpu_kernels, layers

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler here")


@pytest.mark.parametrize("rows", [1, 3, 33, 200])
@pytest.mark.parametrize("hidden", [5, 64, 576, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows + hidden)
    wide = torch.randn(rows, hidden + 3, generator=gen) * 3
    x = wide[:, 1:1 + hidden]                      # rows read through a stride
    residual = torch.randn(rows, hidden, generator=gen) if with_residual else None
    weight = torch.randn(hidden, generator=gen)
    if residual is None:
        torch.testing.assert_close(cpu_kernels.rms_norm(x, weight, 1e-5), layers._rms_norm(x, weight, 1e-5))
    else:
        out, new_residual = cpu_kernels.rms_norm(x, weight, 1e-5, residual)
        ref_out, ref_residual = layers._add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(new_residual, ref_residual)
        torch.testing.assert_close(out, ref_out)
        assert not torch.equal(residual, new_residual)   # the caller's residual is left as it was


def test_silu_and_mul_matches_torch_over_a_wide_range():
    """Gates from -200 to 200 (e^-g overflows float32 past 88), widths not a multiple of 8 lanes."""
    for half in (3, 8, 13, 1536):
        gate = torch.linspace(-200, 200, 7 * half).view(7, half)
        up = torch.randn(7, half)
        gate_up = torch.cat([gate, up], dim=1)
        torch.testing.assert_close(cpu_kernels.silu_and_mul(gate_up), layers._silu_and_mul(gate_up),
                                   rtol=2e-6, atol=1e-30)


def test_a_rows_numbers_do_not_depend_on_its_batch():
    x = torch.randn(100, 576)
    residual = torch.randn(100, 576)
    weight = torch.randn(576)
    gate_up = torch.randn(100, 3072)
    out, res = cpu_kernels.rms_norm(x, weight, 1e-5, residual)
    for row in (0, 50, 99):
        one_out, one_res = cpu_kernels.rms_norm(x[row:row + 1].clone(), weight, 1e-5, residual[row:row + 1].clone())
        assert torch.equal(one_out[0], out[row]) and torch.equal(one_res[0], res[row])
        assert torch.equal(cpu_kernels.silu_and_mul(gate_up[row:row + 1].clone())[0],
                           cpu_kernels.silu_and_mul(gate_up)[row])


def test_the_layers_take_the_kernels_on_cpu_float32_only(monkeypatch):
    calls = []
    real = cpu_kernels.rms_norm
    monkeypatch.setattr(cpu_kernels, "rms_norm", lambda *a: calls.append("norm") or real(*a))
    norm = layers.RMSNorm(64, 1e-5, torch.float32, torch.device("cpu"))
    norm.weight.data.normal_()
    x = torch.randn(4, 64)
    torch.testing.assert_close(norm(x), layers._rms_norm(x, norm.weight, 1e-5))
    norm(x.view(2, 2, 64))                        # 3-D (a per-head q/k norm): eager
    norm16 = layers.RMSNorm(64, 1e-5, torch.bfloat16, torch.device("cpu"))
    norm16(x.bfloat16())                          # another dtype: eager
    monkeypatch.setattr(layers, "CPU_FUSED_OPS", False)
    norm(x)                                       # switched off: eager
    assert calls == ["norm"]


def test_the_kernels_load_at_their_first_direct_call(monkeypatch):
    """(A first version called the library before anything had loaded it: AttributeError on None.)"""
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    x, w = torch.randn(2, 16), torch.randn(16)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-5), layers._rms_norm(x, w, 1e-5))
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    gate_up = torch.randn(2, 32)
    torch.testing.assert_close(cpu_kernels.silu_and_mul(gate_up), layers._silu_and_mul(gate_up))


def test_operands_that_do_not_belong_together_are_refused():
    """(Raw pointers go to C: a weight or residual of another width would be read past its end.)"""
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="do not belong together"):
        cpu_kernels.rms_norm(x, torch.randn(32), 1e-5)
    with pytest.raises(ValueError, match="do not belong together"):
        cpu_kernels.rms_norm(x, torch.randn(64), 1e-5, torch.randn(3, 32))
    with pytest.raises(ValueError, match="odd width"):
        cpu_kernels.silu_and_mul(torch.randn(3, 65))


def test_rows_the_kernels_cannot_read_in_place_are_refused():
    """Called directly, a transposed x (unit stride down a column) gave wrong numbers; layers guards its own
    calls with fits_rows."""
    x = torch.randn(64, 8).t()
    with pytest.raises(ValueError, match="unit stride"):
        cpu_kernels.rms_norm(x, torch.randn(64), 1e-5)
    with pytest.raises(ValueError, match="unit stride"):
        cpu_kernels.silu_and_mul(x)
    with pytest.raises(ValueError, match="unit stride"):
        cpu_kernels.rms_norm(torch.randn(3, 8, dtype=torch.float64), torch.randn(8), 1e-5)
