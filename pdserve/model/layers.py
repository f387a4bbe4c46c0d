"""Building blocks of the Llama family: linear, embedding, RMSNorm, rotary embedding (incl. Llama-3 scaling).

Every parameter is allocated with torch.empty on the target device and dtype: nothing is initialised
here, the loader fills real or dummy weights (so an 8B shape costs no CPU init and no copy).
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import cpu_kernels, triton_linear, triton_norm


# Small-batch o/down projections through model/triton_linear.py on CUDA in bf16/fp16 (see there);
# PDSERVE_SMALL_BATCH_TRITON_LINEAR=0 keeps every matmul on cuBLAS.
SMALL_BATCH_TRITON_LINEAR = os.environ.get("PDSERVE_SMALL_BATCH_TRITON_LINEAR", "1") == "1"


# On CPU in float32 the large linear layers run through oneDNN (the kernel behind torch.compile's CPU
# linear), not ATen's MKL path: measured on the 2-core AMD machine with 2 threads (docs/benchmarks.md,
# issue 15), the tied LM head [49,152 x 576] took 47-48 ms instead of 108-127 at 64 rows and 9 instead of
# 15 at one row, gate_up [3,072 x 576] 0.16 instead of 0.24 ms at one row and 2.1-3.4 instead of 2.8-3.7
# at 64. The small projections gained nothing (and lost ~30 us at one row), so they stay on F.linear. The
# choice goes by the weight alone, never by the batch: a request's numbers must not depend on how many
# others share its step (P/D output equals colocated output). PDSERVE_CPU_ONEDNN_LINEAR=0: off.
CPU_ONEDNN_LINEAR = os.environ.get("PDSERVE_CPU_ONEDNN_LINEAR", "1") == "1"
ONEDNN_MIN_WEIGHT_ELEMENTS = 1 << 20


@functools.cache
def _onednn_linear_works() -> bool:
    try:
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        return torch.equal(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w))
    except (AttributeError, RuntimeError):   # a torch built without oneDNN, or an op renamed
        return False


# On CPU in float32 every linear layer runs with its weight packed once, into the blocked layout the GEMM
# kernel reads, instead of being repacked at every call (what torch.compile's CPU freezing does). Which
# GEMM, by CPU:
# - AVX2 without AVX-512 (the 2-core AMD EPYC): pdserve's own (model/csrc/cpu_linear.c). Against oneDNN's
#   packed weights, measured in one process with 2 threads, calls alternated (benchmarks/cpu_gemm_shapes.py):
#   1.1-1.4x at one row, 1.0-1.3x at 64 and 0.99-1.1x at 2,048 over the default model's shapes; a decode
#   step of one sequence 44.6 against 64.8 ms, of 64 sequences 280 against 311 ms (cpu_step_ab.py --switch
#   gemm; docs/benchmarks.md, issue 15).
# - Intel with AVX-512: MKL's packed GEMM (a 2-core Xeon: 64-sequence decode step 336 against 387 ms
#   unpacked, one sequence 68 against 76 ms); our kernel uses 8-lane vectors only.
# - elsewhere: oneDNN's reordered weight. Not MKL on AMD: there MKL's F.linear ran the LM head at less
#   than half oneDNN's speed.
# One packing serves every batch size, and a row's numbers do not depend on the batch it shares
# (tests/model/test_cpu_linear.py). Costs one more copy of the weights in memory
# (benchmarks/cpu_packed_memory.py). PDSERVE_CPU_GEMM=pdserve|mkl|onednn picks one (for A/B runs);
# PDSERVE_CPU_PACKED_LINEAR=0: off (then the oneDNN rule above).
CPU_PACKED_LINEAR = os.environ.get("PDSERVE_CPU_PACKED_LINEAR", "1") == "1"
_PACK_HINT_ROWS = 64


@functools.cache
def _intel_cpu() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return False


def _pack_mkl(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACK_HINT_ROWS)


def _pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS)


def _linear_mkl(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    # The last argument is the batch the packing is for; MKL's packed B is the same for every batch
    # (measured: same size, same numbers as a packing for that batch), so give the actual one: another
    # value makes torch fall back to the unpacked path.
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])


def _linear_onednn(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


PACKERS = {"pdserve": (cpu_kernels.pack_linear, cpu_kernels.linear), "mkl": (_pack_mkl, _linear_mkl),
           "onednn": (_pack_onednn, _linear_onednn)}


def _preferred_packers() -> list[str]:
    forced = os.environ.get("PDSERVE_CPU_GEMM")
    if forced:
        if forced not in PACKERS:
            raise ValueError(f"PDSERVE_CPU_GEMM={forced!r}: expected one of {', '.join(PACKERS)}")
        return [forced]
    flags = cpu_kernels.cpu_flags()
    # MKL's AVX-512 kernels outrun ours (AVX2) on an AVX-512 Xeon; elsewhere ours come first. oneDNN is the
    # last resort: on AVX-512 it picks kernels by the batch, so a row's last bits move with what shares its
    # step (an AMD EPYC with AVX-512, 2026-12-06: tests/model/test_cpu_linear.py), and P/D would not be
    # token-identical to colocated.
    if not _intel_cpu():
        order = ["pdserve"]
    else:
        order = ["mkl", "pdserve"] if "avx512f" in flags else ["pdserve", "mkl"]
    ours = {"avx2", "fma"} <= flags and cpu_kernels.available()
    return [name for name in order if name != "pdserve" or ours] + ["onednn"]


@functools.cache
def packer() -> str | None:
    """The packed GEMM this CPU uses (a key of PACKERS), or None when none works here. One chosen by
    PDSERVE_CPU_GEMM that does not work raises: an A/B run must not measure the fallback unawares."""
    forced = os.environ.get("PDSERVE_CPU_GEMM")
    for name in _preferred_packers():
        pack, run = PACKERS[name]
        try:
            x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
            if torch.allclose(run(x, pack(w), w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-5):
                return name
        except (AttributeError, RuntimeError) as exc:   # no kernels, no MKL or oneDNN, an op renamed
            if forced:
                raise RuntimeError(f"PDSERVE_CPU_GEMM={forced}: it does not work here: {exc}") from exc
            continue
    if forced:
        raise RuntimeError(f"PDSERVE_CPU_GEMM={forced}: its result differs from F.linear here")
    return None


def prepare_cpu_linear() -> str | None:
    """Choose the packed GEMM (building the C kernels where it is ours) at the engine's start, not at its
    first request: a PDSERVE_CPU_GEMM that names no GEMM or one that does not work here then fails the
    start with its reason, instead of a healthy-looking server failing every request."""
    return packer() if CPU_PACKED_LINEAR else None


def _packed_weight(weight: torch.Tensor, name: str) -> torch.Tensor:
    """The packed copy of weight for GEMM `name`, kept on the tensor itself (so it dies with it) and
    redone when the weight changes: written in place (its version), given new storage or shape (the
    loader writes through .data, which leaves the version alone: LlamaModel.load_weights also drops
    the copies)."""
    cache = weight.__dict__.setdefault("_pdserve_packed", {})
    key = (weight._version, weight.data_ptr(), tuple(weight.shape))
    cached = cache.get(name)
    if cached is None or cached[0] != key:
        cached = cache[name] = (key, PACKERS[name][0](weight))
    return cached[1]


def drop_packed_weights(weight: torch.Tensor) -> None:
    weight.__dict__.pop("_pdserve_packed", None)


def _packable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] > 0
            and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.is_contiguous() and x.shape[1] == weight.shape[1] > 0
            and (bias is None or (bias.device.type == "cpu" and bias.dtype == torch.float32
                                  and tuple(bias.shape) == (weight.shape[0],))))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b); on CPU in float32 through a packed GEMM or oneDNN where they measured faster (above)."""
    if CPU_PACKED_LINEAR and _packable(x, weight, bias) and (name := packer()) is not None:
        return PACKERS[name][1](x.contiguous(), _packed_weight(weight, name), weight, bias)
    if (CPU_ONEDNN_LINEAR and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[0] > 0 and weight.numel() >= ONEDNN_MIN_WEIGHT_ELEMENTS and weight.is_contiguous()
            and _onednn_linear_works()):
        return _onednn(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _onednn(*args):
    return torch.ops.mkldnn._linear_pointwise(*args)


class Linear(nn.Module):
    """y = x W^T (+ b). W: [out_features, in_features], the HF layout, so checkpoints copy in as is.

    A fused linear (qkv_proj, gate_up_proj) is one Linear whose output rows are the concatenation of
    its parts; the loader copies each checkpoint part into its row range (see LlamaModel.load_weights).
    small_batch_triton: run inputs of at most triton_linear.MAX_ROWS rows through the Triton kernel
    where it serves them (set for the projections where it measured faster than cuBLAS).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, device: torch.device, small_batch_triton: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.small_batch_triton = small_batch_triton

    def _use_triton(self, x: torch.Tensor) -> bool:
        return self.small_batch_triton and SMALL_BATCH_TRITON_LINEAR and triton_linear.supports(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_triton(x):
            return triton_linear.linear_triton(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


# -- elementwise chains, fused on CUDA -------------------------------------------------------------
# In eager PyTorch an RMSNorm is eight elementwise kernels, a residual add one more and SwiGLU two: in a
# small decode step those launches, not the bytes, set the time. On CUDA each chain below runs as one
# kernel generated by torch.compile (tensors-only functions, so one compilation serves every layer;
# ~7 s at start-up). Measured on one H200 (docs/gpu.md): prefill MFU 57% -> 64% (1 x 8,192), decode
# batch 256 -2 ms. PDSERVE_FUSE_SMALL_OPS=0 keeps them eager; on CPU they always are (the reference).
FUSE_SMALL_OPS = os.environ.get("PDSERVE_FUSE_SMALL_OPS", "1") == "1"


def _fused_on_cuda(fn):
    compiled = None

    @functools.wraps(fn)
    def run(x: torch.Tensor, *args):
        nonlocal compiled
        if not (FUSE_SMALL_OPS and x.is_cuda):
            return fn(x, *args)
        if compiled is None:
            # emulate_precision_casts: keep every bf16/fp16 rounding the eager ops make (Inductor
            # would otherwise carry fp32 through a fused chain), so the fast path rounds as HF does.
            compiled = torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True})
        return compiled(x, *args)
    return run


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, the statistics in float32 (HF's op order, so bf16 results match)."""
    input_dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(input_dtype)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add that ends a sublayer and the norm that starts the next: (norm(x + r), x + r)."""
    residual = x + residual
    return _rms_norm(residual, weight, eps), residual


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


rms_norm = _fused_on_cuda(_rms_norm)
add_rms_norm = _fused_on_cuda(_add_rms_norm)
_silu_and_mul_cuda = _fused_on_cuda(_silu_and_mul)

# On CPU in float32 the same chains run as C kernels (model/csrc/cpu_norm.c), one pass over a row
# each: measured with benchmarks/cpu_step_ab.py --switch fused (docs/benchmarks.md, issue 15).
# PDSERVE_CPU_FUSED_OPS=0 keeps them eager.
CPU_FUSED_OPS = os.environ.get("PDSERVE_CPU_FUSED_OPS", "1") == "1"


def _cpu_fused(x: torch.Tensor) -> bool:
    return CPU_FUSED_OPS and cpu_kernels.fits_rows(x) and cpu_kernels.available()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _cpu_fused(gate_up):
        return cpu_kernels.silu_and_mul(gate_up)
    return _silu_and_mul_cuda(gate_up)


# 16-bit RMSNorm (and its residual add) of 2-D rows through model/triton_norm.py on CUDA;
# PDSERVE_TRITON_RMS_NORM=0 keeps the torch.compile kernel.
TRITON_RMS_NORM = os.environ.get("PDSERVE_TRITON_RMS_NORM", "1") == "1"


class RMSNorm(nn.Module):
    """RMSNorm; given the residual stream too, it first adds x to it and returns (normed, new residual)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if _cpu_fused(x) and self.weight.dtype == torch.float32 and self.weight.is_contiguous() and (
                residual is None or cpu_kernels.fits_rows(residual)):
            return cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
        if TRITON_RMS_NORM and FUSE_SMALL_OPS and triton_norm.supports(x, self.weight, residual):
            return triton_norm.rms_norm_triton(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 on CPU, for rope_type default | linear | llama3."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between.
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        old_context_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported (default | linear | llama3)")


class RotaryEmbedding(nn.Module):
    """NeoX-style (rotate-half) rotary embedding, the HF Llama layout. cos/sin are computed once per
    forward from the positions (a [T, head_dim/2] outer product): no [max_len, dim] table to hold."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None, device: torch.device):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope_theta, rope_scaling).to(device),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim/2], float32
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]      # each [T, 1, head_dim/2]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim/2] from RotaryEmbedding."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # each [T, heads, head_dim/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
