"""The push handoff's lifecycle: P's Pusher and D's Receiver, one record per transfer id, one state each.

Pull's danger is a READ of blocks P freed (D gets garbage and says so); push's is a WRITE into blocks D
freed and gave to another request, which would corrupt that request silently. So the rule every state of
this module keeps: D gives a transfer's blocks back only when no WRITE can land in them any more, i.e. when

  - P's notification for the transfer arrived (the WRITE is done), or
  - P said so: a push_failed message, or a reply naming the transfer released, failed, expired or unknown
    there (P decides under its lock, and a transfer it answered so for is never written afterwards), or
    a reply from another boot of P (the boot that had it is gone), or P's side channel refusing the
    connection (no process listens there), or
  - P has been silent long enough that any WRITE it could have started is over: P writes only for an
    announce it holds, an announce lives one lease past the last message from D that refreshed it, and a
    WRITE that outlives write_timeout is aborted; so after last_sent + lease + write_timeout (+ a margin)
    nothing more can come, and D reports the load failed then (QUARANTINED until that moment).

On P (producer), per transfer (a Send), states WAITING → WRITING (→ QUARANTINED) → an ended fate:
  - the request's blocks (its PushSendSpec) and D's announce (block ids, first block, D's side channel)
    arrive in either order; an announce may come before P has even received the request over HTTP
  - WAITING has a deadline one lease ahead, moved by every announce or status message from D (D's
    keep-alive while its request queues without blocks, and its waits afterwards); past it the Send
    expires: its blocks are freed, the D it knows is told
  - with both halves: handshake with that D boot (once), then one WRITE (one descriptor per coalesced run,
    notif = the transfer id) under write_timeout; done → "written"; an error, a refusal or the deadline →
    "failed" and a push_failed message to D once nothing writes
  - a release from D (its request ended, or the router's) ends a WAITING Send at once ("released"); a
    writing one answers "writing" and D waits for the notification or push_failed
  - fates are kept one lease for late messages: a status or release then gets the fate, not "unknown"
On D (consumer), per request (a Recv): QUEUED (keep-alive: status messages extend P's hold) → ANNOUNCING →
WAITING → reported; RELEASING when its request was aborted or the router said P failed; QUARANTINED when P
went silent. A WAITING transfer lasts at most wait_timeout (P's queue may be long; D's blocks are held
for it meanwhile), then D releases it.
Threads: the side-channel server threads touch P's Sends under the Pusher's lock and put D's incoming
push_failed messages on the Receiver's event queue; transport calls run on the engine thread only.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.pull import KeepAliveSpec
from pdserve.kv_transfer.push import PushConnectorMeta, PushRecvSpec
from pdserve.kv_transfer.transport_worker import RemoteEngine, coalesce

logger = logging.getLogger(__name__)

MAX_SIDE_CHANNEL_S = 5.0   # one side-channel exchange, at most (and at most half a lease)
SAFETY_MARGIN_S = 2.0      # added to every "nothing can write any more" bound (clocks, scheduling)
MAX_ENDED = 1 << 16        # fates remembered (one lease period)
MAX_SENDS = 1 << 15        # P: live transfers, announce-only ones included (a flood of announces is refused)
PEER_IDLE_S = 60.0
# What P answers for a transfer it will never write (D may give the blocks back at once).
NEVER_WRITTEN = ("released", "failed", "expired", "unknown", "stale_boot")


def write_timeout(config: KVTransferConfig) -> float:
    return float(config.extra.get("write_timeout_seconds", max(60.0, 2 * config.lease_seconds)))


# ---- P: the pusher ---------------------------------------------------------------------------------

class SendState(Enum):
    WAITING = "waiting"
    WRITING = "writing"
    QUARANTINED = "quarantined"   # past its deadline, and the transport could not abort the WRITE yet


@dataclass(frozen=True)
class Target:
    """D's announce: where a transfer's blocks go."""
    engine_id: str
    boot_id: str
    address: tuple[str, int]
    request_id: str           # D's request (for D's own bookkeeping)
    block_ids: list[int]
    first_block: int


@dataclass
class Send:
    transfer_id: str
    deadline: float
    request_id: str | None = None      # P's request, once computed
    block_ids: list[int] | None = None
    target: Target | None = None
    state: SendState = SendState.WAITING
    handle: Any = None
    error: str = ""
    posted_at: float = 0.0
    num_bytes: int = 0
    num_descriptors: int = 0


@dataclass
class DPeer:
    """P's connection to one boot of one D."""
    key: tuple[str, str]
    address: tuple[str, int]
    deadline: float
    remote: RemoteEngine | None = None
    is_failed: bool = False
    error: str = ""
    last_used: float = 0.0


