"""pdserve's CPU GEMM (model/csrc/cpu_linear.c) at a git revision against the working tree, in one process,
calls alternated: the A/B for a change to the kernel on a shared, noisy machine, where runs minutes apart
differ by 10-20 %. Both builds take cpu_kernels.FLAGS; the weights are packed once (the packed layout
must be the same in both) and several copies are cycled so that they come from memory, as in a step.

    .venv/bin/python benchmarks/cpu_gemm_ab.py [--base-rev HEAD] [--rows 1,64,256,2048] [--out F.json]
        [--base-flags=-DNAME=1] [--tree-flags=-DNAME=1]   (a compile-time switch on either side; --base-rev
        tree takes the working tree's source for both)

Prints GFLOP/s per (shape, rows): the base's and the tree's medians, and their ratio; checks that both
give the same bits.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pdserve.model import cpu_kernels

from cpu_gemm_shapes import SHAPES, WEIGHT_BYTES_PER_SHAPE


def build(source: str, tmp: Path, tag: str, flags: list[str]) -> ctypes.CDLL:
    src = tmp / f"cpu_linear_{tag}.c"
    src.write_text(source)
    (tmp / "vec8.h").write_text((cpu_kernels.CSRC / "vec8.h").read_text())
    out = tmp / f"linear_{tag}.so"
    subprocess.run(["gcc", *cpu_kernels.FLAGS, *flags, str(src), "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.pdserve_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.pdserve_linear.restype = None
    return lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-rev", default="HEAD")
    p.add_argument("--rows", default="1,64,256,2048")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--base-flags", default="")
    p.add_argument("--tree-flags", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = "pdserve/model/csrc/cpu_linear.c"
    tree_src = (cpu_kernels.CSRC / "cpu_linear.c").read_text()
    base_src = tree_src if args.base_rev == "tree" else subprocess.run(
        ["git", "show", f"{args.base_rev}:{path}"], check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build(base_src, Path(tmp), "base", args.base_flags.split()),
                "tree": build(tree_src, Path(tmp), "tree", args.tree_flags.split())}
        rows_out = []
        for name, (k, n) in SHAPES.items():
            copies = max(1, int(WEIGHT_BYTES_PER_SHAPE // (n * k * 4)))
            packed = [cpu_kernels.pack_linear(torch.randn(n, k)) for _ in range(copies)]
            for m in (int(r) for r in args.rows.split(",")):
                if name == "lm_head" and m > 64:
                    continue
                x = torch.randn(m, k)
                ys = {tag: torch.empty(m, n) for tag in libs}
                times = {tag: [] for tag in libs}
                call = 0
                for r in range(args.repeats + 2):
                    for tag in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                        w = packed[call % copies]
                        call += 1
                        start = time.perf_counter()
                        libs[tag].pdserve_linear(x.data_ptr(), k, w.data_ptr(), None, ys[tag].data_ptr(), n, m, n, k)
                        if r >= 2:
                            times[tag].append(time.perf_counter() - start)
                for tag in libs:   # the same weight for the bits check
                    libs[tag].pdserve_linear(x.data_ptr(), k, packed[0].data_ptr(), None, ys[tag].data_ptr(), n, m, n, k)
                gflops = {tag: 2 * m * k * n / statistics.median(t) / 1e9 for tag, t in times.items()}
                row = {"shape": name, "rows": m, "base": round(gflops["base"], 1), "tree": round(gflops["tree"], 1),
                       "tree_over_base": round(gflops["tree"] / gflops["base"], 3),
                       "same_bits": bool(torch.equal(ys["base"], ys["tree"]))}
                rows_out.append(row)
                print("  ".join(f"{key} {value}" for key, value in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"base_rev": args.base_rev, "base_flags": args.base_flags, "tree_flags": args.tree_flags,
                       "threads": args.threads, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
