"""`pdserve kv-store`: a KV block pool shared by many instances, keyed by the prefix cache's chained hash.

The pool is one buffer of --capacity bytes registered with NIXL, cut into slots of one KV block each:
host memory that clients on this host map (shared memory), or with --pool-device cuda:N one GPU's memory,
which clients on the host reach by CUDA IPC through NIXL (VRAM to VRAM, never through the host). Clients
(kv_transfer/store.py) move the data themselves: P WRITEs its blocks into slots the store gave it, D READs
slots a lookup found; the store never posts a transfer. Control is the side channel's
framed request/reply (kv_transfer/side_channel.py), one message each:

  handshake {compat_hash, compat, block_bytes} → {boot_id, region, insert_ttl_s, lease_s, ucx_tcp_segments,
      shared_memory} + NIXL metadata.
      The first client fixes the layout (block bytes and compat hash); a client of another layout is
      refused with both sides named. boot_id changes when the store restarts: every other message carries
      it, and one naming another boot is refused ("stale_boot"), since slots of a dead boot mean nothing.
      shared_memory (unless --no-shared-memory) names the pool's memory file: a client on this host maps
      it and copies instead of transferring (kv_transfer/store_shm.py).
  insert {insert_id, hashes} → {slots: [[i, slot], ...]}  slots to WRITE hashes[i] into (present hashes skipped)
  commit {insert_id[, regroup]} / abort {insert_id}       the WRITE is done / failed; regroup {parts,
      outer}: the ranks of a tensor-parallel client wrote their heads in grouped_layout (store_tp.py),
      put back in the whole-model layout before the blocks become visible
  lookup {lease_id, hashes, min_blocks, wait_s} → {slots} the longest stored run, pinned for lease_s.
      With min_blocks the reply waits (at most MAX_WAIT_PER_CALL_S, so a waiting reader never holds a
      server thread long) while fewer than min_blocks are stored but more are being written: D asks for
      the blocks P announced before P's commit has necessarily arrived. The client asks again until its
      own deadline.
  release {lease_id, drop} → {valid}                    drop: free the blocks now (seed 002's drop_select)
  ping → {}                                             an idle client's liveness check (stale_boot if restarted)
  stats → the index's counters (also served to Prometheus with --metrics-port: StoreMetrics)
The client names its inserts and leases: one whose answer it never got (a store that stalled) it can still
abort or release, and an abort or release that overtakes its insert or lookup leaves a tombstone.

Deadlines, so that no crashed client leaks the pool: a lease unpins lease_s after the lookup, an insert
frees its slots insert_ttl_s after it began. A client keeps its own side of both with margin (it READs
before send time + lease_s - margin, and aborts a WRITE not done by send time + insert_ttl_s - margin), so
a slot the store reuses is never still being read or written under an old promise.

Progress: without NIXL's progress thread (a busy-polling core), the store's agent is progressed by a
thread of ours, every millisecond while any insert or lease is live and every 50 ms otherwise.
"""
from __future__ import annotations

import argparse
import logging
import math
import signal
import threading
import time
import uuid
from typing import Any

import torch
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.cli_types import parse_bytes
from pdserve.kv_store.index import MAX_SLOTS, StoreIndex
from pdserve.kv_store.options import DEFAULT_INSERT_TTL_S, DEFAULT_LEASE_S
from pdserve.stop_signals import stop_signals
from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.nixl import new_agent, ucx_tcp_segments
from pdserve.kv_transfer.tp_layout import regroup_run, runs_of
from pdserve.kv_transfer.store_shm import SharedPool


logger = logging.getLogger(__name__)

MAX_WAIT_PER_CALL_S = 0.25
MAX_CONNECTIONS = 1024   # served at once: every instance's lookups and inserts meet here
MAX_HASHES_PER_MESSAGE = 1 << 16   # 1M tokens of prompt at 16 tokens per block
_BUSY_POLL_S, _IDLE_POLL_S = 0.001, 0.05
def parse_pool_device(text: str) -> torch.device:
    """cpu, cuda or cuda:N (checked against the GPUs this process sees)."""
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"pool device: cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        index = device.index if device.index is not None else 0
        if index >= count:
            raise ValueError(f"pool device {text}: this process sees {count} GPU(s)")
        device = torch.device("cuda", index)
    return device


