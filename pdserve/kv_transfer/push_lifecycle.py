"""The push handoff's lifecycle: P's Pusher and D's Receiver, one record per transfer id, one state each.

Pull's danger is a READ of blocks P freed (D gets garbage and says so); push's is a WRITE into blocks D
freed and gave to another request, which would corrupt that request silently. So the rule every state of
this module keeps: D gives a transfer's blocks back only when no WRITE can land in them any more, i.e. when

  - P's notification for the transfer arrived (the WRITE is done), or
  - P said so: a push_failed message (sent only once nothing writes), or a reply naming the transfer
    released, failed, expired or (to a transfer P accepted the announce of) unknown, each decided under
    P's lock, after which P never writes it; or a reply from another boot of P (the boot that had it is
    gone), or P's side channel refusing the connection (no process listens there), or
  - P said "written" NOTIF_GRACE_S ago and no notification came (one that D cannot read, or lost): the
    load fails (nothing vouches for the data), or
  - P has been silent long enough that any WRITE it could have started is over: P writes only for an
    announce it holds, an announce lives one lease past the last message from D that refreshed it, and P
    aborts a WRITE past its write timeout at its next engine step; so after last_sent + lease + write
    timeout + a margin of max(2 s, one lease) for P's step nothing more can come (P's own lease and write
    timeout, from its announce reply, when they are longer than D's). D reports the load failed then, and
    holds the blocks QUARANTINED until that moment, probing P with releases (which refresh nothing). A P
    that says it cannot abort its WRITE ("quarantined") is waited for without a bound: only its word, its
    notification or its death free the blocks.

On P (producer), per transfer (a Send), states WAITING → WRITING (→ QUARANTINED) → an ended fate:
  - the request's blocks (its PushSendSpec) and D's announce (block ids, first block, D's side channel)
    arrive in either order; an announce may come before P has even received the request over HTTP
  - WAITING has a deadline one lease ahead, moved by every announce or heartbeat from D (D's keep-alive
    while its request queues without blocks, and its waits afterwards); past it the Send expires: its
    blocks are freed, the D it knows is told
  - with both halves: handshake with that D boot (once; a failed handshake is tried again after
    PEER_RETRY_S), then one WRITE (one descriptor per coalesced run; its notification names the transfer
    id and carries the token P sampled after the prompt, write_notif) under
    write_timeout; done → "written"; an error, a refusal or the deadline → "failed" and a push_failed
    message to D once nothing writes (a WRITE the transport cannot abort stays QUARANTINED, P's blocks held)
  - a release from D (its request ended, or the router's) ends a WAITING Send at once ("released"); a
    writing one answers "writing" and D waits for the notification or push_failed; a release for an id P
    does not know leaves a tombstone (bounded, one lease), so an announce or a send arriving later is
    refused or freed at once
  - fates are kept one lease for late messages: a heartbeat or release then gets the fate, not "unknown"
On D (consumer), per request (a Recv): QUEUED (keep-alive: heartbeats extend P's hold) → ANNOUNCING →
WAITING → reported; RELEASING when its request was aborted or the router said P failed; QUARANTINED when P
went silent. A WAITING transfer lasts at most wait_timeout (P's queue may be long; D's blocks are held
for it meanwhile), then D releases it. One live request per transfer id on each side: a second is refused.
Threads: the side-channel server threads touch P's Sends under the Pusher's lock and put D's incoming
push_failed messages on the Receiver's event queue; transport calls run on the engine thread only.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, NamedTuple

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.pull import KeepAliveSpec
from pdserve.kv_transfer.push import PushConnectorMeta, PushRecvSpec
from pdserve.kv_transfer.transport_worker import RemoteEngine

logger = logging.getLogger(__name__)

MAX_SIDE_CHANNEL_S = 5.0   # one side-channel exchange, at most (and at most half a lease)
SAFETY_MARGIN_S = 2.0      # at least this (and at least a lease) added to a silent P's bound
MAX_ENDED = 1 << 16        # fates remembered (one lease period)
MAX_TOMBSTONES = 1 << 12   # P: releases for ids it did not know (one lease period)
MAX_SENDS = 1 << 15        # P: live transfers, announce-only ones included (more are answered "busy")
MAX_PEERS = 256            # P: distinct D side channels its live transfers name (more: "busy")
MAX_IDS_PER_MESSAGE = 1 << 12
MAX_TP_SIZE = 1 << 10      # (what a notification may claim)
MAX_ABANDONED = 1 << 12    # D: the router's releases for transfers not here yet (one lease period)
PEER_IDLE_S = 60.0
PEER_RETRY_S = 1.0         # P: a failed handshake with a D is tried again after this
NOTIF_GRACE_S = 10.0       # D: how long after P said "written" its notification may still come
# What P answers for a transfer it will never write (D may give the blocks back at once).
NEVER_WRITTEN = ("released", "failed", "expired", "unknown", "stale_boot", "busy", "duplicate")
ALIVE = ("waiting", "writing", "quarantined", "written")


NOTIF_FORMAT = 2   # write_notif's (1: the bare transfer id, before session 48)


class WriteNotif(NamedTuple):
    transfer_id: str
    first_token_ids: list[int]
    rank: int      # the P rank that wrote, of tp_size (a tensor-parallel D counts every rank's)
    tp_size: int


def write_notif(transfer_id: str, first_token_ids: tuple[int, ...] | list[int] = (), rank: int = 0,
                tp_size: int = 1) -> str:
    """A WRITE's notification, which D's transport delivers once the data is in D's blocks: the transfer id,
    P's first token and the writing rank (JSON: a transfer id may hold any character)."""
    return json.dumps([transfer_id, list(first_token_ids), rank, tp_size])


