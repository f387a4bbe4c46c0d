"""An instance's control link to the KV store (kv_store/server.py): its requests on a thread pool, answers
as futures the engine thread polls, so no exchange with the store ever blocks a step.

Both connector halves of `--kv-connector store` share one StoreClient: the scheduler half looks prompts up,
the worker half handshakes, inserts, commits and releases. Until the worker half's handshake has
succeeded (is_ready), and again after a reply says the store restarted (stale_boot), the client is not
ready and the halves act as if the store were empty: the store is a cache, never a dependency.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pdserve.kv_transfer import side_channel

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0
MAX_WORKERS = 16


def read_margin(lease_s: float) -> float:
    """How long before the store's own deadline a client stops using a lease or an insert's slots: the
    client starts its clock when it sends, the store when it receives, and a step may pass in between."""
    return max(1.0, 0.1 * lease_s)


class StoreError(RuntimeError):
    pass


def _not_connected() -> None:
    raise StoreError("the KV store is not connected")


@dataclass(frozen=True)
class LookupResult:
    lease_id: str | None
    slots: list[int]           # slots of the stored run from the chain's first block
    read_deadline: float       # monotonic: READ done before this, or the lease may be gone
    boot_id: str


class StoreClient:
    def __init__(self, address: tuple[str, int], key: str | None) -> None:
        self.address, self._key = address, key
        self._pool = ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="pdserve-kv-store")
        self.boot_id: str | None = None      # set by the worker half once its handshake is done
        self.num_errors = 0
        self.num_lookups = self.num_hits = 0   # the scheduler half's, reported by the worker half

    @property
    def is_ready(self) -> bool:
        return self.boot_id is not None

    def _request(self, message: dict[str, Any], blob: bytes = b"") -> tuple[dict[str, Any], bytes]:
        try:
            reply, reply_blob = side_channel.request(*self.address, message, blob, timeout=RPC_TIMEOUT_S,
                                                     key=self._key)
        except (OSError, ValueError) as e:
            self.num_errors += 1
            raise StoreError(f"the KV store at {self.address[0]}:{self.address[1]} did not answer "
                             f"({type(e).__name__}: {e})") from None
        if not reply.get("ok"):
            self.num_errors += 1
            if reply.get("error") == "stale_boot" and message.get("boot_id") == self.boot_id:
                logger.warning("the KV store at %s:%d restarted: handshaking again", *self.address)
                self.boot_id = None
            raise StoreError(f"the KV store refused {message.get('type')}: {reply.get('error')}")
        return reply, reply_blob

    def submit(self, fn, *args) -> Future:
        try:
            return self._pool.submit(fn, *args)
        except RuntimeError:  # shut down
            future: Future = Future()
            future.set_exception(StoreError("the KV store client is closed"))
            return future

    # ---- the exchanges (each returns a Future) ----------------------------------------------------

    def handshake(self, message: dict[str, Any]) -> Future:
        return self.submit(self._request, {"type": "handshake", **message})

    def call(self, kind: str, boot_id: str, **fields: Any) -> Future:
        """insert, commit, abort, release: one exchange naming the store boot it concerns."""
        return self.submit(lambda: self._request({"type": kind, "boot_id": boot_id, **fields})[0])

    def lookup(self, hashes: list[int], min_blocks: int, wait_s: float) -> Future:
        """Future[LookupResult]: the longest stored run of hashes, pinned; with min_blocks, asked again
        (each ask waits a little on the store) until that many are stored or wait_s has passed."""
        boot_id = self.boot_id
        if boot_id is None:
            return self.submit(_not_connected)
        return self.submit(self._lookup, hashes, min_blocks, wait_s, boot_id)

    def _lookup(self, hashes: list[int], min_blocks: int, wait_s: float, boot_id: str) -> LookupResult:
        deadline = time.monotonic() + wait_s
        while True:
            sent_at = time.monotonic()
            reply, _ = self._request({"type": "lookup", "boot_id": boot_id, "hashes": hashes,
                                      "min_blocks": min_blocks, "wait_s": max(deadline - sent_at, 0.0)})
            if not reply.get("again"):
                lease_s = float(reply["lease_s"])
                return LookupResult(reply.get("lease_id"), list(reply.get("slots") or []),
                                    sent_at + lease_s - read_margin(lease_s), boot_id)

    def release(self, lease_id: str | None, boot_id: str, drop: bool = False) -> None:
        """Unpin a lookup's blocks; fire and forget (an unanswered release ends at the lease's deadline)."""
        if lease_id is not None:
            future = self.call("release", boot_id, lease_id=lease_id, drop=drop)
            future.add_done_callback(lambda f: f.exception())  # (its failure is counted in num_errors)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
