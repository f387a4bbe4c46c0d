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