def _id(message: dict[str, Any], key: str) -> str:
    value = message.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= 128:
        raise ValueError(f"{key}: a string of 1 to 128 characters")
    return value


def _hashes(message: dict[str, Any]) -> list[int]:
    hashes = message.get("hashes")
    if not isinstance(hashes, list) or len(hashes) > MAX_HASHES_PER_MESSAGE or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hashes):
        raise ValueError(f"hashes: a list of at most {MAX_HASHES_PER_MESSAGE} integers")
    return hashes


class KVStoreServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, capacity_bytes: int = 1 << 30,
                 lease_s: float = DEFAULT_LEASE_S, insert_ttl_s: float = DEFAULT_INSERT_TTL_S,
                 auth_key: str | None = None, enable_prog_thread: bool = False, shared_memory: bool = True,
                 pool_device: str = "cpu") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity: must be > 0 bytes, got {capacity_bytes}")
        self.pool_device = parse_pool_device(pool_device)
        if lease_s <= 2.0 or insert_ttl_s <= 2.0:
            raise ValueError("lease_s and insert_ttl_s: must be > 2 s (clients keep a margin inside them)")
        self.capacity_bytes, self.lease_s, self.insert_ttl_s = capacity_bytes, lease_s, insert_ttl_s
        self.boot_id = uuid.uuid4().hex
        self.agent_name = f"kv-store-{self.boot_id[:8]}"
        self.agent = new_agent(self.agent_name, enable_prog_thread, "pdserve kv-store")
        self._lock = threading.Condition()
        self.index: StoreIndex | None = None        # made at the first handshake: slots need the block size
        self.block_bytes: int | None = None
        self.compat_hash: str | None = None
        self.compat: dict[str, Any] | None = None
        self._buffer: torch.Tensor | None = None
        self._committing: set[str] = set()   # inserts whose slots are being regrouped (_regroup)
        self.shared_memory = shared_memory and self.pool_device.type == "cpu"
        self._shared: SharedPool | None = None
        self._reg_descs = None
        self._blob = b""
        self._closed = threading.Event()
        self._server = side_channel.SideChannelServer(host, port, {
            "handshake": self._on_handshake, "insert": self._on_insert, "commit": self._on_end_insert,
            "abort": self._on_end_insert, "lookup": self._on_lookup, "release": self._on_release,
            "stats": self._on_stats, "ping": self._on_ping}, key=auth_key, max_connections=MAX_CONNECTIONS)
        self.host, self.port = host, self._server.port
        self._progress = threading.Thread(target=self._progress_loop, name="pdserve-kv-store-progress", daemon=True)
        self._progress.start()

    # ---- the pool ---------------------------------------------------------------------------------

    def _make_pool(self, block_bytes: int) -> None:
        num_slots = self.capacity_bytes // block_bytes
        if not 0 < num_slots <= MAX_SLOTS:
            raise ValueError(f"capacity {self.capacity_bytes} bytes holds {num_slots} blocks of {block_bytes} bytes; "
                             f"the store holds 1 to {MAX_SLOTS}")
        index = StoreIndex(num_slots)
        if self.shared_memory:
            try:
                self._shared = SharedPool(num_slots * block_bytes, self.boot_id)   # touched: resident now
            except (OSError, AttributeError) as e:   # (os.memfd_create: Linux only)
                logger.warning("kv-store: the pool is not in shared memory, clients use NIXL: %s", e)
        self._buffer = (self._shared.slots if self._shared is not None
                        else torch.zeros(num_slots * block_bytes, dtype=torch.uint8, device=self.pool_device))
        self._reg_descs = self.agent.register_memory(self._buffer)
        self._blob = self.agent.get_agent_metadata()
        self.index = index
        self.block_bytes = block_bytes
        logger.info("kv-store: %d slots of %d bytes (%.1f GiB)", num_slots, block_bytes,
                    num_slots * block_bytes / 2**30)

    def _region(self) -> dict[str, Any]:
        on_gpu = self._buffer.is_cuda
        return {"base_addr": self._buffer.data_ptr(), "num_blocks": self.index.num_slots,
                "block_bytes": self.block_bytes, "mem_type": "VRAM" if on_gpu else "DRAM",
                "device_id": self._buffer.device.index if on_gpu else 0}

    # ---- handlers (side-channel threads) ----------------------------------------------------------

    def _on_handshake(self, message: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        block_bytes, compat_hash = message.get("block_bytes"), message.get("compat_hash")
        if not isinstance(block_bytes, int) or block_bytes <= 0 or not isinstance(compat_hash, str):
            return {"ok": False, "error": "handshake: needs block_bytes (int > 0) and compat_hash"}, b""
        with self._lock:
            if self.index is None:
                self._make_pool(block_bytes)
                self.compat_hash, self.compat = compat_hash, message.get("compat")
            if (block_bytes, compat_hash) != (self.block_bytes, self.compat_hash):
                theirs, ours = message.get("compat") or {}, self.compat or {}
                diffs = [f"{k} store={ours.get(k)} client={theirs.get(k)}" for k in sorted(set(ours) | set(theirs))
                         if ours.get(k) != theirs.get(k)]
                return {"ok": False, "error": "KV layout mismatch with the store: " + (
                    ", ".join(diffs) or f"block_bytes store={self.block_bytes} client={block_bytes}")}, b""
            return {"ok": True, "boot_id": self.boot_id, "agent_name": self.agent_name, "region": self._region(),
                    "lease_s": self.lease_s, "insert_ttl_s": self.insert_ttl_s, "ucx_tcp_segments": ucx_tcp_segments(),
                    "shared_memory": self._shared.describe() if self._shared is not None else None}, self._blob

    def _refusal(self, message: dict[str, Any]) -> dict[str, Any] | None:
        if self.index is None or message.get("boot_id") != self.boot_id:
            return {"ok": False, "error": "stale_boot"}
        return None

    def _on_ping(self, message: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        """An idle client's question: are you still the boot I handshook with?"""
        with self._lock:
            return self._refusal(message) or {"ok": True}, b""

    def _on_insert(self, message: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        hashes, insert_id = _hashes(message), _id(message, "insert_id")
        with self._lock:
            if (refusal := self._refusal(message)) is not None:
                return refusal, b""
            placed = self.index.begin_insert(insert_id, hashes, self.insert_ttl_s)
            if placed is None:
                return {"ok": False, "error": f"insert {insert_id!r} is in use or was aborted"}, b""
        return {"ok": True, "slots": placed}, b""

    def _on_end_insert(self, message: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        """commit (the WRITE is done) or abort (it failed)."""
        insert_id = _id(message, "insert_id")
        regroup = message.get("regroup") if message["type"] == "commit" else None
        held = False   # this commit regrouped the insert's slots, and holds them until it ends it
        if regroup is not None:
            refusal, held = self._regroup(message, insert_id, regroup)
            if refusal is not None:
                return refusal, b""
        with self._lock:
            if held:
                self._committing.discard(insert_id)
            elif insert_id in self._committing:
                return {"ok": False, "error": f"insert {insert_id!r} is being committed"}, b""
            if (refusal := self._refusal(message)) is not None:
                return refusal, b""
            end = self.index.commit if message["type"] == "commit" else self.index.abort
            num_blocks = end(insert_id)
            self._lock.notify_all()   # readers waiting for these blocks
        return {"ok": True, "num_blocks": num_blocks}, b""

    def _regroup(self, message: dict[str, Any], insert_id: str, regroup: Any) -> tuple[dict[str, Any] | None, bool]:
        """The ranks of a tensor-parallel client over NIXL each wrote their heads of the insert's blocks whole,
        in grouped_layout over runs of its slots (kv_transfer/tp_layout.py): put the heads back in the
        whole-model layout before the commit makes them readable. The copy (the insert's bytes, once) runs
        outside the lock, which every client's message and the expiry need (a 2 GiB insert held it 0.4 s:
        hostile review): meanwhile the insert cannot expire, and a commit or abort of it is refused, so its
        slots stay its own. (A refusal to answer or None, whether the insert is now held for this commit.)"""
        parts, outer = (regroup.get("parts"), regroup.get("outer")) if isinstance(regroup, dict) else (None, None)
        with self._lock:
            if (refusal := self._refusal(message)) is not None:
                return refusal, False
            if not (type(parts) is int and type(outer) is int and 1 < parts <= 1024 and outer > 0
                    and self.block_bytes % (parts * outer) == 0):
                raise ValueError(f"regroup: {{parts, outer}} integers that cut a {self.block_bytes}-byte block "
                                 f"into parts of rows, got {regroup!r}")
            if insert_id in self._committing:
                return {"ok": False, "error": f"insert {insert_id!r} is being committed"}, False
            slots = self.index.insert_slots(insert_id)
            if not slots:
                return None, False   # (an insert unknown, e.g. expired: its commit changes nothing either)
            insert = self.index.inserts[insert_id]
            deadline, insert.deadline = insert.deadline, math.inf
            self._committing.add(insert_id)
            pool = self._buffer.view(self.index.num_slots, self.block_bytes)
        try:
            for start, n in runs_of(slots):
                regroup_run(pool[start:start + n], parts, outer)
            if pool.is_cuda:   # a reader's DMA does not wait for the stream
                torch.cuda.synchronize(pool.device)
        except BaseException:
            with self._lock:
                insert.deadline = deadline
                self._committing.discard(insert_id)
            raise
        return None, True

    def _on_lookup(self, message: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        hashes, lease_id = _hashes(message), _id(message, "lease_id")
        min_blocks = message.get("min_blocks") or 0
        wait_s = message.get("wait_s") or 0.0
        if (not isinstance(min_blocks, int) or not isinstance(wait_s, (int, float))
                or not math.isfinite(wait_s)):   # (JSON lets NaN and Infinity through)
            raise ValueError("lookup: min_blocks must be an integer and wait_s a finite number")
        wait_s = max(float(wait_s), 0.0)
        deadline = time.monotonic() + min(wait_s, MAX_WAIT_PER_CALL_S)
        needed = min(min_blocks, len(hashes))
        with self._lock:
            while True:
                if (refusal := self._refusal(message)) is not None:
                    return refusal, b""
                num_stored, num_pending = self.index.longest_run(hashes)
                # Waiting ends when the run is long enough, or when the next block will not come (the writer
                # could not store it), or at this exchange's deadline.
                will_come = num_stored < needed and (num_pending or not self.index.is_refused(hashes[num_stored]))
                left = deadline - time.monotonic()
                if not will_come or not left > 0:
                    break
                self._lock.wait(left)
            if will_come and wait_s > MAX_WAIT_PER_CALL_S:
                return {"ok": True, "again": True, "num_stored": num_stored}, b""   # the client asks again
            slots = self.index.lookup(lease_id, hashes, self.lease_s)
            if slots is None:
                return {"ok": False, "error": f"lease {lease_id!r} is in use or was released"}, b""
        return {"ok": True, "slots": slots, "lease_s": self.lease_s, "num_pending": num_pending}, b""

    def _on_release(self, message: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        with self._lock:
            if (refusal := self._refusal(message)) is not None:
                return refusal, b""
            valid = self.index.release(_id(message, "lease_id"), drop=bool(message.get("drop")))
        return {"ok": True, "valid": valid}, b""

    def _on_stats(self, message: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        return {"ok": True, **self.stats()}, b""

    def stats(self) -> dict[str, Any]:
        """The pool's state and the index's counters (the `stats` message, and --metrics-port)."""
        with self._lock:
            if self.index is None:
                return {"num_slots": 0}
            return {"num_slots": self.index.num_slots, "block_bytes": self.block_bytes,
                    "num_stored": self.index.num_stored, "num_free": len(self.index.free_slots) + self.index.num_untouched,
                    "num_leases": len(self.index.leases), "num_inserts": len(self.index.inserts),
                    **self.index.stats.__dict__}

    # ---- progress and deadlines -------------------------------------------------------------------

    def _progress_loop(self) -> None:
        last_expire = 0.0
        while not self._closed.is_set():
            busy = False
            with self._lock:
                if self.index is not None:
                    if time.monotonic() - last_expire > 0.1:
                        self.index.expire()
                        last_expire = time.monotonic()
                    busy = bool(self.index.leases or self.index.inserts)
            try:
                self.agent.get_new_notifs()   # progresses UCX; clients' notifications carry nothing we need
            except Exception as e:  # a peer gone mid-transfer: its own deadline handles it
                logger.debug("kv-store: progress: %s", e)
            self._closed.wait(_BUSY_POLL_S if busy else _IDLE_POLL_S)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._server.close()
        self._progress.join(timeout=2.0)
        if self._reg_descs is not None:
            self.agent.deregister_memory(self._reg_descs)
            self._reg_descs = None
        self._buffer = None
        if self._shared is not None:
            self._shared.close()
            self._shared = None


class StoreMetrics(Collector):
    """The store's state and counters in Prometheus's terms, read under the store's lock at each scrape."""

    def __init__(self, server: KVStoreServer) -> None:
        self.server = server

    def collect(self):
        stats = self.server.stats()
        gauges = {"kv_store_slots": ("slots in the pool (0 until the first client's handshake sizes it)",
                                     "num_slots"),
                  "kv_store_slots_stored": ("slots holding a committed block", "num_stored"),
                  "kv_store_slots_free": ("slots never used or freed", "num_free"),
                  "kv_store_leases": ("lookups whose blocks are pinned now", "num_leases"),
                  "kv_store_inserts_pending": ("inserts given slots and not committed yet", "num_inserts"),
                  "kv_store_block_bytes": ("bytes of one slot", "block_bytes")}
        for name, (doc, key) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=stats.get(key, 0))
        counters = {"kv_store_inserted_blocks": ("blocks committed", "num_inserted_blocks"),
                    "kv_store_evicted_blocks": ("stored blocks evicted for space (least recently used)",
                                                "num_evicted_blocks"),
                    "kv_store_lookups": ("lookups answered", "num_lookups"),
                    "kv_store_hit_blocks": ("blocks lookups found", "num_hit_blocks"),
                    "kv_store_expired_leases": ("leases that ran out unreleased (a reader that crashed or "
                                                "stalled)", "num_expired_leases"),
                    "kv_store_expired_inserts": ("inserts that were never committed in time", "num_expired_inserts"),
                    "kv_store_full_refusals": ("inserts cut short: every slot pinned or pending",
                                               "num_full_refusals")}
        for name, (doc, key) in counters.items():
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))


def main(args: argparse.Namespace, auth_key: str | None = None) -> int:
    try:
        capacity = parse_bytes(args.capacity)
        server = KVStoreServer(args.host, args.port, capacity, args.lease_seconds, args.insert_ttl_seconds,
                               auth_key=auth_key, shared_memory=args.shared_memory, pool_device=args.pool_device)
    except (ValueError, ImportError, OSError) as e:
        print(f"pdserve kv-store: {e}")
        return 2
    metrics = None
    if args.metrics_port is not None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StoreMetrics(server))
        try:
            metrics, _ = start_http_server(args.metrics_port, addr=args.host, registry=registry)
        except OSError as e:
            server.close()
            print(f"pdserve kv-store: --metrics-port {args.metrics_port}: {e}")
            return 2
    stop = threading.Event()
    for sig in stop_signals():
        signal.signal(sig, lambda *_: stop.set())
    print(f"pdserve kv-store: listening on {server.host}:{server.port}, capacity {capacity} bytes"
          + (f", metrics on http://{args.host}:{metrics.server_port}/metrics" if metrics else ""), flush=True)
    try:
        stop.wait()
    finally:
        if metrics is not None:
            metrics.shutdown()
        server.close()
    return 0
