"""The store's pool in shared memory, so that a client on the store's host moves KV by a copy instead of a
NIXL transfer.

Between two processes UCX moves host memory by CMA (4-6 GB/s on the 2-core CPU machine), and VRAM to
another process's host memory has no zero-copy path in UCX at all: it is emulated over TCP loopback
(2.1-2.4 GB/s on one H100, docs/benchmarks.md). A client that maps the pool copies it at memory speed
(15-17 GB/s on the CPU machine), and a CUDA client copies by DMA into the pool's pages, pinned in its own
process.

The store (`SharedPool`) allocates the pool in an anonymous memory file (memfd): nothing under /dev/shm
to leak when the store is killed, and no /dev/shm size limit. Its handshake reply names the file as
/proc/<store pid>/fd/<fd> with the host's boot id. A client (`attach`) on the same host opens that path,
which the kernel allows to the store's own user only (the same check as ptrace's read access, the access
CMA already needs), maps the file and checks the header the store wrote (a magic word and the store's
boot id) so that a reused pid or fd is never mistaken for the pool. Anything that does not work (another
host, another user, another pid namespace, a CUDA host registration that fails) leaves the client on
NIXL, which the store keeps registered for clients elsewhere.

Trust is unchanged: a client that may WRITE and READ any slot over NIXL may map them.
"""
from __future__ import annotations

import logging
import mmap
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

HEADER_BYTES = 4096   # the pool's slots start a page in, so that they stay page-aligned
MAGIC = b"pdserve-kv-store pool\n"


def host_id() -> str:
    """This host's boot id (one per kernel boot), '' where the kernel does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _header(boot_id: str) -> bytes:
    return MAGIC + boot_id.encode() + b"\n"


class SharedPool:
    """The store's side: num_bytes of slots in a memory file, touched (resident) before the first client."""

    def __init__(self, num_bytes: int, boot_id: str) -> None:
        self._fd = os.memfd_create("pdserve-kv-store", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, HEADER_BYTES + num_bytes)
            self._map = mmap.mmap(self._fd, HEADER_BYTES + num_bytes)
        except Exception:
            os.close(self._fd)
            raise
        header = _header(boot_id)
        self._map[:len(header)] = header
        self.slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=HEADER_BYTES, count=num_bytes)
        self.slots.zero_()

    def describe(self) -> dict[str, Any]:
        return {"path": f"/proc/{os.getpid()}/fd/{self._fd}", "host": host_id(),
                "bytes": HEADER_BYTES + self.slots.numel()}

    def close(self) -> None:
        self.slots = None
        try:
            self._map.close()
        except BufferError:   # a tensor view is still alive somewhere: the mapping goes with it
            pass
        os.close(self._fd)


def attach(description: Any, boot_id: str, num_slots: int, block_bytes: int,
           kv_cache: torch.Tensor) -> "MappedPool | None":
    """The store's pool mapped here, or None (with the reason logged) when this client cannot map it."""
    if not isinstance(description, dict) or not description.get("host") or description["host"] != host_id():
        return None   # no shared memory offered, or another host
    size = HEADER_BYTES + num_slots * block_bytes
    try:
        if not isinstance(description.get("path"), str) or description.get("bytes") != size:
            raise ValueError(f"a pool of {description.get('bytes')} bytes, expected {size}")
        fd = os.open(description["path"], os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"the file has {os.fstat(fd).st_size} bytes, expected {size}")
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        header = _header(boot_id)
        if mapping[:len(header)] != header:
            mapping.close()
            raise ValueError("the file is not this store's pool (its header names another store)")
        return MappedPool(mapping, num_slots, block_bytes, kv_cache)
    except Exception as e:
        logger.info("KV store: its pool is not mapped here, KV moves over NIXL: %s: %s", type(e).__name__, e)
        return None


class CopyHandle:
    """One load or insert done by copies: done at once on CPU, at its CUDA event on a GPU."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self._event = event

    def state(self) -> str:
        return "DONE" if self._event is None or self._event.query() else "PROC"

    def release(self) -> None:
        # A DMA cannot be aborted; it ends within milliseconds, and the blocks it touches must not be
        # reused before it has.
        if self._event is not None:
            self._event.synchronize()


class MappedPool:
    """The client's side: the pool's slots as a [num_slots, block_bytes] tensor beside this instance's KV
    cache as [num_blocks, block_bytes]; a transfer is one copy per run of blocks."""

    def __init__(self, mapping: mmap.mmap, num_slots: int, block_bytes: int, kv_cache: torch.Tensor) -> None:
        self._map = mapping
        self._slots = torch.frombuffer(mapping, dtype=torch.uint8, offset=HEADER_BYTES,
                                       count=num_slots * block_bytes).view(num_slots, block_bytes)
        self._blocks = kv_cache.view(-1).view(torch.uint8).view(kv_cache.shape[0], block_bytes)
        self._stream = self._registered = None
        if kv_cache.is_cuda:
            # Pinned for the GPU, DMA runs at the link's speed; pageable copies are staged by the driver.
            err = torch.cuda.cudart().cudaHostRegister(self._slots.data_ptr(), self._slots.numel(), 1)  # portable
            if int(err) != 0:
                self.close()
                raise RuntimeError(f"cudaHostRegister of the pool failed: {err}")
            self._registered = self._slots.data_ptr()
            self._stream = torch.cuda.Stream(device=kv_cache.device)

    def copy(self, op: str, runs: list[tuple[int, int, int]]) -> CopyHandle:
        """READ: slots → local blocks; WRITE: local blocks → slots. runs: (local start, slot start, blocks)."""
        if op not in ("READ", "WRITE"):
            raise ValueError(f"op: READ or WRITE, got {op!r}")
        if self._stream is None:
            self._copy_runs(op, runs)
            return CopyHandle(None)
        # The KV the engine wrote (an insert) was written on its own stream; a load's blocks are not read
        # before the handle says DONE.
        self._stream.wait_stream(torch.cuda.current_stream(self._blocks.device))
        with torch.cuda.stream(self._stream):
            self._copy_runs(op, runs)
            event = torch.cuda.Event()
            event.record(self._stream)
        return CopyHandle(event)

    def _copy_runs(self, op: str, runs: list[tuple[int, int, int]]) -> None:
        non_blocking = self._stream is not None
        for local, slot, n in runs:
            blocks, slots = self._blocks[local:local + n], self._slots[slot:slot + n]
            if op == "READ":
                blocks.copy_(slots, non_blocking=non_blocking)
            else:
                slots.copy_(blocks, non_blocking=non_blocking)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        self._slots = self._blocks = None
        try:
            self._map.close()
        except BufferError:
            pass