def read_notif(message: str) -> WriteNotif | None:
    """A write_notif message's fields; None for anything else."""
    try:
        value = json.loads(message)
    except ValueError:
        return None
    if not (isinstance(value, list) and len(value) == 4 and isinstance(value[0], str)
            and isinstance(value[1], list) and len(value[1]) <= 1
            and all(type(t) is int and t >= 0 for t in value[1])
            and type(value[2]) is int and type(value[3]) is int and 0 <= value[2] < value[3] <= MAX_TP_SIZE):
        return None
    return WriteNotif(*value)


def write_timeout(config: KVTransferConfig) -> float:
    return float(config.extra.get("write_timeout_seconds", max(60.0, 2 * config.lease_seconds)))


def _ids(message: dict[str, Any], key: str) -> list[str]:
    ids = message.get(key) or []
    if not isinstance(ids, list) or len(ids) > MAX_IDS_PER_MESSAGE:
        raise ValueError(f"{key}: a list of at most {MAX_IDS_PER_MESSAGE} ids")
    return [i for i in ids if isinstance(i, str)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _remember(entries: OrderedDict, key: str, value: Any, now: float, ttl: float, max_entries: int) -> None:
    entries[key] = (value, now)
    entries.move_to_end(key)
    while entries and (len(entries) > max_entries or next(iter(entries.values()))[1] + ttl < now):
        entries.popitem(last=False)


# ---- P: the pusher ---------------------------------------------------------------------------------

class SendState(Enum):
    WAITING = "waiting"
    WRITING = "writing"
    QUARANTINED = "quarantined"   # the transport could not abort the WRITE (yet): P's blocks stay


@dataclass(frozen=True)
class Target:
    """D's announce: where a transfer's blocks go."""
    engine_id: str
    boot_id: str
    address: tuple[str, int]
    request_id: str           # D's request (for D's own bookkeeping)
    block_ids: tuple[int, ...]
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
    first_token_ids: tuple[int, ...] = ()   # what P sampled after the prompt: in the notification
    is_token_told: bool = False             # ... and sent to D over the side channel as soon as both are known


@dataclass
class DPeer:
    """P's connection to one boot of one D."""
    key: tuple[str, str]
    address: tuple[str, int]
    deadline: float
    remote: RemoteEngine | None = None
    is_failed: bool = False
    failed_at: float = 0.0
    error: str = ""
    last_used: float = 0.0


class Pusher:
    """P: every transfer this instance writes. Engine thread: apply(), step(); side-channel threads:
    on_announce, on_heartbeat, on_release, all under self._lock."""

    def __init__(self, transport: Any, config: KVTransferConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.t, self.config, self.clock = transport, config, clock  # t: push_worker's hooks
        self.lease_s = config.lease_seconds
        self.write_timeout = write_timeout(config)
        self.timeout = min(MAX_SIDE_CHANNEL_S, config.lease_seconds / 2)
        self._lock = threading.Lock()
        self.sends: dict[str, Send] = {}
        self._ended: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._tombstones: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._addresses: dict[tuple[str, int], int] = {}   # live Sends per D side channel
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
                send = self.sends.get(spec.transfer_id)
                if (send is None and self._fate_locked(spec.transfer_id) != "unknown") or (
                        send is not None and send.request_id not in (None, spec.request_id)):
                    self._to_free.add(spec.request_id)  # released before P computed it, or a second request
                    continue                             # with this transfer id: its blocks go back at once
                if send is None:
                    send = self.sends[spec.transfer_id] = Send(spec.transfer_id, now + self.lease_s)
                send.request_id, send.block_ids = spec.request_id, list(spec.block_ids)
                send.first_token_ids = tuple(spec.first_token_ids)
                send.deadline = max(send.deadline, now + self.lease_s)
                self._tell_first_token_locked(send)
            for request_id, transfer_id in meta.reqs_not_sent:  # P's request ended without KV
                send = self.sends.get(transfer_id)
                if send is not None and (send.request_id not in (None, request_id) or send.state != SendState.WAITING):
                    continue  # another request's transfer (refused at admission): not this one's to end
                if send is not None:
                    self._remove_locked(send)
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
                self._tell_first_token_locked(send)   # (an announce that came after P's prefill)
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
        if first + n > len(send.block_ids):
            return self._fail(send, f"the decode instance asked for prompt blocks [{first}, {first + n}) of "
                                    f"{len(send.block_ids)}", finished, now)
        local_ids = send.block_ids[first:first + n]
        with self._lock:
            if self.sends.get(send.transfer_id) is not send or send.state != SendState.WAITING:
                return  # released meanwhile
            send.state, send.deadline = SendState.WRITING, now + self.write_timeout
        send.posted_at = self.clock()  # (the step's `now` may be long past: a WRITE can be done at once)
        try:
            send.handle, state, send.num_descriptors, send.num_bytes = self.t._post_write(
                send.transfer_id, local_ids, list(target.block_ids), peer.remote, send.first_token_ids)
        except Exception as e:  # nothing posted
            logger.warning("push of %s: posting the WRITE to %s failed: %s", send.transfer_id, target.engine_id, e)
            return self._fail(send, str(e) if isinstance(e, ValueError) else "the transfer could not be posted",
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
            self._abort(send, finished, now)
        elif send.state == SendState.QUARANTINED:
            self._abort(send, finished, now)

    def _abort(self, send: Send, finished: set[str], now: float) -> None:
        """Let the transfer go; one the transport cannot abort stays QUARANTINED (D is told "quarantined")."""
        if self._release_handle(send):
            return self._fail(send, send.error or "transfer error", finished, now)
        if send.state != SendState.QUARANTINED:
            self.num_quarantined += 1
            with self._lock:
                send.state = SendState.QUARANTINED

    def _complete(self, send: Send, state: str, finished: set[str], now: float) -> None:
        if state != "DONE":
            send.error = send.error or "transfer error"
            return self._abort(send, finished, now)
        self._release_handle(send)  # (a finished transfer: nothing of it can write any more)
        self.t._count_write(send, self.clock() - send.posted_at)
        with self._lock:
            self._finish_locked(send, "written", finished, now)

    def _fail(self, send: Send, error: str, finished: set[str], now: float) -> None:
        """Nothing writes for it (any more): tell D, free P's blocks."""
        self.num_failures += 1
        with self._lock:
            self._finish_locked(send, "failed", finished, now, error)

    def _finish_locked(self, send: Send, fate: str, finished: set[str], now: float, error: str = "") -> None:
        self._remove_locked(send)
        self._end_locked(send.transfer_id, fate, now)
        if send.request_id is not None:
            finished.add(send.request_id)
        if fate != "written" and send.target is not None:
            self._tell_failed(send.target, send.transfer_id, error)

    def _remove_locked(self, send: Send) -> None:
        if self.sends.get(send.transfer_id) is send:
            del self.sends[send.transfer_id]
            if send.target is not None:
                self._count_address_locked(send.target.address, -1)

    def _count_address_locked(self, address: tuple[str, int], delta: int) -> None:
        count = self._addresses.get(address, 0) + delta
        if count > 0:
            self._addresses[address] = count
        else:
            self._addresses.pop(address, None)

    def _end_locked(self, transfer_id: str, fate: str, now: float) -> None:
        _remember(self._ended, transfer_id, fate, now, self.lease_s, MAX_ENDED)

    def _release_handle(self, send: Send) -> bool:
        try:
            self.t._release(send.handle)
        except Exception as e:  # still active and the transport cannot abort it
            logger.warning("push of %s: handle not released: %s", send.transfer_id, e)
            return False
        send.handle = None
        return True

    def _tell_first_token_locked(self, send: Send) -> None:
        """P's token to D as soon as P has sampled it and knows D, ahead of the KV: D sends it to the client
        at once, as a pull D does on admission (the WRITE's notification carries it again, should this
        message be lost). Fire and forget; engine thread only (self.clients is not shared with the side
        channel's server threads)."""
        if send.is_token_told or not send.first_token_ids or send.target is None:
            return
        send.is_token_told = True
        target = send.target
        self.clients.get(target.address).send(
            {"type": "first_token", "engine_id": self.t.engine_id, "boot_id": target.boot_id,
             "transfer_id": send.transfer_id, "token_ids": list(send.first_token_ids)},
            on_reply=lambda *_: None)

    def _tell_failed(self, target: Target, transfer_id: str, error: str) -> None:
        self.clients.get(target.address).send(
            {"type": "push_failed", "engine_id": self.t.engine_id, "boot_id": target.boot_id,
             "transfers": [{"transfer_id": transfer_id, "request_id": target.request_id, "error": error}]},
            on_reply=lambda *_: None)

    # ---- peers (P → D: the handshake that gives P D's memory) ----
    def _peer(self, target: Target, now: float) -> DPeer:
        key = (target.engine_id, target.boot_id)
        peer = self.peers.get(key)
        if peer is not None and (peer.remote is not None or (peer.is_failed and now < peer.failed_at + PEER_RETRY_S)
                                 or (not peer.is_failed and now <= peer.deadline)):
            peer.last_used = now
            return peer
        if peer is not None:
            self._drop_peer(peer)
        peer = self.peers[key] = DPeer(key, target.address, now + self.lease_s, last_used=now)

        def on_error(cause: str) -> None:
            peer.is_failed, peer.failed_at = True, self.clock()
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
        self.t.connect_remote(remote)
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
        for fates in (self._ended, self._tombstones):
            if transfer_id in fates:
                return fates[transfer_id][0]
        return "unknown"

    def _reply(self, **fields: Any) -> dict[str, Any]:
        """Every answer names P's boot and the bounds D's safety rule needs."""
        return {"ok": True, "boot_id": self.t.boot_id, "lease_seconds": self.lease_s,
                "write_timeout_seconds": self.write_timeout, **fields}

    def on_announce(self, message: dict[str, Any]) -> dict[str, Any]:
        items = message.get("transfers") or []
        if not isinstance(items, list) or len(items) > MAX_IDS_PER_MESSAGE:
            raise ValueError(f"announce: transfers must be a list of at most {MAX_IDS_PER_MESSAGE}")
        engine_id, d_boot = message.get("engine_id"), message.get("d_boot_id")
        host, port = message.get("host"), message.get("port")
        if not (isinstance(engine_id, str) and isinstance(d_boot, str) and isinstance(host, str)
                and _is_int(port) and 0 < port < 65536):
            raise ValueError("announce: engine_id, d_boot_id, host and port are required")
        max_blocks = self.t.num_blocks() or 1 << 16
        targets: dict[str, Target] = {}
        for item in items:  # all checked before any is applied
            transfer_id = item.get("transfer_id") if isinstance(item, dict) else None
            block_ids, first = (item.get("block_ids"), item.get("first_block")) if isinstance(item, dict) else (None, None)
            if not (isinstance(transfer_id, str) and isinstance(item.get("request_id"), str)
                    and isinstance(block_ids, list) and 0 < len(block_ids) <= max_blocks
                    and all(_is_int(b) and b >= 0 for b in block_ids) and _is_int(first) and 0 <= first < max_blocks):
                raise ValueError("announce: each transfer needs transfer_id, request_id, block_ids (at most the "
                                 "cache's blocks), first_block")
            if transfer_id in targets:
                raise ValueError(f"announce: transfer {transfer_id} named twice")
            targets[transfer_id] = Target(engine_id, d_boot, (host, port), item["request_id"], tuple(block_ids), first)
        if message.get("boot_id") != self.t.boot_id:
            return self._reply(results={t: "stale_boot" for t in targets})
        now = self.clock()
        with self._lock:
            return self._reply(results={t: self._announce_locked(t, target, now) for t, target in targets.items()})

    def _announce_locked(self, transfer_id: str, target: Target, now: float) -> str:
        fate = self._fate_locked(transfer_id)
        send = self.sends.get(transfer_id)
        if send is None and fate != "unknown":
            return fate
        if send is not None and send.target is not None:
            return "accepted" if send.target == target else "duplicate"  # one transfer, one D (a replay: the same)
        if target.address not in self._addresses and len(self._addresses) >= MAX_PEERS:
            return "busy"
        if send is None:
            if len(self.sends) >= MAX_SENDS:
                return "busy"
            send = self.sends[transfer_id] = Send(transfer_id, now + self.lease_s)
        send.target = target
        self._count_address_locked(target.address, +1)
        if send.state == SendState.WAITING:
            send.deadline = max(send.deadline, now + self.lease_s)
        return "accepted"   # (P's token, if it has one, goes to D at P's next step: Pusher.step)

    def on_heartbeat(self, message: dict[str, Any]) -> dict[str, Any]:
        """D's heartbeat: refresh WAITING transfers, answer every id's state or fate."""
        ids = _ids(message, "transfer_ids")
        if message.get("boot_id") != self.t.boot_id:
            return self._reply(states={t: "stale_boot" for t in ids})
        deadline, states = self.clock() + self.lease_s, {}
        with self._lock:
            for transfer_id in ids:
                send = self.sends.get(transfer_id)
                if send is not None and send.state == SendState.WAITING:
                    send.deadline = max(send.deadline, deadline)
                states[transfer_id] = self._fate_locked(transfer_id)
        return self._reply(states=states)

    def on_release(self, message: dict[str, Any]) -> dict[str, Any]:
        ids = _ids(message, "transfer_ids")
        if message.get("boot_id") != self.t.boot_id:
            return self._reply(states={t: "stale_boot" for t in ids})
        return self._reply(states=self.release(ids))

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
                    self._remove_locked(send)
                    if send.request_id is not None:
                        self._to_free.add(send.request_id)
                    self._end_locked(transfer_id, "released", now)
                elif self._fate_locked(transfer_id) == "unknown":  # not here (yet): a tombstone, apart from
                    _remember(self._tombstones, transfer_id, "released", now, self.lease_s, MAX_TOMBSTONES)
                states[transfer_id] = self._fate_locked(transfer_id)  # the fates of real transfers
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
    is_announced: bool = False       # P accepted the announce: its "unknown" means it dropped it
    is_cancelled: bool = False       # its request was aborted: report without an error
    is_abandoned: bool = False       # the router's word: P's hop failed; D computes the prompt itself
    p_cannot_abort: bool = False     # P said "quarantined": no timer may free the blocks
    is_probing: bool = False         # QUARANTINED: a release to settle it is in flight
    error: str = ""                  # why its load fails (the router's word, or P's silence)
    announced_at: float = 0.0
    confirmed_at: float = 0.0        # the last reply in which P held or expected the transfer
    last_sent: float = 0.0           # the last message P may have refreshed the announce with
    p_bound: float = 0.0             # P's lease + write timeout, from its replies
    safe_at: float = float("inf")    # QUARANTINED: reported then
    last_probe: float = 0.0
    written_at: float = 0.0          # when P first said "written" (its WRITE is over; the notification due)
    first_token_ids: list[int] | None = None   # P's token, as it came ahead of the KV (reported once)

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
        self._abandoned: OrderedDict[str, tuple[bool, float]] = OrderedDict()  # the router's, before the request
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.clients = side_channel.PeerClients(config.auth_key, self.timeout, self._events, clock)
        self._finished: set[str] = set()
        self.first_tokens: dict[str, list[int]] = {}   # D's request id → P's token, reported once
        self.to_recompute: set[str] = set()   # D's request ids: failed loads the scheduler recomputes
        self._next_heartbeat = self._next_sweep = 0.0
        self.num_failures = self.num_quarantined = 0

    # ---- the scheduler's meta ----
    def apply(self, meta: PushConnectorMeta) -> None:
        now = self.clock()
        was_waiting = bool(self.recvs)
        for keep in meta.reqs_to_keep_alive:
            if keep.request_id in self.recvs or keep.remote_request_id in self._by_transfer:
                continue  # (a second request on one transfer id is refused at admission)
            if keep.remote_request_id in self._abandoned:  # the router released it before it came
                self._send_release([keep.remote_request_id], keep.remote_host, keep.remote_port, keep.remote_boot_id)
                continue
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
            recv = Recv(spec, RecvState.ANNOUNCING, confirmed_at=now)
            other = self._by_transfer.get(spec.transfer_id)
            if other is not None:  # never announced: nothing can write for this one
                self.recvs[spec.request_id] = recv
                self._end(recv, "another request on this instance already waits for this KV transfer")
            elif spec.transfer_id in self._abandoned:
                self._send_release([spec.transfer_id], *recv.p_address, spec.remote_boot_id)
                recv.is_abandoned = True
                self.recvs[spec.request_id] = recv
                self._end(recv, "the prefill instance failed before computing the prompt")
            else:
                recv.is_announce_queued = True
                self._track(recv)
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
            else:
                recv.is_cancelled = True

    def abandon(self, transfer_ids: list[str]) -> None:
        """The router's word: the prefill hop failed. Release the transfer at P and report the load failed
        (for the scheduler to recompute) once P confirms that nothing writes. For a transfer not here yet
        (the router's release overtook the request), the same when it comes."""
        now = self.clock()
        for transfer_id in transfer_ids:
            recv = self._by_transfer.get(transfer_id)
            if recv is None:
                _remember(self._abandoned, transfer_id, True, now, self.lease_s, MAX_ABANDONED)
            elif not recv.is_reported:  # still queued: its load will find it abandoned
                _remember(self._abandoned, transfer_id, True, now, self.lease_s, MAX_ABANDONED)
                self._forget(recv)
                self._send_release([transfer_id], *recv.p_address, recv.spec.remote_boot_id)
            elif recv.state == RecvState.ANNOUNCING and recv.is_announce_queued:
                recv.is_abandoned = True
                self._end(recv, "the prefill instance failed before computing the prompt")
            elif recv.state in (RecvState.ANNOUNCING, RecvState.WAITING):
                recv.is_abandoned = True
                self._releasing(recv, "the prefill instance failed before computing the prompt")

    # ---- each step ----
    def step(self, notified: list[WriteNotif]) -> set[str]:
        """notified: the notifications of WRITEs done (read_notif's, by the worker half, which drops what is
        not one). Returns finished_recving; P's tokens (for those, and for requests still waiting whose token
        P sent ahead) are in first_tokens until the next step."""
        self.first_tokens = {}
        while not self._events.empty():
            self._apply_event(self._events.get_nowait())
        for parsed in notified:  # the WRITE is done: its data is in the blocks
            transfer_id, first_token_ids = parsed.transfer_id, parsed.first_token_ids
            recv = self._by_transfer.get(transfer_id)
            if recv is not None and recv.is_reported:
                if recv.first_token_ids not in (None, first_token_ids):
                    logger.warning("push of %s: P's notification names token %s, its earlier message %s (the "
                                   "earlier one stands)", transfer_id, first_token_ids, recv.first_token_ids)
                elif first_token_ids and not recv.is_cancelled:
                    self.first_tokens[recv.spec.request_id] = first_token_ids
                self._end(recv)
        if self.recvs:
            now = self.clock()
            self._send_announces(now)
            for recv in list(self.recvs.values()):
                self._advance(recv, now)
            self._probe_quarantined(now)
            if now >= self._next_heartbeat:
                self._heartbeat(now)
        self._sweep()
        finished, self._finished = self._finished, set()
        return finished

    def _advance(self, recv: Recv, now: float) -> None:
        if recv.state == RecvState.QUARANTINED:
            if now >= recv.safe_at:
                self._end(recv, recv.error)
        elif recv.state in (RecvState.WAITING, RecvState.RELEASING) and recv.is_announced \
                and now - recv.confirmed_at > self.lease_s:
            self._quarantine(recv, "the prefill instance stopped answering")
        elif recv.state in (RecvState.WAITING, RecvState.RELEASING) and recv.written_at \
                and now - recv.written_at > NOTIF_GRACE_S:
            # P's WRITE has been over for long (whatever was in flight has landed), but no notification came
            # to vouch for the data (a rank's lost, or one this D cannot read): the load fails, its policy
            # applies. Without this P's "written" kept the request waiting for ever.
            self._end(recv, recv.error or "the prefill instance wrote this request's KV, but its notification "
                                          "never came")
        elif recv.state == RecvState.WAITING and now - recv.announced_at > self.wait_timeout:
            self._releasing(recv, f"the prefill instance did not write this request's KV within {self.wait_timeout:g}s")

    def _quarantine(self, recv: Recv, error: str) -> None:
        """P is silent: hold the blocks until no WRITE it could have started can land."""
        logger.warning("push of %s from %s: %s; holding its blocks until nothing can write them",
                       recv.transfer_id, recv.spec.remote_engine_id, error)
        self.num_quarantined += 1
        recv.state, recv.last_probe = RecvState.QUARANTINED, self.clock()
        bound = max(self.lease_s + self.write_timeout, recv.p_bound)
        recv.safe_at = float("inf") if recv.p_cannot_abort else \
            recv.last_sent + bound + max(SAFETY_MARGIN_S, self.lease_s)
        recv.error = recv.error or error

    def _releasing(self, recv: Recv, error: str) -> None:
        recv.state, recv.error = RecvState.RELEASING, recv.error or error
        self._send_release_of([recv])

    def _send_release_of(self, recvs: list[Recv]) -> None:
        """Ask P (one, the recvs') to end the transfers; its answer (or a refused connection) settles them."""
        spec = recvs[0].spec
        self.clients.get(recvs[0].p_address).send(
            {"type": "release", "engine_id": self.t.engine_id, "boot_id": spec.remote_boot_id,
             "transfer_ids": [recv.transfer_id for recv in recvs]},
            on_reply=lambda reply, _, at: self._on_states(recvs, reply, at, is_release=True),
            on_error=lambda cause: self._on_error(recvs, cause))

    def _probe_quarantined(self, now: float) -> None:
        """One release per P per heartbeat period for its quarantined transfers, none while one is out."""
        groups: dict[tuple[str, int, str | None], list[Recv]] = {}
        for recv in self.recvs.values():
            if recv.state == RecvState.QUARANTINED and not recv.is_probing \
                    and now >= recv.last_probe + self.config.heartbeat_seconds:
                groups.setdefault((*recv.p_address, recv.spec.remote_boot_id), []).append(recv)
        for recvs in groups.values():
            for chunk in range(0, len(recvs), MAX_IDS_PER_MESSAGE):
                batch = recvs[chunk:chunk + MAX_IDS_PER_MESSAGE]
                for recv in batch:
                    recv.is_probing, recv.last_probe = True, now
                self._send_release_of(batch)

    def by_transfer(self, transfer_id: str) -> Recv | None:
        """The receive with blocks (announced or about to be) for transfer_id, if any."""
        recv = self._by_transfer.get(transfer_id)
        return recv if recv is not None and recv.is_reported else None

    def fail(self, recv: Recv, error: str) -> None:
        """Every WRITE of the transfer is in, but its data could not be used here: report the load failed."""
        if self._live(recv):
            self._end(recv, error)

    def _end(self, recv: Recv, error: str | None = None) -> None:
        """The one way out: report (with its blocks invalid on an error) and forget."""
        if error and not recv.is_cancelled:
            self.num_failures += 1
            self.t._load_failed(recv, error, list(recv.spec.local_block_ids), for_client=not recv.is_abandoned)
            if recv.is_abandoned:
                self.to_recompute.add(recv.spec.request_id)
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

    def _live(self, recv: Recv) -> bool:
        return self.recvs.get(recv.spec.request_id) is recv

    # ---- messages to P ----
    def _send_announces(self, now: float) -> None:
        by_p: dict[tuple[str, int, str | None], list[Recv]] = {}
        for recv in self.recvs.values():
            if recv.is_announce_queued:
                recv.is_announce_queued = False
                by_p.setdefault((*recv.p_address, recv.spec.remote_boot_id), []).append(recv)
        for (host, port, boot_id), recvs in by_p.items():
            for chunk in range(0, len(recvs), MAX_IDS_PER_MESSAGE):
                batch = recvs[chunk:chunk + MAX_IDS_PER_MESSAGE]
                for recv in batch:
                    recv.announced_at = recv.last_sent = now
                self.clients.get((host, port)).send(
                    {"type": "announce", "engine_id": self.t.engine_id, "boot_id": boot_id,
                     "d_boot_id": self.t.boot_id, "host": self.t.side_channel_host, "port": self.t.side_channel_port,
                     "transfers": [{"transfer_id": r.transfer_id, "request_id": r.spec.request_id,
                                    "block_ids": r.spec.local_block_ids, "first_block": r.spec.first_block}
                                   for r in batch]},
                    on_reply=lambda reply, _, at, batch=batch: self._on_announce(batch, reply, at),
                    on_error=lambda cause, batch=batch: self._on_error(batch, cause))

    def _learn_bounds(self, recv: Recv, reply: dict[str, Any]) -> None:
        lease, wt = reply.get("lease_seconds"), reply.get("write_timeout_seconds")
        if isinstance(lease, (int, float)) and isinstance(wt, (int, float)) and not isinstance(lease, bool):
            recv.p_bound = max(recv.p_bound, float(lease) + float(wt))

    def _on_announce(self, recvs: list[Recv], reply: dict[str, Any], sent_at: float) -> None:
        results = reply.get("results")
        if not isinstance(results, dict):
            raise ValueError("announce reply: no results")  # → _on_error: it may have reached P
        for recv in recvs:
            if not self._live(recv):
                continue
            self._learn_bounds(recv, reply)
            result = results.get(recv.transfer_id)
            if result == "accepted":
                recv.confirmed_at, recv.is_announced = self.clock(), True
                if recv.state == RecvState.ANNOUNCING:
                    recv.state = RecvState.WAITING
            elif result in NEVER_WRITTEN:
                self._refused(recv, result)
            else:  # not an answer we know: the announce may have been applied
                self._on_error([recv], f"a malformed reply ({result!r})")

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
        self._end(recv, recv.error or self._REFUSALS[result])

    def _heartbeat(self, now: float) -> None:
        self._next_heartbeat = now + self.config.heartbeat_seconds
        groups: dict[tuple[str, int, str | None], list[Recv]] = {}
        for recv in self.recvs.values():
            # Not before P answered the announce: on its own lane a heartbeat can overtake the announce,
            # and the "unknown" it would get back says nothing about a WRITE to come.
            if recv.state == RecvState.QUEUED or (recv.is_announced and recv.state in (RecvState.WAITING,
                                                                                        RecvState.RELEASING)):
                groups.setdefault((*recv.p_address, recv.spec.remote_boot_id), []).append(recv)
        for (host, port, boot_id), recvs in groups.items():
            client = self.clients.get((host, port))
            if client.num_heartbeats_pending:  # the last one has not come back: skip, never queue up
                continue
            for chunk in range(0, len(recvs), MAX_IDS_PER_MESSAGE):
                batch = recvs[chunk:chunk + MAX_IDS_PER_MESSAGE]
                for recv in batch:
                    recv.last_sent = now
                client.send({"type": "heartbeat", "engine_id": self.t.engine_id, "boot_id": boot_id,
                             "transfer_ids": [r.transfer_id for r in batch]},
                            on_reply=lambda reply, _, at, batch=batch: self._on_states(batch, reply, at),
                            on_error=lambda cause, batch=batch: self._on_error(batch, cause))

    def _on_states(self, recvs: list[Recv], reply: dict[str, Any], sent_at: float, is_release: bool = False) -> None:
        states = reply.get("states")
        if not isinstance(states, dict):
            raise ValueError("reply: no states")
        for recv in recvs:
            recv.is_probing = False
            if not self._live(recv) or not recv.is_reported:
                continue  # queued here: P's copy may not be there yet ("unknown"); a refusal comes again,
            self._learn_bounds(recv, reply)  # with its reason, when its load announces
            state = states.get(recv.transfer_id)
            if state in ALIVE:
                recv.confirmed_at = self.clock()
                recv.written_at = recv.written_at or (recv.confirmed_at if state == "written" else 0.0)
                recv.p_cannot_abort = recv.p_cannot_abort or state == "quarantined"
                if recv.state == RecvState.QUARANTINED:  # P is back: its word settles it, not the timer
                    recv.state, recv.safe_at = RecvState.RELEASING, float("inf")
                if recv.state == RecvState.RELEASING and state == "waiting":
                    self._send_release_of([recv])  # the release was lost: P still holds it
            elif state in NEVER_WRITTEN and (is_release or recv.is_announced or state != "unknown"):
                self._refused(recv, state)
            # else: no answer we can act on (a heartbeat's "unknown" before the announce's reply, or a
            # malformed state): the silence rules apply

    def _on_error(self, recvs: list[Recv], cause: str) -> None:
        for recv in recvs:
            recv.is_probing = False
            if not self._live(recv) or not recv.is_reported:
                continue
            if cause == side_channel.CAUSE_REFUSED:  # no process listens at P's side channel: P is gone
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
    def on_first_token(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("boot_id") == self.t.boot_id:
            self._events.put((None, message, self._apply_first_token, None, (message,)))
        return {"ok": True}

    def _apply_first_token(self, message: dict[str, Any]) -> None:
        """Only for a receive D announced (P sends after the announce) and only once."""
        recv = self._by_transfer.get(message.get("transfer_id"))
        tokens = message.get("token_ids")
        if (recv is not None and self._live(recv) and recv.is_reported and not recv.is_cancelled
                and recv.first_token_ids is None and recv.spec.remote_engine_id == message.get("engine_id")
                and isinstance(tokens, list) and len(tokens) == 1 and all(type(t) is int and t >= 0 for t in tokens)):
            recv.first_token_ids = tokens
            self.first_tokens[recv.spec.request_id] = tokens

    def on_push_failed(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("boot_id") == self.t.boot_id:
            self._events.put((None, message, self._apply_push_failed, None, (message,)))
        return {"ok": True}

    def _apply_push_failed(self, message: dict[str, Any]) -> None:
        items = message.get("transfers") or []
        for item in items[:MAX_IDS_PER_MESSAGE] if isinstance(items, list) else ():
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
        while self._abandoned and next(iter(self._abandoned.values()))[1] + self.lease_s < now:
            self._abandoned.popitem(last=False)

    def num_pending(self) -> int:
        return sum(recv.is_reported for recv in self.recvs.values()) + len(self._finished)

    def shutdown(self) -> None:
        self.clients.close()
        self.recvs, self._by_transfer = {}, {}
