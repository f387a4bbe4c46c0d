"""The CPU's float32 FMA peak: the ceiling every GEMM figure in docs/benchmarks.md is read against. Each
OpenMP thread runs 24 independent chains of vector FMAs (AVX-512 where the CPU has it, else AVX2) with no
loads, built with the flags of pdserve's own kernels (model/cpu_kernels.py), for one thread and for every
allowed core.

    .venv/bin/python benchmarks/cpu_fma_peak.py [--seconds 2] [--out F.json]

A GEMM cannot beat this figure; the default model's prefill (54.4 GFLOP of linear layers per 256-token
prompt) cannot take less than 54.4 / peak seconds in its linear layers.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import tempfile
from pathlib import Path

from pdserve.model import cpu_kernels

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#if defined(__AVX512F__)
typedef __m512 vf;
#define LANES 16
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SET1(x) _mm512_set1_ps(x)
#define ADD(a, b) _mm512_add_ps(a, b)
#else
typedef __m256 vf;
#define LANES 8
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SET1(x) _mm256_set1_ps(x)
#define ADD(a, b) _mm256_add_ps(a, b)
#endif
#define R(i) vf a##i = SET1((float)(i));
#define F(i) a##i = FMA(a##i, b, c);
#define S(i) s = ADD(s, a##i);
#define ALL(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) \
               X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
int lanes(void) { return LANES; }
/* 24 chains x iters FMAs on each of `threads` threads; returns the seconds taken (sink keeps the work) */
double run(long iters, int threads, float *sink) {
    double start = omp_get_wtime();
    float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const vf b = SET1(1.0000001f), c = SET1(1e-9f);
        ALL(R)
        for (long it = 0; it < iters; it++) {
            ALL(F)
            __asm__ volatile("" ::: "memory");
        }
        vf s = SET1(0.0f);
        ALL(S)
        float out[LANES];
        __builtin_memcpy(out, &s, sizeof out);
        total += out[0];
    }
    *sink = total;
    return omp_get_wtime() - start;
}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=2.0, help="about this long per thread count")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, lib_path = Path(tmp) / "fma_peak.c", Path(tmp) / "fma_peak.so"
        src.write_text(SOURCE)
        subprocess.run(["gcc", *cpu_kernels.FLAGS, str(src), "-o", str(lib_path)], check=True)
        lib = ctypes.CDLL(str(lib_path))
    lib.run.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.POINTER(ctypes.c_float)]
    lib.run.restype = ctypes.c_double
    lanes = lib.lanes()
    sink = ctypes.c_float()
    cores = len(os.sched_getaffinity(0))
    rows = []
    for threads in sorted({1, cores}):
        iters = 1_000_000
        while (seconds := lib.run(iters, threads, ctypes.byref(sink))) < args.seconds / 4:
            iters *= 4
        seconds = min(lib.run(iters, threads, ctypes.byref(sink)) for _ in range(3))
        gflops = threads * iters * 24 * lanes * 2 / seconds / 1e9
        rows.append({"threads": threads, "gflops": round(gflops, 1), "per_core": round(gflops / threads, 1)})
        print(f"{threads} thread(s): {gflops:.1f} GFLOP/s float32 FMA peak ({gflops / threads:.1f} per core, "
              f"{lanes}-lane vectors)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"lanes": lanes, "cores": cores, "flags": cpu_kernels.FLAGS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
