"""The worker half of the pull handoff over CUDA IPC: D maps P's KV cache once and copies from it.

For P and D on GPUs of one host (NVLink, or one GPU shared by two processes), where NIXL/UCX may
fall back to TCP. The scheduler half is PullConnectorScheduler (pull.py); leases, handshakes,
claims, heartbeats, deadlines, cancels and failures are lifecycle.py's, reached through
PullConnectorWorker (pull_worker_common.py). This module fills its transport hooks:

  register: P (a producer) exports its KV cache's memory once: a CUDA IPC handle
            (untyped_storage()._share_cuda_(), as torch.multiprocessing does) plus the GPU's UUID;
            for a CPU cache, POSIX shared memory (the storage moves into a shared file in place,
            at start-up, before anything else holds its address)
  connect:  D opens the handle once per P (engine thread) and keeps a uint8 view
            [num_blocks, block_bytes] of P's cache, mapped on (extra "cuda_ipc_map_on"):
              "local" (default): D's own GPU (cudaIpcOpenMemHandle maps peer memory into the
                       current device's context and enables peer access): a copy is a same-device
                       memcpy, with none of the events a cross-device copy_ adds per call
              "owner": P's GPU, found by UUID among D's devices (D's own GPU when
                       CUDA_VISIBLE_DEVICES hides it); a copy is then a cross-device copy_
  post:     one copy per coalesced run on a dedicated stream, then one CUDA event; the stream
            first waits for D's current stream, so blocks freed by a step still in flight are
            not overwritten under it. Copies are cudaMemcpyAsync calls into the CUDA runtime torch
            already loaded (extra "cuda_ipc_copy": "cudart", the default: ~2 µs a run) or
            tensor.copy_ ("torch": ~10 µs a run of dispatch, stream contexts and, across devices,
            two events per call); "cudart" falls back to "torch" where no runtime is found
  check:    event.query(), polled from get_finished; never blocks
  done:     D tells P, batched per P per step, with a datagram on a Unix socket (abstract
            namespace) that P's engine thread drains in get_finished: no thread and no GIL hand-off
            between a finished copy and P's finished_sending (a busy engine thread holds the GIL
            for 5 ms switch intervals: a notice through the side-channel threads took milliseconds).
            The datagram failing (another network namespace, P's queue full) → "done" over the
            side channel, which is slower but reliable

P and D in one process (tests, a "both" engine) cannot open their own IPC handle: D then uses P's
tensor directly, found in a per-process table by engine id.
"""
from __future__ import annotations

import base64
import ctypes
import json
import logging
import os
import socket
import uuid
from typing import Any

import torch

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.pull_worker_common import Load, Peer, PullConnectorWorker, RemoteEngine

logger = logging.getLogger(__name__)

MAP_ON_CHOICES = ("owner", "local")
COPY_CHOICES = ("cudart", "torch")
_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
# engine id → KV cache of the workers of this process (the one-process case has no IPC)
_LOCAL_KV_CACHES: dict[str, torch.Tensor] = {}


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def _device_uuid(index: int) -> str | None:
    device_uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if device_uuid is None else str(device_uuid)


def _local_device_index(device_uuid: str | None, fallback: int) -> int:
    """This process's index of the GPU with this UUID; `fallback` when it is not visible here."""
    for index in range(torch.cuda.device_count()):
        if device_uuid is not None and _device_uuid(index) == device_uuid:
            return index
    return fallback


def _cuda_memcpy_async():
    """cudaMemcpyAsync of the CUDA runtime this process already loaded (torch's), or None."""
    version = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{version}", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only one already loaded
        except OSError:
            continue
        memcpy = lib.cudaMemcpyAsync
        memcpy.restype = ctypes.c_int
        memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        return memcpy
    return None


def export_kv_cache(kv_cache: torch.Tensor) -> dict[str, Any]:
    """What another process needs to map kv_cache (JSON-safe). May move a CPU cache into shared memory."""
    storage = kv_cache.untyped_storage()
    offset_bytes = kv_cache.storage_offset() * kv_cache.element_size()
    num_bytes = kv_cache.numel() * kv_cache.element_size()
    if kv_cache.is_cuda:
        (device, handle, size_bytes, storage_offset_bytes, ref_counter_handle, ref_counter_offset,
         event_handle, event_sync_required) = storage._share_cuda_()
        return {"kind": "cuda", "device_uuid": _device_uuid(device), "handle": _b64(handle),
                "storage_size_bytes": size_bytes, "storage_offset_bytes": storage_offset_bytes,
                "ref_counter_handle": _b64(ref_counter_handle), "ref_counter_offset": ref_counter_offset,
                "event_handle": _b64(event_handle), "event_sync_required": bool(event_sync_required),
                "offset_bytes": offset_bytes, "num_bytes": num_bytes}
    manager_handle, filename, size_bytes = storage._share_filename_cpu_()  # moves it into shm in place
    return {"kind": "shm", "manager_handle": _b64(manager_handle), "filename": _b64(filename),
            "storage_size_bytes": size_bytes, "offset_bytes": offset_bytes, "num_bytes": num_bytes}


