"""Host lists to device tensors without waiting for the device.

A copy from pageable host memory waits for the work already queued on the stream (cudaMemcpyAsync
stages it synchronously); from pinned memory it is queued like a kernel. The caching host allocator
keeps a pinned block until the copy that reads it has run, so a step can build and forget them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values if isinstance(values, list) else list(values), dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
