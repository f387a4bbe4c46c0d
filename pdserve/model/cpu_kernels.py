"""The CPU's own kernels (model/csrc/*.c), built with the machine's C compiler at first use.

A plain C shared library called through ctypes, not a torch extension: it builds in about a second
(a torch extension compiles torch's headers for a minute), needs nothing but gcc, and links the libgomp
torch already loaded, so it runs on torch's OpenMP threads. The library lands in a cache directory keyed
by the source, the flags, the compiler and the CPU, since -march=native code must not run on another CPU.
When no compiler works, the caller falls back to plain torch: one warning, slower, and answers equal
up to float32 rounding, not bit for bit (the linear layers then sum in oneDNN's order: a P and a D
instance should both have the kernels, or both not).
$PDSERVE_CPU_KERNELS=0 turns the kernels off; $PDSERVE_KERNEL_CACHE moves the cache.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("cpu_decode_attention.c", "cpu_linear.c", "cpu_norm.c", "cpu_prefill_attention.c",
                                    "cpu_rope.c")]
HEADERS = [CSRC / "vec8.h"]
# -ffp-contract=off: no multiply-add fused behind our back (explicit FMAs are written as such), so that
# the kernels that match torch op for op do so bit for bit with any compiler ($CC may be clang, which
# fuses by default; GCC does not under -std=c11, but does under gnu11).
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off"]
ENABLED = os.environ.get("PDSERVE_CPU_KERNELS", "1") != "0"
_COMPILE_TIMEOUT_S = 120

_lib: ctypes.CDLL | None = None
_tried = False
_load_lock = threading.Lock()   # engines build in their own processes; threads of one wait for one build


def cache_dir() -> Path:
    explicit = os.environ.get("PDSERVE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pdserve" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([*(src.read_text() for src in SOURCES + HEADERS), " ".join(FLAGS), version,
                                     _cpu_flags()]).encode())
    target = cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    checksum = target.with_name(target.name + ".sha256")
    if target.exists():
        # A library cut short (a crash or power loss before its pages reached the disk, a full disk, a
        # shared cache written by another host) loads, then kills the engine with SIGBUS at its first call
        # into a missing page, and again on every restart: only a library matching the checksum written
        # after it was built is loaded.
        if checksum.is_file() and checksum.read_text().strip() == _sha256(target):
            return target
        logger.warning("CPU kernels: %s does not match its checksum (cut short or changed): rebuilding it", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a private name and renamed: engines starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
                                timeout=_COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        _fsync(tmp)
        digest = _sha256(Path(tmp))
        os.replace(tmp, target)
        _write_durably(checksum, digest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    """text into path, whole or not at all: written under a private name, synced, renamed."""
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    with _load_lock:
        if not _tried:
            _lib = _build_and_open()
            _tried = True   # after _lib: a thread that skips the lock never sees "tried" with the build unfinished
    return _lib


def _build_and_open() -> ctypes.CDLL | None:
    if not ENABLED:
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    try:
        if compiler is None:
            raise RuntimeError("no C compiler (gcc or cc) on PATH")
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels unavailable, using plain torch (slower): %s", exc)
        return None
    fn = lib.pdserve_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 4 + [
        ctypes.c_float]
    lib.pdserve_prefill_attention.restype = ctypes.c_int
    lib.pdserve_prefill_attention.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5 + [
        ctypes.c_int] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 4 + [ctypes.c_float]
    lib.pdserve_rms_norm.restype = None
    lib.pdserve_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_float]
    lib.pdserve_silu_and_mul.restype = None
    lib.pdserve_silu_and_mul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.pdserve_pack_linear.restype = None
    lib.pdserve_pack_linear.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.pdserve_linear.restype = None
    lib.pdserve_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.pdserve_rope_write_kv.restype = ctypes.c_int
    lib.pdserve_rope_write_kv.argtypes = [ctypes.c_void_p, ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3 + [
        ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_int64]
    return lib


def available() -> bool:
    return _load() is not None


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, out: torch.Tensor) -> bool:
    """One query token per sequence, straight from the paged cache, into out. False when the kernel is
    unavailable or the inputs are outside what it handles (the caller then runs plain torch).

    q, out: [n, heads, dim] float32; kv_layer: [blocks, 2, slots, kv_heads, dim] (a layer's view);
    block_tables: [n, max_blocks] int32; seq_lens: [n] int32, each >= 1.
    """
    lib = _load()
    if lib is None or q.dtype != torch.float32 or kv_layer.dtype != torch.float32 or q.device.type != "cpu":
        return False
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    if kv_layer.stride()[2:] != (num_kv_heads * head_dim, head_dim, 1) or not out.is_contiguous():
        return False
    # The C side gets raw pointers: q's and out's rows, the tables' rows and the lengths must be as many
    # as the sequences, and q's head size the cache's, or it would read or write past them.
    n = q.shape[0] if q.dim() == 3 else -1
    if (q.dim() != 3 or q.shape[2] != head_dim or out.dtype != torch.float32 or out.device.type != "cpu"
            or out.shape != q.shape or block_tables.dim() != 2 or block_tables.shape[0] != n
            or tuple(seq_lens.shape) != (n,)):
        return False
    q = q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    rc = lib.pdserve_decode_attention(
        q.data_ptr(), kv_layer.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
        q.shape[0], block_tables.shape[1], num_blocks, kv_layer.stride(0), kv_layer.stride(1), block_size,
        q.shape[1], num_kv_heads, head_dim, scale)
    return rc == 0


def prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                      query_start: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> bool:
    """Query chunks of several tokens each, causal within the chunk, over the cached prefix, straight
    from the paged cache, into out. False when the kernel is unavailable or the inputs are outside what
    it handles (the caller then runs plain torch).

    q [T, heads, dim] float32, rows of any stride, heads and dims dense; out [T, heads, dim] dense;
    kv_layer [blocks, 2, slots, kv_heads, dim] (a layer's view); block_tables [n, max_blocks] int32;
    query_start [n + 1] int32: sequence i's tokens are rows [query_start[i], query_start[i + 1]) of q
    and out, its positions [seq_lens[i] - query_len, seq_lens[i]).
    """
    lib = _load()
    if (lib is None or q.dtype != torch.float32 or kv_layer.dtype != torch.float32 or q.device.type != "cpu"
            or q.dim() != 3 or q.stride()[1:] != (q.shape[2], 1) or not out.is_contiguous()):
        return False
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    if kv_layer.stride()[2:] != (num_kv_heads * head_dim, head_dim, 1) or q.shape[2] != head_dim:
        return False
    block_tables = block_tables.to(torch.int32).contiguous()
    query_start = query_start.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    # The C side gets raw pointers and checks the cache's side (block ids, lengths) but cannot see q's and
    # out's rows or the tables' count: a token range past q or out, or a sequence without its table row
    # or its query_start entry, would be read or written, not refused.
    n = seq_lens.shape[0]
    if (out.dtype != torch.float32 or out.device.type != "cpu" or out.shape != q.shape or seq_lens.dim() != 1
            or query_start.shape != (n + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != n
            or (n and (int(query_start[0]) < 0 or int(query_start[-1]) > q.shape[0]))):
        return False
    rc = lib.pdserve_prefill_attention(
        q.data_ptr(), q.stride(0), kv_layer.data_ptr(), block_tables.data_ptr(), query_start.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), seq_lens.shape[0], block_tables.shape[1], num_blocks,
        kv_layer.stride(0), kv_layer.stride(1), block_size, q.shape[1], num_kv_heads, head_dim, scale)
    return rc == 0


def _library() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU kernels are unavailable (see the warning logged when they failed to build)")
    return lib


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 in the kernel's panel layout (model/csrc/cpu_linear.c), for linear()."""
    lib = _library()
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"pack_linear: weight {tuple(weight.shape)} {weight.dtype} on {weight.device}: expected a "
                         f"2-D float32 CPU tensor")
    weight = weight.contiguous()
    n, k = weight.shape
    _check_dims(n, k)
    packed = torch.empty(packed_linear_numel(n, k), dtype=torch.float32, device="cpu")
    lib.pdserve_pack_linear(weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def packed_linear_numel(n: int, k: int) -> int:
    """Elements of a packed [n, k] weight: n rounded up to whole 16-column panels (cpu_linear.c's NR)."""
    return -(-n // 16) * 16 * k


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return frozenset(_cpu_flags().split(":", 1)[-1].split()) if _cpu_flags() else frozenset()


def _check_dims(*dims: int) -> None:
    # the C side takes int sizes, and sizes its blocks by K
    if not all(0 < d < 2 ** 31 for d in dims):
        raise ValueError(f"CPU kernels: sizes {dims} outside 1 .. 2^31 - 1")


def linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 (rows may be strided) times the weight that pack_linear packed (+ bias): [M, N]."""
    n, k = weight.shape
    lib = _library()
    if (x.dim() != 2 or x.shape[1] != k or packed.numel() != packed_linear_numel(n, k)
            or any(t is not None and (t.dtype != torch.float32 or t.device.type != "cpu") for t in (x, packed, bias))
            or (bias is not None and tuple(bias.shape) != (n,))):
        raise ValueError(f"linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)}, packed "
                         f"{packed.numel()} elements {packed.dtype}, bias "
                         f"{None if bias is None else (tuple(bias.shape), bias.dtype)}: they do not belong together "
                         f"(float32 on CPU, x [M, K], bias [N])")
    _check_dims(x.shape[0], n, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device="cpu")
    lib.pdserve_linear(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                       y.data_ptr(), n, x.shape[0], n, k)
    return y


def fits_rows(x: torch.Tensor) -> bool:
    """x is float32 rows on CPU that the elementwise kernels read in place (2-D, unit stride along a row)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """layers._rms_norm (no residual) or layers._add_rms_norm (returns (normed, x + residual)) on rows that
    fits_rows accepts; weight dense float32 [hidden]."""
    if not fits_rows(x):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype} with strides {x.stride()}: not float32 rows on "
                         f"CPU with unit stride along a row")
    rows, h = x.shape
    if (tuple(weight.shape) != (h,) or weight.dtype != torch.float32 or not weight.is_contiguous()
            or (residual is not None and (tuple(residual.shape) != (rows, h) or not fits_rows(residual)))):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, residual "
                         f"{None if residual is None else tuple(residual.shape)}: they do not belong together")
    _check_dims(rows, h)
    out = torch.empty(rows, h, dtype=torch.float32, device="cpu")
    new_residual = None
    if residual is not None:
        if residual.stride(1) != 1:
            residual = residual.contiguous()
        new_residual = torch.empty(rows, h, dtype=torch.float32, device="cpu")
    _library().pdserve_rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                          0 if residual is None else residual.stride(0),
                          None if new_residual is None else new_residual.data_ptr(), weight.data_ptr(),
                          out.data_ptr(), h, rows, h, eps)
    return out if residual is None else (out, new_residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """layers._silu_and_mul on rows that fits_rows accepts: [T, 2 * inter] -> [T, inter]."""
    if not fits_rows(gate_up):
        raise ValueError(f"silu_and_mul: gate_up {tuple(gate_up.shape)} {gate_up.dtype} with strides "
                         f"{gate_up.stride()}: not float32 rows on CPU with unit stride along a row")
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"silu_and_mul: gate_up {tuple(gate_up.shape)} has an odd width")
    _check_dims(rows, width)
    out = torch.empty(rows, width // 2, dtype=torch.float32, device="cpu")
    _library().pdserve_silu_and_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width // 2)
    return out


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """attention.rope_and_write_kv on CPU float32: q rotated in place, the rotated k and v written into
    their slots of kv_layer. False (nothing written) when the kernels are unavailable or the layout is
    not one the kernel reads (the caller then runs torch).

    q [T, heads, dim], k and v [T, kv_heads, dim]: rows of any stride, heads and dims dense (views of the
    fused qkv output); cos, sin [T, 1, dim / 2]; kv_layer [blocks, 2, slots, kv_heads, dim], slots dense."""
    lib = _load()
    tensors = (q, k, v, cos, sin, kv_layer)
    if lib is None or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return False
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or kv_layer.dim() != 5:
        return False
    rows, heads, dim = q.shape
    num_blocks, kv_parts, block_size, kv_heads, kv_dim = kv_layer.shape
    # Every row its own memory (no broadcast views: rows are rotated in place, in parallel), K and V in
    # their halves of a block, and each cache row dense: the C side writes kv_heads x dim floats per slot.
    if (any(t.stride()[1:] != (t.shape[2], 1) or t.stride(0) < t.shape[1] * t.shape[2] for t in (q, k, v))
            or tuple(k.shape) != (rows, kv_heads, dim) or k.shape != v.shape or kv_parts != 2 or kv_dim != dim
            or kv_layer.stride()[2:] != (kv_heads * dim, dim, 1) or kv_layer.stride(1) < block_size * kv_heads * dim
            or kv_layer.stride(0) < 2 * kv_layer.stride(1) or slot_mapping.numel() != rows
            or slot_mapping.dtype not in (torch.int32, torch.int64) or cos.numel() != rows * (dim // 2)
            or sin.numel() != rows * (dim // 2) or dim % 2):
        return False
    cos, sin = cos.reshape(rows, dim // 2).contiguous(), sin.reshape(rows, dim // 2).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    return lib.pdserve_rope_write_kv(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cos.data_ptr(),
        sin.data_ptr(), kv_layer.data_ptr(), kv_layer.stride(0), kv_layer.stride(1), slots.data_ptr(), rows,
        heads, kv_heads, dim, block_size, num_blocks) == 0