def import_kv_cache(ipc: dict[str, Any], local_device: torch.device, map_on: str = "owner") -> torch.Tensor:
    """P's cache, mapped into this process, as a flat uint8 tensor (export_kv_cache's inverse).
    map_on: "owner" maps it on P's GPU when this process sees it, "local" on local_device."""
    if ipc["kind"] == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("remote KV cache is in GPU memory, and this process sees no GPU")
        torch.cuda.init()
        local = local_device.index if local_device.type == "cuda" else torch.cuda.current_device()
        index = local if map_on == "local" else _local_device_index(ipc["device_uuid"], local or 0)
        storage = torch.UntypedStorage._new_shared_cuda(
            index, _unb64(ipc["handle"]), ipc["storage_size_bytes"], ipc["storage_offset_bytes"],
            _unb64(ipc["ref_counter_handle"]), ipc["ref_counter_offset"], _unb64(ipc["event_handle"]),
            ipc["event_sync_required"])
    elif ipc["kind"] == "shm":
        storage = torch.UntypedStorage._new_shared_filename_cpu(
            _unb64(ipc["manager_handle"]), _unb64(ipc["filename"]), ipc["storage_size_bytes"])
    else:
        raise RuntimeError(f"unknown KV cache export kind {ipc['kind']!r}")
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return flat.set_(storage, ipc["offset_bytes"], (ipc["num_bytes"],), (1,))


