"""The store's pool in shared memory, so that a client on the store's host moves KV by a copy instead of a
NIXL transfer.

Between two processes UCX moves host memory by CMA (4-6 GB/s on the 2-core CPU machine), and VRAM to
another process's host memory has no zero-copy path in UCX at all: it is emulated over TCP loopback
(2.1-2.4 GB/s on one H100, docs/benchmarks.md). A client that maps the pool copies it at memory speed
(a store handoff's two copies at 13-19 GB/s against 4-8 over NIXL on the CPU machine, docs/benchmarks.md),
and a CUDA client copies by DMA into the pool's pages, pinned in its own process.

The store (`SharedPool`) allocates the pool in an anonymous memory file (memfd): nothing under /dev/shm
to leak when the store is killed, and no /dev/shm size limit. The file is sealed against shrinking and
growing, so no opener can truncate it under a mapping (every access past the end would be a SIGBUS). Its
handshake reply names it as /proc/<store pid>/fd/<fd> with the host's boot id. A client (`attach`) on
the same host checks, before anything touches the file, that the path is such a link, that it names a
memfd of the store's name, and that the file carries the seals; the kernel lets only the store's own user
open it (the same check as ptrace's read access, the access CMA already needs). The client then reads the
header the store wrote (a magic word and the store's boot id, which only a client that handshook knows),
so that a reused pid or fd is never taken for the pool, and maps the file. Anything that does not work
(another host, another user, another pid namespace, a CUDA host registration that fails) leaves the client
on NIXL, which the store keeps registered for clients elsewhere.

A client holds the pool's pages for as long as it maps them, store dead or not: `MappedPool.is_current`
(the path still names the inode mapped) tells the worker half when the store has gone, so that it lets
the old pool go instead of doubling the host's memory when the store comes back.

Trust is unchanged: a client that may WRITE and READ any slot over NIXL may map them.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import stat
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

HEADER_BYTES = 4096   # the pool's slots start a page in, so that they stay page-aligned
MAGIC = b"pdserve-kv-store pool\n"
MEMFD_NAME = "pdserve-kv-store"
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_PROC_FD = re.compile(r"^/proc/[0-9]+/fd/[0-9]+$")


def host_id() -> str:
    """This host's boot id (one per kernel boot), '' where the kernel does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _header(boot_id: str) -> bytes:
    return MAGIC + boot_id.encode() + b"\n"


def _bytes_view(mapping: mmap.mmap, offset: int, count: int) -> torch.Tensor:
    """A uint8 tensor over mapping[offset:offset + count]. Through numpy, whose view holds the mapping's
    buffer export: mmap.close() then refuses (BufferError) while a view lives, instead of unmapping
    pages a tensor still points at."""
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8, count=count, offset=offset))


class SharedPool:
    """The store's side: num_bytes of slots in a memory file, touched (resident) before the first client."""

    def __init__(self, num_bytes: int, boot_id: str) -> None:
        self._fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, HEADER_BYTES + num_bytes)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, SEALS)
            self._map = mmap.mmap(self._fd, HEADER_BYTES + num_bytes)
        except Exception:
            os.close(self._fd)
            raise
        header = _header(boot_id)
        self._map[:len(header)] = header
        self.slots = _bytes_view(self._map, HEADER_BYTES, num_bytes)
        self.slots.zero_()

    def describe(self) -> dict[str, Any]:
        return {"path": f"/proc/{os.getpid()}/fd/{self._fd}", "host": host_id(),
                "bytes": HEADER_BYTES + self.slots.numel()}

    def close(self) -> None:
        self.slots = None
        try:
            self._map.close()
        except BufferError:   # a view still lives (a NIXL registration's tensor): unmapped when it goes
            pass
        os.close(self._fd)


