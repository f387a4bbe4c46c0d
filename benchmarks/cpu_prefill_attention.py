"""One layer's prefill attention on CPU, the default model's heads (9 query, 3 KV, head size 64): the C
kernel (model/csrc/cpu_prefill_attention.c) against the plain-torch path it replaced (index_select
gathers + SDPA) and, with --baseline-rev, against the kernel of another git revision, calls alternated,
one prompt of each length, no cached prefix. Both kernels are built here into libraries of their own
with the engine's flags plus --cflags (`--cflags=-mno-avx512f` measures the AVX2 build on an AVX-512
machine). The two kernels' outputs are compared too: `same_bits` says whether a change kept every bit.

    .venv/bin/python benchmarks/cpu_prefill_attention.py [--lengths 64,256,1024,2048] [--baseline-rev REV]
        [--cflags=-mno-avx512f] [--threads 2] [--out F.json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pdserve.model import cpu_kernels
from pdserve.model.attention import AttentionMetadata, paged_attention, paged_attention_reference

REPO = Path(__file__).resolve().parent.parent


def build_kernel(rev: str | None, workdir: Path, cflags: list[str]):
    """pdserve_prefill_attention as revision `rev` (None: this working tree) wrote it, in a library of its own."""
    workdir.mkdir()
    for name in ("cpu_prefill_attention.c", "vec8.h"):
        if rev is None:
            src = (cpu_kernels.CSRC / name).read_text()
        else:
            src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:pdserve/model/csrc/{name}"], check=True,
                                 capture_output=True, text=True).stdout
        (workdir / name).write_text(src)
    lib_path = workdir / "kernel.so"
    compiler = os.environ.get("CC") or "gcc"
    source = workdir / "cpu_prefill_attention.c"
    subprocess.run([compiler, *cpu_kernels.FLAGS, *cflags, str(source), "-o", str(lib_path), "-lm"], check=True,
                   capture_output=True, timeout=120)
    fn = ctypes.CDLL(str(lib_path)).pdserve_prefill_attention
    fn.restype = ctypes.c_int
    fn.argtypes = cpu_kernels._library().pdserve_prefill_attention.argtypes
    return fn


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every bit the same (torch.equal takes -0 for +0)."""
    return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


def call(fn, q, kv, table, starts, lens, scale, out):
    """One call of a pdserve_prefill_attention (this tree's or the baseline's) on a single sequence."""
    num_blocks, _, block_size, kv_heads, dim = kv.shape
    if fn(q.data_ptr(), q.stride(0), kv.data_ptr(), table.data_ptr(), starts.data_ptr(), lens.data_ptr(),
          out.data_ptr(), 1, table.shape[1], num_blocks, kv.stride(0), kv.stride(1), block_size, q.shape[1],
          kv_heads, dim, scale) != 0:
        raise RuntimeError("the kernel refused the call")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="64,256,1024,2048")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--baseline-rev", default=None, help="a git revision whose kernel runs beside this tree's")
    p.add_argument("--cflags", default="", help="compiler flags added to both builds, e.g. -mno-avx512f")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    scale = dim ** -0.5
    workdir = tempfile.TemporaryDirectory()
    cflags = args.cflags.split()
    kernel = build_kernel(None, Path(workdir.name) / "tree", cflags)
    baseline = build_kernel(args.baseline_rev, Path(workdir.name) / "baseline", cflags) if args.baseline_rev else None
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        blocks = -(-length // block_size)
        kv = torch.randn(blocks, 2, block_size, kv_heads, dim)
        table = torch.randperm(blocks).to(torch.int32)[None]
        q = torch.randn(length, (heads + 2 * kv_heads) * dim)[:, :heads * dim].view(length, heads, dim)
        md = AttentionMetadata(torch.tensor([0, length], dtype=torch.int32), torch.tensor([length], dtype=torch.int32),
                               table, torch.zeros(length, dtype=torch.long), [length], [length], block_size)
        starts, lens = torch.tensor([0, length], dtype=torch.int32), torch.tensor([length], dtype=torch.int32)
        out_kernel, out_baseline = torch.empty(q.shape), torch.empty(q.shape)
        ways = {"kernel": lambda: call(kernel, q, kv, table, starts, lens, scale, out_kernel),
                "torch": lambda: paged_attention_reference(q, kv, md, scale)}
        if baseline is not None:
            ways["baseline"] = lambda: call(baseline, q, kv, table, starts, lens, scale, out_baseline)
        times = {name: [] for name in ways}
        for r in range(args.repeats + 2):
            for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                start = time.perf_counter()
                ways[name]()
                if r >= 2:
                    times[name].append(time.perf_counter() - start)
        if not cflags and not same_bits(out_kernel, paged_attention(q, kv, md, scale)):
            raise RuntimeError("the library built here and the engine's disagree")
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        flop = 4 * heads * dim * length * (length + 1) / 2   # QK^T and PV over the causal half
        row = {"length": length, "kernel_ms": round(ms["kernel"], 3), "torch_ms": round(ms["torch"], 3),
               "speedup_vs_torch": round(ms["torch"] / ms["kernel"], 2),
               "kernel_gflops": round(flop / ms["kernel"] / 1e6, 1)}
        if baseline is not None:
            row.update(baseline_ms=round(ms["baseline"], 3),
                       speedup_vs_baseline=round(ms["baseline"] / ms["kernel"], 3),
                       same_bits=same_bits(out_kernel, out_baseline))
        rows.append(row)
        print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    workdir.cleanup()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
                       "baseline_rev": args.baseline_rev, "cflags": args.cflags,
                       "avx512f": "avx512f" in cpu_kernels.cpu_flags(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