class CudaIpcConnectorWorker(PullConnectorWorker):
    notifies_done = True  # a copy has no transport-level notification: D tells P (_send_done)

    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, str | int]) -> None:
        self._map_on = config.extra.get("cuda_ipc_map_on", "local")
        if self._map_on not in MAP_ON_CHOICES:
            raise ValueError(f"cuda_ipc_map_on: expected one of {MAP_ON_CHOICES}, got {self._map_on!r}")
        copy = config.extra.get("cuda_ipc_copy", "cudart")
        if copy not in COPY_CHOICES:
            raise ValueError(f"cuda_ipc_copy: expected one of {COPY_CHOICES}, got {copy!r}")
        self._memcpy = _cuda_memcpy_async() if copy == "cudart" and torch.cuda.is_available() else None
        self.copy_path = "cudart" if self._memcpy is not None else "torch"  # reported by benchmarks/gpu_handoff.py
        if copy == "cudart" and self._memcpy is None and torch.cuda.is_available():
            logger.warning("cuda_ipc: no loaded CUDA runtime found; copies go through tensor.copy_")
        super().__init__(config, engine_id, compat)
        self._local_bytes: torch.Tensor | None = None  # [num_blocks, block_bytes] view of our cache
        self._streams: dict[int, torch.cuda.Stream] = {}  # device index → copy stream
        # P: done notices arrive here; D: sends them from here. Both non-blocking, engine thread only.
        self._notify_name: str | None = f"pdserve-kv-{engine_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._notify_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify_sock.setblocking(False)
        try:
            self._notify_sock.bind("\0" + self._notify_name)  # abstract namespace: no file to clean up
        except OSError as e:  # not Linux: notices go over the side channel
            logger.info("cuda_ipc: no datagram notices (%s); using the side channel", e)
            self._notify_name = None

    # ---- hooks --------------------------------------------------------------------------------

    def _register(self, kv_cache: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        # Only a producer's cache is read by others. An export is never taken back: torch keeps an
        # exported block out of reuse after it is freed, and warns at exit if no reader released it.
        ipc = export_kv_cache(kv_cache) if self.config.is_producer else None
        self._local_bytes = kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)  # [blocks, block_bytes]
        _LOCAL_KV_CACHES[self.engine_id] = kv_cache
        return {"ipc": ipc, "pid": os.getpid(), "notify_name": self._notify_name}, b""

    def _connect(self, remote: RemoteEngine) -> None:
        if remote.reply.get("pid") == os.getpid():
            kv_cache = _LOCAL_KV_CACHES.get(remote.engine_id)
            if kv_cache is None:
                raise RuntimeError(f"remote engine {remote.engine_id} shares this process but its KV "
                                   "cache is gone")
            flat = kv_cache.view(torch.uint8).view(-1)
        elif remote.reply.get("ipc") is None:
            raise RuntimeError(f"remote engine {remote.engine_id} exports no KV cache (not a producer)")
        else:
            try:
                flat = import_kv_cache(remote.reply["ipc"], self._local_bytes.device, self._map_on)
            except Exception as e:
                raise RuntimeError(f"cannot map the KV cache of remote engine {remote.engine_id}: "
                                   f"{type(e).__name__}: {e}") from None
        remote.conn = flat.view(remote.region.num_blocks, remote.region.block_bytes)  # [blocks, block_bytes]

    def _post(self, load: Load, remote: RemoteEngine, runs: list[tuple[int, int, int]]) -> tuple[Any, str]:
        src, dst = remote.conn, self._local_bytes
        if not (src.is_cuda or dst.is_cuda):  # DRAM → DRAM: a plain synchronous copy
            for local_id, remote_id, num_blocks in runs:
                dst[local_id:local_id + num_blocks].copy_(src[remote_id:remote_id + num_blocks])
            return None, "DONE"
        if self._memcpy is not None and src.device == dst.device:
            return self._post_cudart(src, dst, runs), "PROC"
        # A cross-device copy_ runs on the source device's current stream, with a barrier against
        # the destination device's current stream: make both ours, so the engine's stream never
        # waits for a handoff (and the handoff waits only for what D had queued before it).
        devices = list(dict.fromkeys(t.device for t in (src, dst) if t.is_cuda))  # one per device
        streams = [self._stream(d) for d in devices]
        for device, stream in zip(devices, streams):
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(streams[0]), torch.cuda.stream(streams[-1]):
            for local_id, remote_id, num_blocks in runs:
                dst[local_id:local_id + num_blocks].copy_(src[remote_id:remote_id + num_blocks],
                                                          non_blocking=True)
            if len(streams) > 1:  # whichever stream torch copied on, the last one now waits for it
                streams[-1].wait_stream(streams[0])
            event = torch.cuda.Event()
            event.record(streams[-1])
        return event, "PROC"

    def _post_cudart(self, src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]]
                     ) -> torch.cuda.Event:
        """One cudaMemcpyAsync per run on our stream (src and dst on one device: map_on=local)."""
        stream = self._stream(dst.device)
        block_bytes = dst.shape[1]
        src_base, dst_base = src.data_ptr(), dst.data_ptr()
        with torch.cuda.device(dst.device):
            stream.wait_stream(torch.cuda.current_stream(dst.device))
            handle = ctypes.c_void_p(stream.cuda_stream)
            for local_id, remote_id, num_blocks in runs:
                error = self._memcpy(dst_base + local_id * block_bytes, src_base + remote_id * block_bytes,
                                     num_blocks * block_bytes, _CUDA_MEMCPY_DEFAULT, handle)
                if error:
                    stream.synchronize()  # let the copies already queued land before the blocks are failed
                    raise RuntimeError(f"cudaMemcpyAsync failed with cudaError {error}")
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _check(self, handle: Any) -> str:
        if handle is None:
            return "DONE"
        try:
            return "DONE" if handle.query() else "PROC"
        except RuntimeError as e:  # a CUDA error surfaced by the copy
            logger.warning("KV copy failed: %s", e)
            return "ERR"

    def _release(self, handle: Any) -> None:
        """A queued CUDA copy cannot be aborted: refuse to let go of one still running (the lifecycle
        keeps its blocks quarantined until it ends)."""
        try:
            is_done = handle is None or handle.query()
        except RuntimeError:  # the copy failed: nothing runs any more
            return
        if not is_done:
            raise RuntimeError("a CUDA copy in flight cannot be aborted")

    def _take_notifs(self) -> list[str]:
        request_ids: list[str] = []
        if not self.config.is_producer:  # only a P is told "done": no syscall per step on a D
            return request_ids
        while True:
            try:
                request_ids.extend(json.loads(self._notify_sock.recv(1 << 16)))
            except (BlockingIOError, InterruptedError):
                return request_ids
            except ValueError as e:
                logger.warning("cuda_ipc: bad done notice dropped: %s", e)

    def _send_done(self, peer: Peer, request_ids: list[str], claimants: list[str]) -> None:
        name = peer.remote.reply.get("notify_name") if peer.remote is not None else None
        if name is not None:
            try:
                for i in range(0, len(request_ids), 256):  # well under a datagram's size limit
                    self._notify_sock.sendto(json.dumps(request_ids[i:i + 256]).encode(), "\0" + name)
                return
            except OSError as e:  # P gone, another namespace, or its queue full (EAGAIN)
                logger.debug("cuda_ipc: done datagram to %s failed (%s); using the side channel", peer.engine_id, e)
        super()._send_done(peer, request_ids, claimants)

    def shutdown(self) -> None:
        super().shutdown()
        self._notify_sock.close()

    def _disconnect(self, remote: RemoteEngine) -> None:
        remote.conn = None  # the last reference: torch closes the IPC mapping

    def _deregister(self) -> None:
        _LOCAL_KV_CACHES.pop(self.engine_id, None)
        self._local_bytes = None

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device=device)
        return stream