def attach(description: Any, boot_id: str, num_slots: int, block_bytes: int,
           kv_cache: torch.Tensor, part: tuple[int, int] = (0, 1)) -> "MappedPool | None":
    """The store's pool mapped here, or None (with the reason logged) when this client cannot map it.
    part: (rank, ranks) of a tensor-parallel client, whose cache holds that share of each slot's heads."""
    if not isinstance(description, dict) or not description.get("host") or description["host"] != host_id():
        return None   # no shared memory offered, or another host
    size = HEADER_BYTES + num_slots * block_bytes
    try:
        path = description.get("path")
        if not isinstance(path, str) or not _PROC_FD.match(path):
            raise ValueError(f"{path!r} is not a /proc/<pid>/fd/<fd> link")
        if os.readlink(path) != f"/memfd:{MEMFD_NAME} (deleted)":   # before anything opens what it names
            raise ValueError(f"{path} is not the store's memory file")
        if description.get("bytes") != size:
            raise ValueError(f"a pool of {description.get('bytes')} bytes, expected {size}")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                raise ValueError(f"the file has {info.st_size} bytes, expected {size}")
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:   # (EINVAL: not a memfd at all)
                raise ValueError("the file is not sealed against resizing")
            header = _header(boot_id)
            if os.pread(fd, len(header), 0) != header:
                raise ValueError("the file is not this store's pool (its header names another store)")
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        return MappedPool(mapping, path, (info.st_dev, info.st_ino), num_slots, block_bytes, kv_cache, part)
    except Exception as e:
        logger.warning("KV store: its pool on this host is not mapped here, KV moves over NIXL (slower): "
                       "%s: %s", type(e).__name__, e)
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
    cache as [num_blocks, block_bytes]; a transfer is one copy per run of blocks.

    A rank of a tensor-parallel client (part (r, T)) holds heads r*H/T .. (r+1)*H/T of every slot, which are
    strided in the pool's whole-model layout ([layers, 2, slots, heads, dim] per block): its copies go
    between its blocks seen as [blocks, layers * 2 * slots, its heads' bytes] and that column of the slots."""

    def __init__(self, mapping: mmap.mmap, path: str, inode: tuple[int, int], num_slots: int, block_bytes: int,
                 kv_cache: torch.Tensor, part: tuple[int, int] = (0, 1)) -> None:
        self._map, self._path, self._inode = mapping, path, inode
        self._slots = _bytes_view(mapping, HEADER_BYTES, num_slots * block_bytes).view(num_slots, block_bytes)
        self._stream = self._registered = None
        self._pinned = self._slots
        index, count = part
        if count == 1:
            self._blocks = kv_cache.view(-1).view(torch.uint8).view(kv_cache.shape[0], block_bytes)
        else:
            outer = kv_cache.shape[1] * kv_cache.shape[2] * kv_cache.shape[3]
            rank_bytes = kv_cache[0].numel() * kv_cache.element_size()
            if rank_bytes * count != block_bytes or not 0 <= index < count:
                raise ValueError(f"a slot of {block_bytes} bytes does not hold {count} parts of {rank_bytes} bytes")
            self._blocks = kv_cache.view(-1).view(torch.uint8).view(kv_cache.shape[0], outer, rank_bytes // outer)
            self._slots = self._slots.view(num_slots, outer, count, rank_bytes // outer)[:, :, index]
        if kv_cache.is_cuda and count == 1:
            # Pinned for the GPU, DMA runs at the link's speed; pageable copies are staged by the driver. (A
            # rank's part is strided: its copies go through a pageable temporary, which a pin would not help.)
            # (On this thread too the cache's device, not a context on GPU 0.)
            with torch.cuda.device(kv_cache.device):
                err = torch.cuda.cudart().cudaHostRegister(self._pinned.data_ptr(), self._pinned.numel(), 1)
                if int(err) != 0:   # (1: portable, pinned for every GPU)
                    self.close()
                    raise RuntimeError(f"cudaHostRegister of the pool failed: {err}")
                self._registered = self._pinned.data_ptr()
                self._stream = torch.cuda.Stream(device=kv_cache.device)

    def is_current(self) -> bool:
        """The store still holds the file this maps (it died, or restarted, otherwise)."""
        try:
            info = os.stat(self._path)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self._inode

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
        non_blocking = self._stream is not None   # (only a whole slot's copy: a rank's part has no stream)
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
        self._slots = self._blocks = self._pinned = None
        try:
            self._map.close()
        except BufferError:   # a view still lives: the pages go when it does, never under it
            pass
