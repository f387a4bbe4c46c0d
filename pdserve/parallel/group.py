"""The collectives a tensor-parallel model needs, over torch.distributed (gloo on CPU, NCCL on CUDA).

The model holds a TPGroup whatever its size: with one rank every collective returns its input, so
the model code has no branch for "not parallel" and a single instance never touches torch.distributed.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# A collective waits for every rank. A rank that died closes its sockets and the others fail at
# once; this bounds the rest (a rank stuck, stopped or spinning): far longer than the compute between two
# collectives (half a layer: ~9 s for a 2,048-token chunk of an 8B layer on a slow CPU), short enough that a
# hung instance ends in minutes. $PDSERVE_TP_COLLECTIVE_TIMEOUT_S sets it.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("PDSERVE_TP_COLLECTIVE_TIMEOUT_S", "120"))


class RankCallError(RuntimeError):
    """A call to ranks 1..T-1 (worker/tp_executor.py's call()) failed on some of them; `results` holds every
    rank's result (None where it failed), so that the caller can undo what the others did."""

    def __init__(self, message: str, results: list) -> None:
        super().__init__(message)
        self.results = results


class TPGroup:
    def __init__(self, rank: int = 0, size: int = 1) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"tensor parallel rank {rank} is not in [0, {size})")
        self.rank, self.size = rank, size

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and talks to the scheduler."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank 0's columns first."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value (a size all of them can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"


SINGLE = TPGroup()


def init_tp_group(rank: int, size: int, init_method: str, device: torch.device,
                  timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TPGroup:
    """Join the instance's process group (every rank calls this; it returns once all have joined,
    or raises after timeout_s)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TPGroup(rank, size)


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
