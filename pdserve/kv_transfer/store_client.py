"""An instance's control link to the KV store (kv_store/server.py): its requests on threads, answers as
futures the engine thread polls, so no exchange with the store ever blocks a step.

Both connector halves of `--kv-connector store` share one StoreClient: the scheduler half looks prompts up,
the worker half handshakes, inserts, commits and releases. Lookups and the rest run on separate thread
pools, so that readers waiting for a P's insert never queue that P's commits (or anyone's releases) behind
them. The store is a cache, never a dependency:
  - until the worker half's handshake has succeeded, and again after a reply says the store restarted
    (stale_boot), the client is not ready and the halves act as if the store were empty
  - after an exchange that timed out or could not connect, the client rests for DEGRADED_S (no new lookups
    or inserts), so a hung store costs one timeout, not one per request
  - inserts and leases are named here (uuid): one whose answer never came is aborted or released by name,
    and commits, aborts and releases are tried again on a transport error
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pdserve.kv_transfer import side_channel

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0            # one exchange, insert/commit/abort/release/handshake
LOOKUP_RPC_TIMEOUT_S = 1.5     # one lookup exchange (the store waits at most 0.25 s in one)
DEGRADED_S = 5.0
RETRIES_S = (0.2, 0.5, 1.0)    # waits before a commit, abort or release is tried again
LOOKUP_WORKERS, CONTROL_WORKERS = 16, 8


def read_margin(lease_s: float) -> float:
    """How long before the store's own deadline a client stops using a lease or an insert's slots: the
    client starts its clock when it sends, the store when it receives, and a step may pass in between."""
    return max(1.0, 0.1 * lease_s)


class StoreError(RuntimeError):
    pass


class StoreUnreachable(StoreError):
    """The exchange may or may not have reached the store (a timeout, a refused or broken connection)."""


def _not_connected() -> None:
    raise StoreError("the KV store is not connected")


@dataclass(frozen=True)
class LookupResult:
    lease_id: str | None       # None: nothing found, nothing pinned
    slots: list[int]           # slots of the stored run from the chain's first block
    read_deadline: float       # monotonic: READ done before this, or the lease may be gone
    boot_id: str


class StoreClient:
    def __init__(self, address: tuple[str, int], key: str | None) -> None:
        self.address, self._key = address, key
        self._lookup_pool = ThreadPoolExecutor(LOOKUP_WORKERS, thread_name_prefix="pdserve-kv-store-lookup")
        self._control_pool = ThreadPoolExecutor(CONTROL_WORKERS, thread_name_prefix="pdserve-kv-store")
        self._lock = threading.Lock()
        self.boot_id: str | None = None      # set by the worker half once its handshake is done
        self._degraded_until = float("-inf")
        self.num_errors = 0
        self.last_answer_at = float("-inf")   # monotonic: the store's last reply, of any kind
        self.num_lookups = self.num_hits = 0   # the scheduler half's, reported by the worker half

    @property
    def is_ready(self) -> bool:
        return self.boot_id is not None

    @property
    def is_usable(self) -> bool:
        """Ready, and not resting after a store that did not answer."""
        return self.boot_id is not None and time.monotonic() >= self._degraded_until

    def set_boot(self, boot_id: str) -> None:
        with self._lock:
            self.boot_id = boot_id
            self._degraded_until = float("-inf")

    def forget_boot(self, boot_id: str | None, why: str = "restarted") -> None:
        """boot_id is gone (the store said so, or its pool did): compare and clear (a newer boot set
        meanwhile stays)."""
        with self._lock:
            if boot_id is not None and self.boot_id == boot_id:
                logger.warning("the KV store at %s:%d %s: handshaking again", *self.address, why)
                self.boot_id = None

    def _request(self, message: dict[str, Any], blob: bytes = b"",
                 timeout: float = RPC_TIMEOUT_S) -> tuple[dict[str, Any], bytes]:
        try:
            reply, reply_blob = side_channel.request(*self.address, message, blob, timeout=timeout, key=self._key)
        except (OSError, ValueError) as e:
            self.num_errors += 1
            with self._lock:
                self._degraded_until = time.monotonic() + DEGRADED_S
            raise StoreUnreachable(f"the KV store at {self.address[0]}:{self.address[1]} did not answer "
                                   f"({type(e).__name__}: {e})") from None
        self.last_answer_at = time.monotonic()
        if not reply.get("ok"):
            self.num_errors += 1
            if reply.get("error") == "stale_boot":
                self.forget_boot(message.get("boot_id"))
            raise StoreError(f"the KV store refused {message.get('type')}: {reply.get('error')}")
        return reply, reply_blob

    def _submit(self, pool: ThreadPoolExecutor, fn, *args) -> Future:
        try:
            return pool.submit(fn, *args)
        except RuntimeError:  # shut down
            future: Future = Future()
            future.set_exception(StoreError("the KV store client is closed"))
            return future

    # ---- the exchanges (each returns a Future) ----------------------------------------------------

    def handshake(self, message: dict[str, Any]) -> Future:
        return self._submit(self._control_pool, self._request, {"type": "handshake", **message})

    def ping(self, boot_id: str) -> Future:
        """Future[None]: the store answers and still runs boot_id (a refusal forgets it, see _request)."""
        return self._submit(self._control_pool, lambda: self._request({"type": "ping", "boot_id": boot_id}) and None)

    def insert(self, boot_id: str, hashes: list[int]) -> tuple[str, Future]:
        """(insert id, Future[reply with slots]); an insert whose answer never came is aborted by name."""
        insert_id = uuid.uuid4().hex

        def run() -> dict[str, Any]:
            try:
                return self._request({"type": "insert", "boot_id": boot_id, "insert_id": insert_id,
                                      "hashes": hashes})[0]
            except StoreUnreachable:   # (its own task: P's blocks must not wait for the abort's retries)
                self._submit(self._control_pool, self._retry,
                             {"type": "abort", "boot_id": boot_id, "insert_id": insert_id})
                raise
        return insert_id, self._submit(self._control_pool, run)

    def end_insert(self, kind: str, boot_id: str, insert_id: str, regroup: dict[str, int] | None = None) -> None:
        """commit or abort; fire and forget, tried again on a transport error (unanswered: the TTL ends it).
        regroup ({parts, outer}): the ranks of a tensor-parallel client wrote the slots in grouped_layout."""
        message = {"type": kind, "boot_id": boot_id, "insert_id": insert_id}
        if regroup is not None:
            message["regroup"] = regroup
        self._submit(self._control_pool, self._retry, message)

    def release(self, lease_id: str | None, boot_id: str, drop: bool = False) -> None:
        """Unpin a lookup's blocks; fire and forget (an unanswered release ends at the lease's deadline)."""
        if lease_id is not None:
            self._submit(self._control_pool, self._retry,
                         {"type": "release", "boot_id": boot_id, "lease_id": lease_id, "drop": drop})

    def _retry(self, message: dict[str, Any]) -> None:
        for wait in (0.0, *RETRIES_S):
            time.sleep(wait)
            try:
                self._request(message)
                return
            except StoreUnreachable:
                continue
            except StoreError:   # refused: retrying cannot help
                return

    def lookup(self, hashes: list[int], min_blocks: int, deadline: float) -> Future:
        """Future[LookupResult]: the longest stored run of hashes, pinned; with min_blocks, asked again
        (each ask waits a little on the store) until that many are stored or the deadline (monotonic,
        from when the request arrived) has passed."""
        boot_id = self.boot_id
        if boot_id is None:
            return self._submit(self._lookup_pool, _not_connected)
        return self._submit(self._lookup_pool, self._lookup, hashes, min_blocks, deadline, boot_id)

    def _lookup(self, hashes: list[int], min_blocks: int, deadline: float, boot_id: str) -> LookupResult:
        lease_id = uuid.uuid4().hex
        while True:
            sent_at = time.monotonic()
            try:
                reply, _ = self._request({"type": "lookup", "boot_id": boot_id, "lease_id": lease_id,
                                          "hashes": hashes, "min_blocks": min_blocks,
                                          "wait_s": max(deadline - sent_at, 0.0)}, timeout=LOOKUP_RPC_TIMEOUT_S)
            except StoreUnreachable:   # it may pin once it gets to it: the release's tombstone stops that
                self._submit(self._control_pool, self._retry,
                             {"type": "release", "boot_id": boot_id, "lease_id": lease_id})
                raise
            if not reply.get("again"):
                lease_s = float(reply["lease_s"])
                slots = list(reply.get("slots") or [])
                return LookupResult(lease_id if slots else None, slots,
                                    sent_at + lease_s - read_margin(lease_s), boot_id)

    def close(self) -> None:
        for pool in (self._lookup_pool, self._control_pool):
            pool.shutdown(wait=False, cancel_futures=True)
