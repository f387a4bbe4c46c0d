"""How many torch threads an engine uses on CPU: one per core the process may run on.

Decided from the cores, not timed: an earlier start-up probe (a small matmul at 1 thread and at every
allowed core, keeping the faster) chose 1 thread on an idle 2-core machine often enough to cost 22 % of
serving throughput (issue 15), and a default that depends on a millisecond timing race is not a default.
Where several engines share fewer cores than their threads (`pdserve up` with more instances than
cores), the launcher divides the cores among them (cluster.threads_per_instance), because OpenMP
threads that outnumber cores wait on descheduled peers. `--num-threads` overrides both.
"""
from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def allowed_cores() -> int:
    return len(os.sched_getaffinity(0))


def set_num_threads(num_threads: int | None, why: str | None = None) -> int:
    """torch's intra-op threads: `num_threads`, or one per allowed core; `why` names the choice in the log."""
    chosen = num_threads or allowed_cores()
    if chosen > allowed_cores():
        # OpenMP threads past the cores wait on descheduled peers at every barrier: several times slower.
        logger.warning("CPU threads: %d asked for, but this process may run on %d cores; each step will "
                       "wait on descheduled threads (leave --num-threads out for one per core)",
                       chosen, allowed_cores())
    torch.set_num_threads(chosen)
    logger.info("CPU threads: %d (%s; %d cores allowed)", chosen,
                why or ("--num-threads" if num_threads else "one per core"), allowed_cores())
    return chosen