class Pusher:
    """P: every transfer this instance writes. Engine thread: apply(), step(); side-channel threads:
    on_announce, on_status, on_release, all under self._lock."""

    def __init__(self, transport: Any, config: KVTransferConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.t, self.config, self.clock = transport, config, clock  # t: push_worker's hooks
        self.lease_s = config.lease_seconds
        self.write_timeout = write_timeout(config)
        self.timeout = min(MAX_SIDE_CHANNEL_S, config.lease_seconds / 2)
        self._lock = threading.Lock()
        self.sends: dict[str, Send] = {}
        self._ended: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._to_free: set[str] = set()    # P's request ids whose blocks go back at the next step
        self.peers: dict[tuple[str, str], DPeer] = {}
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.clients = side_channel.PeerClients(config.auth_key, self.timeout, self._events, clock)
        self._next_sweep = 0.0
        self.num_expirations = self.num_failures = self.num_quarantined = 0

    # ---- the scheduler's meta ----
    def apply(self, meta: PushConnectorMeta) -> None:
        now = self.clock()
        with self._lock:
            for spec in meta.reqs_to_send:
                fate = self._ended.get(spec.transfer_id)
                if fate is not None:  # released (or failed) before P computed it: free at once
                    self._to_free.add(spec.request_id)
                    continue
                send = self.sends.get(spec.transfer_id)
                if send is None:
                    send = self.sends[spec.transfer_id] = Send(spec.transfer_id, now + self.lease_s)
                send.request_id, send.block_ids = spec.request_id, list(spec.block_ids)
                send.deadline = max(send.deadline, now + self.lease_s)
            for transfer_id in meta.reqs_not_sent:  # P's request ended without KV: nothing will come
                send = self.sends.pop(transfer_id, None)
                self._end_locked(transfer_id, "failed", now)
                if send is not None and send.target is not None:
                    self._tell_failed(send.target, transfer_id, "the prefill instance did not compute the prompt "
                                      "(its request was aborted or failed)")

    # ---- each step ----
    def step(self) -> set[str]:
        """finished_sending: P's request ids whose blocks may go back."""
        while not self._events.empty():
            self._apply_event(self._events.get_nowait())
        now = self.clock()
        with self._lock:
            finished, self._to_free = self._to_free, set()
            ready = []
            for send in list(self.sends.values()):
                if send.state == SendState.WAITING:
                    if now > send.deadline:
                        self.num_expirations += 1
                        logger.warning("push of %s expired: %s within %.1fs", send.transfer_id,
                                       "no decode instance announced its blocks" if send.target is None
                                       else "the decode instance stopped confirming it", self.lease_s)
                        self._finish_locked(send, "expired", finished, now,
                                            "the prefill instance's hold on this request's KV expired")
                    elif send.block_ids is not None and send.target is not None:
                        ready.append(send)
            active = [send for send in self.sends.values() if send.state != SendState.WAITING]
        for send in ready:
            self._start(send, now, finished)
        for send in active:
            self._advance(send, now, finished)
        self._sweep(now)
        return finished

    def _start(self, send: Send, now: float, finished: set[str]) -> None:
        target = send.target
        peer = self._peer(target, now)
        if peer.is_failed:
            return self._fail(send, peer.error, finished, now)
        if peer.remote is None:
            return  # handshaking; the Send's lease bounds the wait
        n, first = len(target.block_ids), target.first_block
        if first < 0 or first + n > len(send.block_ids):
            return self._fail(send, f"the decode instance asked for prompt blocks [{first}, {first + n}) of "
                                    f"{len(send.block_ids)}", finished, now)
        local_ids = send.block_ids[first:first + n]
        with self._lock:
            if self.sends.get(send.transfer_id) is not send or send.state != SendState.WAITING:
                return  # released meanwhile
            send.state, send.deadline, send.posted_at = SendState.WRITING, now + self.write_timeout, now
        try:
            send.handle, state, send.num_descriptors, send.num_bytes = self.t._post_write(
                send.transfer_id, local_ids, target.block_ids, peer.remote)
        except Exception as e:  # nothing posted
            logger.warning("push of %s: posting the WRITE to %s failed: %s", send.transfer_id, target.engine_id, e)
            return self._fail(send, "the transfer could not be posted" if not isinstance(e, ValueError) else str(e),
                              finished, now)
        if state != "PROC":
            self._complete(send, state, finished, now)

    def _advance(self, send: Send, now: float, finished: set[str]) -> None:
        try:
            state = self.t._check(send.handle)
        except Exception as e:
            logger.warning("push of %s: transfer status failed: %s: %s", send.transfer_id, type(e).__name__, e)
            state = "ERR"
        if state != "PROC":
            return self._complete(send, state, finished, now)
        if send.state == SendState.WRITING and now > send.deadline:
            send.error = f"the WRITE to the decode instance did not finish within {self.write_timeout:g}s"
            logger.warning("push of %s: %s; aborting it", send.transfer_id, send.error)
            if self._release_handle(send):
                return self._fail(send, send.error, finished, now)
            self.num_quarantined += 1
            send.state = SendState.QUARANTINED
        elif send.state == SendState.QUARANTINED and self._release_handle(send):
            self._fail(send, send.error, finished, now)

    def _complete(self, send: Send, state: str, finished: set[str], now: float) -> None:
        self._release_handle(send)
        if send.state == SendState.QUARANTINED or state != "DONE":
            return self._fail(send, send.error or "transfer error", finished, now)
        self.t._count_write(send, now - send.posted_at)
        with self._lock:
            self._finish_locked(send, "written", finished, now)

    def _fail(self, send: Send, error: str, finished: set[str], now: float) -> None:
        """Nothing writes for it (any more): tell D, free P's blocks."""
        self.num_failures += 1
        with self._lock:
            self._finish_locked(send, "failed", finished, now, error)

    def _finish_locked(self, send: Send, fate: str, finished: set[str], now: float, error: str = "") -> None:
        if self.sends.get(send.transfer_id) is send:
            del self.sends[send.transfer_id]
        self._end_locked(send.transfer_id, fate, now)
        if send.request_id is not None:
            finished.add(send.request_id)
        if fate != "written" and send.target is not None:
            self._tell_failed(send.target, send.transfer_id, error)

    def _end_locked(self, transfer_id: str, fate: str, now: float) -> None:
        self._ended[transfer_id] = (fate, now)
        self._ended.move_to_end(transfer_id)
        while self._ended and (len(self._ended) > MAX_ENDED or next(iter(self._ended.values()))[1] + self.lease_s < now):
            self._ended.popitem(last=False)

    def _release_handle(self, send: Send) -> bool:
        try:
            self.t._release(send.handle)
        except Exception as e:  # still active and the transport cannot abort it
            logger.warning("push of %s: handle not released: %s", send.transfer_id, e)
            return False
        send.handle = None
        return True

    def _tell_failed(self, target: Target, transfer_id: str, error: str) -> None:
        self.clients.get(target.address).send(
            {"type": "push_failed", "engine_id": self.t.engine_id, "boot_id": target.boot_id,
             "transfers": [{"transfer_id": transfer_id, "request_id": target.request_id, "error": error}]},
            on_reply=lambda *_: None)

    # ---- peers (P → D: the handshake that gives P D's memory) ----
    def _peer(self, target: Target, now: float) -> DPeer:
        key = (target.engine_id, target.boot_id)
        peer = self.peers.get(key)
        if peer is not None and (peer.remote is not None or peer.is_failed or now <= peer.deadline):
            peer.last_used = now
            return peer
        if peer is not None:
            self._drop_peer(peer)
        peer = self.peers[key] = DPeer(key, target.address, now + self.lease_s, last_used=now)

        def on_error(cause: str) -> None:
            peer.is_failed = True
            peer.error = cause if "remote engine" in cause else \
                f"handshake with the decode instance {target.engine_id} failed: {cause}"
        self.clients.get(peer.address).send(
            {"type": "handshake", "engine_id": self.t.engine_id, "compat_hash": self.t.compat_hash},
            on_reply=lambda reply, blob, _: self._on_handshake(peer, reply, blob), on_error=on_error,
            accept_refusal=True)
        return peer

    def _on_handshake(self, peer: DPeer, reply: dict[str, Any], blob: bytes) -> None:
        if self.peers.get(peer.key) is not peer:
            return
        remote = self.t._parse_handshake(peer.key[0], reply, blob)  # raises: on_error fails the peer
        if reply.get("boot_id") != peer.key[1]:
            raise RuntimeError("the decode instance restarted since it announced its blocks")
        self.t._connect(remote)
        peer.remote = remote

    def _drop_peer(self, peer: DPeer) -> None:
        if self.peers.get(peer.key) is peer:
            del self.peers[peer.key]
        if peer.remote is not None:
            try:
                self.t._disconnect(peer.remote)
            except Exception as e:
                logger.warning("disconnecting from decode instance %s failed: %s", peer.key[0], e)
            peer.remote = None

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + 1.0
        with self._lock:
            targets = [send.target for send in self.sends.values() if send.target is not None]
        in_use = {(target.engine_id, target.boot_id) for target in targets}
        for peer in list(self.peers.values()):
            if peer.key not in in_use and (peer.is_failed or now - peer.last_used > PEER_IDLE_S):
                self._drop_peer(peer)
        self.clients.sweep({target.address for target in targets}, PEER_IDLE_S)

    def _apply_event(self, event: tuple) -> None:
        client, message, handler, on_error, args = event
        client.num_pending -= 1
        if handler is None:
            return
        try:
            handler(*args)
        except Exception as e:  # a malformed reply or a failed connect: what waited on it fails
            logger.warning("%s reply from %s:%d: %s: %s", message["type"], *client.address, type(e).__name__, e)
            if on_error is not None:
                on_error(str(e) if isinstance(e, RuntimeError) else f"a malformed reply ({type(e).__name__})")

    # ---- side-channel threads ----
    def _fate_locked(self, transfer_id: str) -> str:
        send = self.sends.get(transfer_id)
        if send is not None:
            return send.state.value
        return self._ended.get(transfer_id, ("unknown",))[0]

    def on_announce(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("boot_id") != self.t.boot_id:
            return {"ok": True, "boot_id": self.t.boot_id,
                    "results": {str(a.get("transfer_id")): "stale_boot" for a in message.get("transfers") or []}}
        engine_id, d_boot = message.get("engine_id"), message.get("d_boot_id")
        host, port = message.get("host"), message.get("port")
        if not (isinstance(engine_id, str) and isinstance(d_boot, str) and isinstance(host, str)
                and isinstance(port, int) and 0 < port < 65536):
            raise ValueError("announce: engine_id, d_boot_id, host and port are required")
        results, now = {}, self.clock()
        with self._lock:
            for item in message.get("transfers") or []:
                transfer_id, block_ids, first = item.get("transfer_id"), item.get("block_ids"), item.get("first_block")
                if not (isinstance(transfer_id, str) and isinstance(item.get("request_id"), str)
                        and isinstance(block_ids, list) and block_ids
                        and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids)
                        and isinstance(first, int) and not isinstance(first, bool) and first >= 0):
                    raise ValueError("announce: each transfer needs transfer_id, request_id, block_ids, first_block")
                target = Target(engine_id, d_boot, (host, port), item["request_id"], list(block_ids), first)
                results[transfer_id] = self._announce_locked(transfer_id, target, now)
        return {"ok": True, "boot_id": self.t.boot_id, "results": results}

    def _announce_locked(self, transfer_id: str, target: Target, now: float) -> str:
        if transfer_id in self._ended:
            return self._ended[transfer_id][0]
        send = self.sends.get(transfer_id)
        if send is None:
            if len(self.sends) >= MAX_SENDS:
                return "busy"
            send = self.sends[transfer_id] = Send(transfer_id, now + self.lease_s)
        if send.target is not None and send.target != target:
            return "duplicate"  # one transfer, one D: a replay to a second D is refused
        send.target = target
        send.deadline = max(send.deadline, now + self.lease_s) if send.state == SendState.WAITING else send.deadline
        return "accepted"

    def on_heartbeat(self, message: dict[str, Any]) -> dict[str, Any]:
        """D's heartbeat: refresh WAITING transfers, answer every id's state or fate."""
        ids = [t for t in message.get("transfer_ids") or [] if isinstance(t, str)]
        if message.get("boot_id") != self.t.boot_id:
            return {"ok": True, "boot_id": self.t.boot_id, "states": {t: "stale_boot" for t in ids}}
        deadline, states = self.clock() + self.lease_s, {}
        with self._lock:
            for transfer_id in ids:
                send = self.sends.get(transfer_id)
                if send is not None and send.state == SendState.WAITING:
                    send.deadline = max(send.deadline, deadline)
                states[transfer_id] = self._fate_locked(transfer_id)
        return {"ok": True, "boot_id": self.t.boot_id, "states": states}

    def on_release(self, message: dict[str, Any]) -> dict[str, Any]:
        ids = [t for t in message.get("transfer_ids") or [] if isinstance(t, str)]
        if message.get("boot_id") != self.t.boot_id:
            return {"ok": True, "boot_id": self.t.boot_id, "states": {t: "stale_boot" for t in ids}}
        return {"ok": True, "boot_id": self.t.boot_id, "states": self.release(ids)}

    def release(self, transfer_ids: list[str]) -> dict[str, str]:
        """D's request ended, or the router's D never took it: end WAITING transfers now (and ones not seen
        yet: their blocks are freed when they come); a WRITE in flight runs on ("writing")."""
        now, states = self.clock(), {}
        with self._lock:
            for transfer_id in transfer_ids:
                send = self.sends.get(transfer_id)
                if send is not None and send.state != SendState.WAITING:
                    states[transfer_id] = send.state.value
                    continue
                if send is not None:
                    del self.sends[transfer_id]
                    if send.request_id is not None:
                        self._to_free.add(send.request_id)
                if transfer_id not in self._ended:
                    self._end_locked(transfer_id, "released", now)
                states[transfer_id] = self._ended[transfer_id][0]
        return states

    def num_pending(self) -> int:
        """P's requests whose blocks this side still holds (or is about to free)."""
        with self._lock:
            return sum(send.request_id is not None for send in self.sends.values()) + len(self._to_free)

    def num_blocks_held(self) -> int:
        with self._lock:
            return sum(len(s.block_ids) for s in self.sends.values() if s.block_ids is not None)

    def shutdown(self) -> None:
        self.clients.close()
        for send in list(self.sends.values()):
            if send.handle is not None:
                self._release_handle(send)
        for peer in list(self.peers.values()):
            self._drop_peer(peer)


# ---- D: the receiver -------------------------------------------------------------------------------

class RecvState(Enum):
    QUEUED = "queued"             # keep-alive only: the request waits here for blocks
    ANNOUNCING = "announcing"
    WAITING = "waiting"
    RELEASING = "releasing"       # aborted here, or the router said P failed: waiting for P to confirm
    QUARANTINED = "quarantined"   # P went silent: held until nothing P started can still land


@dataclass
class Recv:
    spec: PushRecvSpec | KeepAliveSpec
    state: RecvState
    is_announce_queued: bool = False
    is_cancelled: bool = False       # its request was aborted: report without an error
    error: str = ""                  # why its load fails (the router's word, or P's silence)
    announced_at: float = 0.0
    confirmed_at: float = 0.0        # the last reply in which P held or expected the transfer
    last_sent: float = 0.0           # the last message P may have refreshed the announce with
    safe_at: float = float("inf")    # QUARANTINED: reported then
    last_probe: float = 0.0          # QUARANTINED: the last release sent to settle it

    @property
    def transfer_id(self) -> str:
        return self.spec.transfer_id if isinstance(self.spec, PushRecvSpec) else self.spec.remote_request_id

    @property
    def is_reported(self) -> bool:
        return isinstance(self.spec, PushRecvSpec)

    @property
    def p_address(self) -> tuple[str, int]:
        return self.spec.remote_host, self.spec.remote_port


class Receiver:
    """D: every request whose KV a P pushes, from its keep-alive to its report. Engine thread only; the
    side-channel clients and server hand replies and push_failed messages over through self._events."""

    def __init__(self, transport: Any, config: KVTransferConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.t, self.config, self.clock = transport, config, clock
        self.lease_s = config.lease_seconds
        self.write_timeout = write_timeout(config)
        self.wait_timeout = float(config.extra.get("push_wait_timeout_seconds", max(60.0, 2 * config.lease_seconds)))
        self.timeout = min(MAX_SIDE_CHANNEL_S, config.lease_seconds / 2)
        self.recvs: dict[str, Recv] = {}
        self._by_transfer: dict[str, Recv] = {}
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.clients = side_channel.PeerClients(config.auth_key, self.timeout, self._events, clock)
        self._finished: set[str] = set()
        self._next_heartbeat = self._next_sweep = 0.0
        self.num_failures = self.num_quarantined = 0

    # ---- the scheduler's meta ----
    def apply(self, meta: PushConnectorMeta) -> None:
        now = self.clock()
        was_waiting = bool(self.recvs)
        for keep in meta.reqs_to_keep_alive:
            if keep.request_id not in self.recvs:
                self._track(Recv(keep, RecvState.QUEUED, confirmed_at=now))
        for keep in meta.reqs_to_release:  # finished, aborted or covered by D's cache before its load
            recv = self.recvs.get(keep.request_id)
            if recv is not None and recv.spec == keep:
                self._forget(recv)
            self._send_release([keep.remote_request_id], keep.remote_host, keep.remote_port, keep.remote_boot_id)
        for spec in meta.reqs_to_recv:
            old = self.recvs.get(spec.request_id)
            if old is not None and not old.is_reported:
                self._forget(old)
            self._track(Recv(spec, RecvState.ANNOUNCING, is_announce_queued=True, confirmed_at=now))
        if not was_waiting and self.recvs:
            self._next_heartbeat = now + self.config.heartbeat_seconds
        for request_id in meta.reqs_to_cancel:
            recv = self.recvs.get(request_id)
            if recv is None or not recv.is_reported:
                self._finished.add(request_id)  # unknown here: report it so the scheduler never waits
            elif recv.state == RecvState.ANNOUNCING and recv.is_announce_queued:
                self._end(recv)  # never sent: nothing will write
            elif recv.state != RecvState.QUARANTINED:
                recv.is_cancelled = True
                self._releasing(recv, "")

    def abandon(self, transfer_ids: list[str]) -> None:
        """The router's word: the prefill hop failed. Release the transfer at P and report the load failed
        once P confirms that nothing writes (kv_load_failure_policy then applies)."""
        for transfer_id in transfer_ids:
            recv = self._by_transfer.get(transfer_id)
            if recv is None:
                continue
            if not recv.is_reported:  # still queued: its load will find nothing (P released it)
                self._send_release([transfer_id], *recv.p_address, recv.spec.remote_boot_id)
                recv.is_cancelled = True   # (a keep-alive has nothing to report)
            elif recv.state == RecvState.ANNOUNCING and recv.is_announce_queued:
                self._end(recv, "the prefill instance failed before computing the prompt")
            elif recv.state in (RecvState.ANNOUNCING, RecvState.WAITING):
                self._releasing(recv, "the prefill instance failed before computing the prompt")

    # ---- each step ----
    def step(self, notified: list[str]) -> set[str]:
        while not self._events.empty():
            self._apply_event(self._events.get_nowait())
        for transfer_id in notified:  # the WRITE is done: its data is in the blocks
            recv = self._by_transfer.get(transfer_id)
            if recv is not None and recv.is_reported:
                self._end(recv)
        if self.recvs:
            now = self.clock()
            self._send_announces(now)
            for recv in list(self.recvs.values()):
                self._advance(recv, now)
            if now >= self._next_heartbeat:
                self._heartbeat(now)
        self._sweep()
        finished, self._finished = self._finished, set()
        return finished

    def _advance(self, recv: Recv, now: float) -> None:
        if recv.state == RecvState.QUARANTINED:
            if now >= recv.safe_at:
                self._end(recv, recv.error)
            elif now >= recv.last_probe + self.config.heartbeat_seconds:
                # A release, never a heartbeat: it cannot refresh the announce at P (which would move the
                # bound), and any answer settles the transfer.
                recv.last_probe = now
                self._send_release_of(recv)
        elif recv.state in (RecvState.WAITING, RecvState.RELEASING) and now - recv.confirmed_at > self.lease_s:
            self._quarantine(recv, "the prefill instance stopped answering")
        elif recv.state == RecvState.WAITING and now - recv.announced_at > self.wait_timeout:
            self._releasing(recv, f"the prefill instance did not write this request's KV within {self.wait_timeout:g}s")

    def _quarantine(self, recv: Recv, error: str) -> None:
        """P is silent: hold the blocks until no WRITE it could have started can land."""
        logger.warning("push of %s from %s: %s; holding its blocks until nothing can write them",
                       recv.transfer_id, recv.spec.remote_engine_id, error)
        self.num_quarantined += 1
        recv.state, recv.last_probe = RecvState.QUARANTINED, self.clock()
        recv.safe_at = recv.last_sent + self.lease_s + self.write_timeout + SAFETY_MARGIN_S
        recv.error = recv.error or error

    def _releasing(self, recv: Recv, error: str) -> None:
        recv.state, recv.error = RecvState.RELEASING, recv.error or error
        self._send_release_of(recv)

    def _send_release_of(self, recv: Recv) -> None:
        """Ask P to end the transfer; its answer (or a refused connection) settles it."""
        self.clients.get(recv.p_address).send(
            {"type": "release", "engine_id": self.t.engine_id, "boot_id": recv.spec.remote_boot_id,
             "transfer_ids": [recv.transfer_id]},
            on_reply=lambda reply, _, at: self._on_states([recv], reply, at),
            on_error=lambda cause: self._on_error([recv], cause))

    def _end(self, recv: Recv, error: str | None = None) -> None:
        """The one way out: report (with its blocks invalid on an error) and forget."""
        if error and not recv.is_cancelled:
            self.num_failures += 1
            self.t._load_failed(recv, error, list(recv.spec.local_block_ids))
        self._forget(recv)
        self._finished.add(recv.spec.request_id)

    def _track(self, recv: Recv) -> None:
        self.recvs[recv.spec.request_id] = recv
        self._by_transfer[recv.transfer_id] = recv

    def _forget(self, recv: Recv) -> None:
        if self.recvs.get(recv.spec.request_id) is recv:
            del self.recvs[recv.spec.request_id]
        if self._by_transfer.get(recv.transfer_id) is recv:
            del self._by_transfer[recv.transfer_id]

    # ---- messages to P ----
    def _send_announces(self, now: float) -> None:
        by_p: dict[tuple[str, int, str | None], list[Recv]] = {}
        for recv in self.recvs.values():
            if recv.is_announce_queued:
                recv.is_announce_queued = False
                by_p.setdefault((*recv.p_address, recv.spec.remote_boot_id), []).append(recv)
        for (host, port, boot_id), recvs in by_p.items():
            for recv in recvs:
                recv.announced_at = recv.last_sent = now
            self.clients.get((host, port)).send(
                {"type": "announce", "engine_id": self.t.engine_id, "boot_id": boot_id, "d_boot_id": self.t.boot_id,
                 "host": self.t.side_channel_host, "port": self.t.side_channel_port,
                 "transfers": [{"transfer_id": r.transfer_id, "request_id": r.spec.request_id,
                                "block_ids": r.spec.local_block_ids, "first_block": r.spec.first_block}
                               for r in recvs]},
                on_reply=lambda reply, _, at, recvs=recvs: self._on_announce(recvs, reply, at),
                on_error=lambda cause, recvs=recvs: self._on_error(recvs, cause))

    def _on_announce(self, recvs: list[Recv], reply: dict[str, Any], sent_at: float) -> None:
        results = reply.get("results") or {}
        for recv in recvs:
            if self.recvs.get(recv.spec.request_id) is not recv:
                continue
            result = results.get(recv.transfer_id, "unknown")
            if result == "accepted":
                recv.confirmed_at = self.clock()
                if recv.state == RecvState.ANNOUNCING:
                    recv.state = RecvState.WAITING
            else:
                self._refused(recv, result)

    _REFUSALS = {
        "stale_boot": "the prefill instance restarted since the router sent it this request",
        "failed": "the prefill instance did not compute or write this request's KV",
        "expired": "the prefill instance's hold on this request's KV expired",
        "released": "the prefill instance already released this request's KV",
        "unknown": "the prefill instance does not know this request's KV transfer",
        "duplicate": "another decode instance announced blocks for this request's KV transfer",
        "busy": "the prefill instance holds too many transfers",
    }

    def _refused(self, recv: Recv, result: str) -> None:
        """P will not write (it said so under its lock): the blocks may go back at once."""
        self._end(recv, recv.error or self._REFUSALS.get(result, f"the prefill instance refused the transfer ({result!r})"))

    def _heartbeat(self, now: float) -> None:
        self._next_heartbeat = now + self.config.heartbeat_seconds
        groups: dict[tuple[str, int, str | None], list[Recv]] = {}
        for recv in self.recvs.values():
            if recv.state in (RecvState.QUEUED, RecvState.WAITING, RecvState.RELEASING) or (
                    recv.state == RecvState.ANNOUNCING and not recv.is_announce_queued):
                groups.setdefault((*recv.p_address, recv.spec.remote_boot_id), []).append(recv)
        for (host, port, boot_id), recvs in groups.items():
            client = self.clients.get((host, port))
            if client.num_heartbeats_pending:  # the last one has not come back: skip, never queue up
                continue
            for recv in recvs:
                recv.last_sent = now
            client.send({"type": "heartbeat", "engine_id": self.t.engine_id, "boot_id": boot_id,
                         "transfer_ids": [r.transfer_id for r in recvs]},
                        on_reply=lambda reply, _, at, recvs=recvs: self._on_states(recvs, reply, at),
                        on_error=lambda cause, recvs=recvs: self._on_error(recvs, cause))

    def _on_states(self, recvs: list[Recv], reply: dict[str, Any], sent_at: float) -> None:
        states = reply.get("states") or {}
        for recv in recvs:
            if self.recvs.get(recv.spec.request_id) is not recv:
                continue
            state = states.get(recv.transfer_id, "unknown")
            if not recv.is_reported:  # queued here: P's copy may not be there yet ("unknown"); a refusal
                continue             # comes again, with its reason, when its load announces
            if state in ("waiting", "writing", "quarantined", "written"):
                if recv.state != RecvState.QUARANTINED:  # (a quarantined one waits for its notification or bound)
                    recv.confirmed_at = self.clock()
                if recv.state == RecvState.RELEASING and state == "waiting":
                    self._send_release_of(recv)  # the release was lost: P still holds it
            elif state in NEVER_WRITTEN or state == "busy":
                self._refused(recv, state)

    def _on_error(self, recvs: list[Recv], cause: str) -> None:
        for recv in recvs:
            if self.recvs.get(recv.spec.request_id) is not recv or not recv.is_reported:
                continue
            if "refused the connection" in cause:  # no process listens at P's side channel: P is gone
                self._end(recv, recv.error or "the prefill instance is gone (its side channel refused the connection)")
            elif recv.state in (RecvState.ANNOUNCING, RecvState.RELEASING):
                # it may have reached P: P may write until the announce and the WRITE time out
                recv.last_sent = self.clock()
                self._quarantine(recv, f"the prefill instance did not answer ({cause})")

    def _send_release(self, transfer_ids: list[str], host: str, port: int, boot_id: str | None) -> None:
        self.clients.get((host, port)).send(
            {"type": "release", "engine_id": self.t.engine_id, "boot_id": boot_id, "transfer_ids": transfer_ids},
            on_reply=lambda *_: None)

    # ---- P's messages (server threads put them here) ----
    def on_push_failed(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("boot_id") == self.t.boot_id:
            self._events.put((None, message, self._apply_push_failed, None, (message,)))
        return {"ok": True}

    def _apply_push_failed(self, message: dict[str, Any]) -> None:
        for item in message.get("transfers") or []:
            recv = self._by_transfer.get(item.get("transfer_id")) if isinstance(item, dict) else None
            if recv is not None and recv.is_reported and recv.spec.remote_engine_id == message.get("engine_id"):
                error = item.get("error")
                self._end(recv, recv.error or (error if isinstance(error, str) and error else
                                               "the prefill instance could not write this request's KV"))

    def _apply_event(self, event: tuple) -> None:
        client, message, handler, on_error, args = event
        if client is not None:
            client.num_pending -= 1
            client.num_heartbeats_pending -= message["type"] == "heartbeat"
        if handler is None:
            return
        try:
            handler(*args)
        except Exception as e:
            logger.warning("%s from the prefill side: %s: %s", message.get("type"), type(e).__name__, e)
            if on_error is not None:
                on_error(f"a malformed reply ({type(e).__name__})")

    def _sweep(self) -> None:
        now = self.clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + 1.0
        self.clients.sweep({recv.p_address for recv in self.recvs.values()}, PEER_IDLE_S)

    def num_pending(self) -> int:
        return sum(recv.is_reported for recv in self.recvs.values()) + len(self._finished)

    def shutdown(self) -> None:
        self.clients.close()
        self.recvs, self._by_transfer = {}, {}
