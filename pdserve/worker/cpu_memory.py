"""Keep freed memory in the process on CPU, so that a step's large tensors do not fault their pages in again.

glibc's malloc serves blocks above its mmap threshold (dynamic, 128 KiB to 32 MiB) with a fresh mmap and
unmaps them on free, and returns the top of its heap to the kernel past a trim threshold. A prefill step
of 2,048 tokens allocates and frees activations of up to 25 MB thirty times over, so every step paid for
its pages again: measured on the 2-core AMD machine, 368,000 minor page faults and 1.1-2.8 s of system
time in a 4.8-5.0 s step of the default model, against none and 3.9 s with the thresholds fixed high
(docs/benchmarks.md, issue 15). tcmalloc (vLLM-CPU's recipe) does the same by caching, but must be
preloaded before the process starts; `mallopt` takes effect in a running process, so it works for
`LLM()` in a user's script as well as for `pdserve serve`.

The cost: memory freed after a peak stays with the process (its resident size stays near the peak that
the step reached anyway). PDSERVE_CPU_KEEP_FREED_MEMORY=0 leaves malloc's defaults.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("PDSERVE_CPU_KEEP_FREED_MEMORY", "1") != "0"
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2, 32 MiB on 64-bit: larger blocks are always
# mapped. Their compute dwarfs their page faults (a 32 MB activation is a matmul of billions of FLOPs).
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = (1 << 31) - 1   # the largest int: never trim

_done = False


def keep_freed_memory() -> bool:
    """Fix glibc's thresholds high, once per process. False where malloc is not glibc's (musl, a
    preloaded tcmalloc or jemalloc: mallopt is then absent or ignored) or it is switched off."""
    global _done
    if _done or not ENABLED:
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        logger.info("malloc's thresholds not set (mallopt refused them): freed memory may fault in again")
        return False
    _done = True
    logger.info("CPU memory: freed blocks kept in the process (mmap threshold %d MiB, no trim)",
                MMAP_THRESHOLD >> 20)
    return True


MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20
HUGE_PAGES_ENABLED = os.environ.get("PDSERVE_CPU_HUGE_PAGES", "1") != "0"


def advise_huge_pages(tensor) -> bool:
    """Ask the kernel to back a large CPU tensor with 2 MiB pages, before its pages are first touched.

    Why: the KV cache is read block by block, and a sequence's blocks lie anywhere in a cache of
    gigabytes, so on 4 KiB pages nearly every block's read starts with a TLB miss and a page walk. On
    transparent huge pages a walk covers 2 MiB. Measured on the 2-core AVX-512 Xeon: one decode step's
    attention over 64 sequences of 320 tokens, 81.8 against 76.0 ms with the prefetching kernel
    (benchmarks/cpu_attention_kernel.py, docs/benchmarks.md). Machines whose transparent huge pages are
    "madvise" (the common default) give them only to ranges advised so; "never" ignores the advice.
    False where the advice was not taken (too small, no libc madvise, refused, or switched off with
    PDSERVE_CPU_HUGE_PAGES=0)."""
    if not HUGE_PAGES_ENABLED or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    length = (end - aligned) // HUGE_PAGE * HUGE_PAGE
    if length <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    if madvise(aligned, length, MADV_HUGEPAGE) != 0:
        logger.info("huge pages not advised for %d MiB (errno %d)", length >> 20, ctypes.get_errno())
        return False
    return True
