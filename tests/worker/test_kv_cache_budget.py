"""How many bytes the KV cache gets: CPU default, explicit bytes, and a GPU shared by instances.

The GPU cases fake torch.cuda's memory queries (CI has no GPU): the found bug was that an instance's
share subtracted every process's memory, so the second instance started on a GPU got nothing, and
the error named --kv-cache-memory, which CUDA ignored.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.config import CacheConfig
from pdserve.worker import kv_cache
from pdserve.worker.kv_cache import GPU_ACTIVATION_RESERVE_BYTES, allocate_kv_cache, kv_cache_budget

GIB = 1 << 30
CUDA = torch.device("cuda")


@pytest.fixture
def gpu(monkeypatch):
    """A fake 100 GiB GPU: set .free (bytes free on the device) and .own (this process's reserved bytes)."""
    class State:
        free, own = 100 * GIB, 0
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (State.free, 100 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: State.own)
    return State


def test_cpu_default_and_explicit_bytes(monkeypatch):
    monkeypatch.setattr(kv_cache, "_available_memory_bytes", lambda: 24 * GIB)
    assert kv_cache_budget(CacheConfig(), torch.device("cpu")) == kv_cache.DEFAULT_CPU_KV_CACHE_BYTES == 2 * GIB
    monkeypatch.setattr(kv_cache, "_available_memory_bytes", lambda: 4 * GIB)   # a small box: an eighth
    assert kv_cache_budget(CacheConfig(), torch.device("cpu")) == GIB // 2
    monkeypatch.setattr(kv_cache, "_available_memory_bytes", lambda: None)      # no /proc/meminfo
    assert kv_cache_budget(CacheConfig(), torch.device("cpu")) == 2 * GIB
    assert kv_cache_budget(CacheConfig(kv_cache_memory=123 << 20), torch.device("cpu")) == 123 << 20
    # tensor parallel ranks divide the CPU default (one host's memory), and each takes an explicit size whole
    assert kv_cache_budget(CacheConfig(), torch.device("cpu"), tp_size=4) == GIB // 2
    assert kv_cache_budget(CacheConfig(kv_cache_memory=123 << 20), torch.device("cpu"), tp_size=4) == 123 << 20


def test_instances_sharing_a_gpu_each_get_their_fraction(gpu):
    cache = CacheConfig(gpu_memory_utilization=0.4)
    gpu.own, gpu.free = 10 * GIB, 90 * GIB          # the first instance: its weights loaded
    first = kv_cache_budget(cache, CUDA)
    assert first == 40 * GIB - 10 * GIB - GPU_ACTIVATION_RESERVE_BYTES
    gpu.free = 90 * GIB - first - 10 * GIB           # the second: the first's cache and its own weights are in use
    assert kv_cache_budget(cache, CUDA) == first     # before, it got 40 - 46 - 4 GiB < 0


def test_never_more_than_is_free(gpu):
    gpu.own, gpu.free = 10 * GIB, 20 * GIB           # others hold most of the GPU
    assert kv_cache_budget(CacheConfig(gpu_memory_utilization=0.9), CUDA) == 20 * GIB - GPU_ACTIVATION_RESERVE_BYTES


def test_explicit_bytes_win_on_cuda(gpu):
    gpu.free = 1 * GIB
    assert kv_cache_budget(CacheConfig(kv_cache_memory=512 << 20), CUDA) == 512 << 20


def test_no_room_on_a_full_gpu_names_the_other_instances(gpu):
    gpu.own, gpu.free = 1 * GIB, 3 * GIB             # others hold 96 GiB
    with pytest.raises(ValueError, match=r"3.0 GiB free of 100.0 GiB .* lower the other instances'"):
        allocate_kv_cache(_Info(), CacheConfig(gpu_memory_utilization=0.5), torch.float32, CUDA)


def test_no_room_names_the_fraction_on_cuda(gpu):
    gpu.own, gpu.free = 2 * GIB, 50 * GIB
    cache = CacheConfig(gpu_memory_utilization=0.05)  # 5 GiB: less than weights + the activation reserve
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.05 leaves no room .* set kv_cache_memory"):
        allocate_kv_cache(_Info(), cache, torch.float32, CUDA)


class _Info:
    num_layers, num_kv_heads, head_dim = 2, 1, 4
