"""Size and allocate the paged KV cache.

One tensor for the whole model, block-major (see model/attention.py):
    kv_cache = torch.empty(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
so a request's run of consecutive blocks is one contiguous byte range: the KV handoff moves it as
one descriptor instead of one per layer per block. Under tensor parallelism each rank's cache holds its
own KV heads (num_kv_heads / T) and every rank has the same number of blocks: the scheduler's block ids
mean the same slots on all of them.
"""
from __future__ import annotations

import torch

from pdserve.config import CacheConfig
from pdserve.model.loader import ModelInfo
from pdserve.parallel.group import SINGLE, TPGroup
from pdserve.worker.cpu_memory import advise_huge_pages

# On CPU without kv_cache_memory: 2 GiB, or an eighth of the memory available at start where that is less.
# 1 GiB was too little for the default model's 64 concurrent 384-token sequences (1.13 GB of KV): the
# scheduler preempted and recomputed, and the offline run of issue 15 took 80.1 s instead of 73.3 s.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
CPU_KV_CACHE_SHARE_OF_AVAILABLE = 8
GPU_ACTIVATION_RESERVE_BYTES = 4 << 30  # activations, logits and CUDA graphs live outside the cache


def block_bytes(info: ModelInfo, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """One block's bytes on one rank."""
    elem = torch.empty((), dtype=dtype).element_size()
    return info.num_layers * 2 * block_size * (info.num_kv_heads // tp_size) * info.head_dim * elem


def kv_cache_budget(cache: CacheConfig, device: torch.device, tp_size: int = 1) -> int:
    """Bytes for one rank's KV cache: kv_cache_memory when given (CPU or CUDA); on CUDA otherwise this
    instance's share of the GPU (gpu_memory_utilization of its memory, less what this process already
    holds: the weights) and never more than is free now, so instances sharing a GPU each take their
    own fraction instead of the first one's leftovers. The CPU default is the instance's, divided among
    its tensor-parallel ranks (they share the host's memory): the same tokens as with one rank."""
    if cache.kv_cache_memory:
        return cache.kv_cache_memory
    if device.type == "cuda":
        share, free, _ = _cuda_share(cache, device)
        return min(share, free) - GPU_ACTIVATION_RESERVE_BYTES
    available = _available_memory_bytes()
    if available is None:
        return DEFAULT_CPU_KV_CACHE_BYTES // tp_size
    return min(DEFAULT_CPU_KV_CACHE_BYTES, available // CPU_KV_CACHE_SHARE_OF_AVAILABLE) // tp_size


def _available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cuda_share(cache: CacheConfig, device: torch.device) -> tuple[int, int, int]:
    """(this instance's share less what it already holds, bytes free on the GPU, the GPU's bytes)."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total * cache.gpu_memory_utilization) - torch.cuda.memory_reserved(device), free, total


def allocate_kv_cache(info: ModelInfo, cache: CacheConfig, dtype: torch.dtype,
                      device: torch.device, num_blocks: int | None = None, tp: TPGroup = SINGLE) -> torch.Tensor:
    """The cache of this rank (every rank of a TP group calls it: they agree on the number of blocks)."""
    per_block = block_bytes(info, cache.block_size, dtype, tp.size)
    if num_blocks is None:
        num_blocks = tp.min_over_ranks(kv_cache_budget(cache, device, tp.size) // per_block, device)
    if num_blocks < 1:
        if device.type == "cuda" and not cache.kv_cache_memory:
            share, free, total = _cuda_share(cache, device)
            if free < share:   # the GPU is full of other processes: this fraction is not what is short
                raise ValueError(
                    f"the GPU has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB (other processes hold "
                    f"the rest), less than the {GPU_ACTIVATION_RESERVE_BYTES / 2**30:.0f} GiB kept for "
                    f"activations plus one KV block of {per_block} bytes: lower the other instances' "
                    f"gpu_memory_utilization (the fractions of instances sharing a GPU must add up to at "
                    f"most about 0.9)")
            raise ValueError(
                f"gpu_memory_utilization {cache.gpu_memory_utilization:g} leaves no room for one KV block of "
                f"{per_block} bytes: of the GPU's {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free) this "
                f"process holds {torch.cuda.memory_reserved(device) / 2**30:.1f} GiB and "
                f"{GPU_ACTIVATION_RESERVE_BYTES / 2**30:.0f} GiB stay for activations; raise it, or set "
                f"kv_cache_memory (bytes)")
        raise ValueError(f"kv_cache_memory: too small for one block of {per_block} bytes")
    # [blocks, layers, k/v, slots, heads, dim]
    kv_cache = torch.empty(num_blocks, info.num_layers, 2, cache.block_size, info.num_kv_heads // tp.size,
                           info.head_dim, dtype=dtype, device=device)
    advise_huge_pages(kv_cache)   # before the zeros below touch its pages (CPU only)
    return kv_cache.zero_()
