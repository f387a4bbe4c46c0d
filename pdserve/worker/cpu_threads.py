"""How many torch threads an engine should use on CPU.

More threads are not always faster. On this project's 2-core machines a [64x576]x[576x3072] matmul
ran at 87 GFLOP/s on 1 thread and 156 on 2 when the machine was quiet (docs/benchmarks.md), but slower
on 2 than on 1 while other processes shared the cores (OpenMP threads wait for a descheduled peer). So unless
told, the engine times a small matmul at 1 thread and at every allowed core, and keeps the faster.
"""
from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)


def _matmul_seconds(num_threads: int, repeats: int = 8) -> float:
    torch.set_num_threads(num_threads)
    a, b = torch.randn(128, 576), torch.randn(576, 1536)
    a @ b  # warm-up: thread pool start, allocations
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


def choose_num_threads() -> int:
    cores = len(os.sched_getaffinity(0))
    if cores <= 1:
        return 1
    one, many = _matmul_seconds(1), _matmul_seconds(cores)
    choice = cores if many < one * 0.8 else 1  # threads must pay for themselves clearly
    logger.info("CPU threads: %d (matmul %.2f ms on 1 thread, %.2f ms on %d)", choice, one * 1e3,
                many * 1e3, cores)
    torch.set_num_threads(choice)
    return choice
