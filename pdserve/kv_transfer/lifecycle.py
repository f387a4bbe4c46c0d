"""The handoff lifecycle: P's LeaseHolder and D's Loader, one record per request, one state each.

Every transport (nixl.py, cuda_ipc.py) and, later, every direction (push and store reuse the records:
a grant P holds for a reader, a load D waits on) runs its requests through these two objects. A
request's fate is its record's state; each side has one step() that advances states and frees what a
terminal state releases; every state that waits on a peer has a deadline.

On P (producer), per request (a Grant):
  1. hold(request_id, block_ids): HELD, deadline = now + lease_seconds
  2. a claim from a D (P's request id, the block ids it will read, P's boot nonce) answers "held" and
     makes it CLAIMED (deadline extended) only for this boot's nonce, a live grant no other load
     claimed, and granted block ids; else "stale_boot", "claimed", "mismatch", an ended grant's fate
     ("read", "released", "expired"; kept one lease period) or "unknown" (never held, or its
     SendSpec is still on the way: D asks again until its claim deadline)
  3. heartbeats extend live grants; the reply names the ids that are expired or unknown here
  4. terminal: READ (the transport's notification or a "done" message), RELEASED (a release from
     D or from the router), EXPIRED (deadline passed: kv_lease_expirations_total); step() reports
     terminal grants in finished_sending and forgets them. A done or release for an id not held
     yet is kept (bounded, for one lease period) and applied when its grant arrives

On D (consumer), per request (a Load):
  0. QUEUED: a KeepAliveSpec (the request waits in D's scheduler): heartbeats extend P's lease; a
     release (finished, aborted or covered by D's prefix cache first) tells P and forgets it
  1. a RecvSpec: HANDSHAKING while the connection to P's (engine id, boot nonce) is made, once per
     P boot, deadline = now + claim_timeout (lease_seconds); a reply naming another boot fails it at once
  2. CLAIMING: one claim per P per step for every load ready to claim, deadline = now + claim_timeout.
     Each exchange fails on its own after one side-channel timeout (a P that accepts and never
     answers); the longer state deadline covers what is not the peer's silence: "unknown" while P's
     grant is on its way (P's next step, long when P is busy), claims queued behind others to the same
     P, and D's own steps (a reply is applied at D's next step; a 5 s deadline there failed healthy
     loads whenever D's steps were slow, as under a CPU soak)
  3. READING: after "held", the READ is posted (one descriptor per coalesced run). P's lease is good
     until the claim's (or the last acknowledged heartbeat's) send time + lease_seconds; the READ
     lasts while it is, at most read_timeout_seconds (default max(60 s, 2 leases)), and a READ that
     ends after the lease is invalid
  4. DONE: finished_recving and, for transports without their own notification, a "done" to P;
     FAILED: finished_recving + its blocks and an error naming the fate (pull_worker_common);
     CANCELLED (an abort before the READ): finished_recving, release to P
  5. a READ past its deadline is aborted (the transport's release); if the transport cannot abort it,
     the load is QUARANTINED: counted, P released, and reported (its blocks back to D's pool) only
     once the transport says it finished or let it go, never while it may still write
Peers: D's connection to P is keyed by (engine id, boot nonce); a new boot of the same engine replaces
the old one; connections idle for PEER_IDLE_S, or whose P failed, are dropped. Threads: D's side-channel
exchanges run on side_channel.PeerClient lanes, one per P address, each under one deadline (min(5 s,
lease / 2)), at most one heartbeat in flight per P; replies come back to the engine thread as events.
P's grants are touched by the side-channel server threads under the holder's lock.
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
from pdserve.kv_transfer.pull import KeepAliveSpec, PullConnectorMeta, RecvSpec

logger = logging.getLogger(__name__)

MAX_SIDE_CHANNEL_S = 5.0    # one side-channel exchange, at most (and at most half a lease)
CLAIM_RETRY_S = 0.005       # "unknown" (P's SendSpec may still be on the way): ask again after this
PEER_IDLE_S = 60.0          # a connection to P unused this long is dropped
DONE_ATTEMPTS = 2           # D: a "done" lost on the way is sent once more
MAX_ENDED = 1 << 16         # P: ended grants remembered for claims and heartbeats (one lease period)
MAX_EARLY = 1 << 12         # P: done/release notices for ids not held (yet), from the network


# ---- P: the lease holder ---------------------------------------------------------------------------

class GrantState(Enum):
    HELD = "held"
    CLAIMED = "claimed"
    READ = "read"            # terminal from here on
    RELEASED = "released"
    EXPIRED = "expired"


_LIVE = (GrantState.HELD, GrantState.CLAIMED)


def _is_claimant(claimant: tuple[str, str] | None, sender: tuple[str, str | None]) -> bool:
    return claimant is None or (claimant[0] == sender[0] and sender[1] in (None, claimant[1]))


@dataclass
class Grant:
    request_id: str
    block_ids: list[int]
    deadline: float
    state: GrantState = GrantState.HELD
    claimant: tuple[str, str] | None = None   # (D's engine id, D's request id)


class LeaseHolder:
    """P: the blocks held for remote readers. The side-channel threads answer claims, heartbeats and
    releases under self._lock; step() (engine thread) expires and reports."""

    def __init__(self, config: KVTransferConfig, boot_id: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s, self.boot_id, self.clock = config.lease_seconds, boot_id, clock
        self._lock = threading.Lock()
        self._grants: dict[str, Grant] = {}
        self._ended: OrderedDict[str, tuple[GrantState, float]] = OrderedDict()  # fate, when (one lease)
        self._early: OrderedDict[str, tuple[GrantState, float]] = OrderedDict()  # done/release before hold
        self.num_expirations = 0

    def hold(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:  # a done or release that came first ends it at once
            early = self._early.pop(request_id, None)
            self._grants[request_id] = Grant(request_id, list(block_ids), self.clock() + self.lease_s,
                                             early[0] if early is not None else GrantState.HELD)

    def end(self, request_ids: list[str], state: GrantState,
            senders: list[tuple[str, str | None]] | None = None) -> None:
        """A done (READ) or a release (RELEASED): free at the next step. senders: who says so, per id
        ((D's engine id, D's request id or None)); None from this engine's own transport. A claimed grant
        ends only by its claimant's word: another D's (a replay whose claim was refused, then released)
        would free blocks the claimant may be reading."""
        now = self.clock()
        with self._lock:
            for i, request_id in enumerate(request_ids):
                grant = self._grants.get(request_id)
                peer_read = senders is not None and state == GrantState.READ   # a peer's "done"
                if grant is not None and grant.state in _LIVE:
                    # A claimed grant ends by its claimant's word only; a "done" of one never claimed is
                    # nobody's (a READ follows a claim), as is one before the grant (below).
                    if senders is not None and (not _is_claimant(grant.claimant, senders[i]) if grant.state ==
                                                GrantState.CLAIMED else peer_read):
                        logger.warning("%s of %s from %s ignored: %s", state.value, request_id, senders[i],
                                       f"claimed by {grant.claimant}" if grant.claimant else "never claimed")
                        continue
                    grant.state = state
                elif grant is None and request_id not in self._ended and not peer_read:
                    # its SendSpec may still be on the way
                    self._early[request_id] = (state, now)
                    self._early.move_to_end(request_id)
                    self._forget_old(self._early, now, MAX_EARLY)

    def step(self, notified: list[str]) -> set[str]:
        """finished_sending: grants that reached a terminal state."""
        if notified:
            self.end(notified, GrantState.READ)
        if not self._grants and not self._ended and not self._early:
            return set()
        now, finished = self.clock(), set()
        with self._lock:
            for request_id, grant in self._grants.items():
                if grant.state in _LIVE and grant.deadline < now:
                    logger.warning("KV lease of %s expired: no READ or heartbeat for %.1fs; freeing %d blocks",
                                   request_id, self.lease_s, len(grant.block_ids))
                    self.num_expirations += 1
                    grant.state = GrantState.EXPIRED
                if grant.state not in _LIVE:
                    finished.add(request_id)
            for request_id in finished:
                self._ended[request_id] = (self._grants.pop(request_id).state, now)
                self._ended.move_to_end(request_id)
            self._forget_old(self._ended, now, MAX_ENDED)
            self._forget_old(self._early, now, MAX_EARLY)
        return finished

    def _forget_old(self, entries: OrderedDict, now: float, max_entries: int) -> None:
        while entries and (len(entries) > max_entries or next(iter(entries.values()))[1] + self.lease_s < now):
            entries.popitem(last=False)

    # side-channel threads
    def on_claim(self, message: dict[str, Any]) -> dict[str, Any]:
        results, now = {}, self.clock()
        with self._lock:
            for claim in message["claims"]:
                request_id, block_ids = claim["request_id"], claim["block_ids"]
                if not isinstance(request_id, str) or not isinstance(block_ids, list):
                    raise ValueError("claim: request_id must be a string, block_ids a list")
                claimant = (str(message.get("engine_id")), str(claim.get("claimant")))
                results[request_id] = self._claim(request_id, block_ids, claimant, message.get("boot_id"), now)
        return {"ok": True, "boot_id": self.boot_id, "results": results}

    def _claim(self, request_id: str, block_ids: list, claimant: tuple[str, str], boot_id: Any, now: float) -> str:
        if boot_id != self.boot_id:
            return "stale_boot"
        grant = self._grants.get(request_id)
        if grant is None:
            ended = self._ended.get(request_id)
            return ended[0].value if ended is not None else "unknown"
        if grant.state not in _LIVE:
            return grant.state.value
        if grant.state == GrantState.CLAIMED and grant.claimant != claimant:
            return "claimed"  # a grant is claimable once: a replay to a second D is refused
        if not set(block_ids) <= set(grant.block_ids):
            return "mismatch"
        grant.state, grant.claimant = GrantState.CLAIMED, claimant
        grant.deadline = max(grant.deadline, now + self.lease_s)
        return "held"

    def on_heartbeat(self, message: dict[str, Any]) -> dict[str, Any]:
        request_ids = message.get("remote_request_ids") or []
        deadline = self.clock() + self.lease_s
        num_extended, expired, unknown = 0, [], []
        is_ours = message.get("boot_id") in (None, self.boot_id)  # else all of them are another boot's
        with self._lock:
            for request_id in request_ids if is_ours else ():
                grant = self._grants.get(request_id)
                if grant is not None and grant.state in _LIVE:
                    grant.deadline = max(grant.deadline, deadline)
                    num_extended += 1
                else:  # ended (READ: done, its reader may not know yet), or unknown (maybe not arrived yet)
                    fate = grant.state if grant is not None else self._ended.get(request_id, (None,))[0]
                    if fate != GrantState.READ:
                        (expired if fate == GrantState.EXPIRED else unknown).append(request_id)
        return {"ok": True, "boot_id": self.boot_id, "num_extended": num_extended, "expired": expired,
                "unknown": unknown if is_ours else list(request_ids)}

    def on_end(self, message: dict[str, Any], state: GrantState) -> dict[str, Any]:
        if message.get("boot_id") in (None, self.boot_id):  # another boot's: nothing of ours
            ids = message.get("remote_request_ids") or []
            claimants = message.get("claimants")
            if not (isinstance(claimants, list) and len(claimants) == len(ids)):
                claimants = [None] * len(ids)   # (a sender that names no claimant: judged by its engine)
            engine = str(message.get("engine_id"))
            pairs = [(r, (engine, c if isinstance(c, str) else None)) for r, c in zip(ids, claimants)
                     if isinstance(r, str)]
            self.end([r for r, _ in pairs], state, [s for _, s in pairs])
        return {"ok": True}

    def num_pending(self) -> int:
        return len(self._grants)

    def num_blocks_held(self) -> int:
        with self._lock:
            return sum(len(g.block_ids) for g in self._grants.values())


# ---- D: the loader ---------------------------------------------------------------------------------

class LoadState(Enum):
    QUEUED = "queued"
    HANDSHAKING = "handshaking"
    CLAIMING = "claiming"
    READING = "reading"
    QUARANTINED = "quarantined"   # failed, but the transport may still write into its blocks
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


_BUSY = (LoadState.HANDSHAKING, LoadState.CLAIMING, LoadState.READING, LoadState.QUARANTINED)


@dataclass
class Load:
    spec: RecvSpec | KeepAliveSpec
    state: LoadState
    deadline: float = float("inf")
    handle: Any = None
    claim_at: float = 0.0              # CLAIMING: when the next claim may go
    is_claim_in_flight: bool = False
    lease_until: float = 0.0           # P's lease known good until then (a confirmation's send time + lease)
    is_lost: bool = False              # P no longer holds it (a heartbeat's reply): stop heartbeating
    error: str = ""                    # QUARANTINED: why it failed
    posted_at: float = 0.0
    num_bytes: int = 0
    num_descriptors: int = 0

    @property
    def is_reported(self) -> bool:     # the scheduler waits for it in finished_recving
        return isinstance(self.spec, RecvSpec)


@dataclass
class Peer:
    """D's connection to one boot of one P."""
    engine_id: str
    boot_id: str | None
    address: tuple[str, int]
    deadline: float                     # for the handshake
    remote: Any = None                  # the transport glue's RemoteEngine, once connected
    is_failed: bool = False
    last_used: float = 0.0


class Loader:
    """D: every request whose KV comes from a P, from its keep-alive to its report. Engine thread only;
    the side-channel clients hand replies back through self._events."""

    def __init__(self, transport: Any, config: KVTransferConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.t, self.config, self.clock = transport, config, clock  # t: pull_worker_common's hooks
        self.timeout = min(MAX_SIDE_CHANNEL_S, config.lease_seconds / 2)  # one side-channel exchange
        # Handshaking and claiming, all exchanges and retries included: P's grant lives a lease unclaimed,
        # so waiting longer than that for it is pointless, and shorter fails loads of a busy, healthy P.
        self.claim_timeout = float(config.extra.get("claim_timeout_seconds", config.lease_seconds))
        # A READ lasts while P confirms the lease (a READ may need P's steps, which may be long), at most:
        self.read_timeout = float(config.extra.get("read_timeout_seconds", max(60.0, 2 * config.lease_seconds)))
        self.loads: dict[str, Load] = {}
        self.peers: dict[tuple[str, str | None], Peer] = {}
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.clients = side_channel.PeerClients(config.auth_key, self.timeout, self._events, clock)
        self._finished: set[str] = set()
        self._done_to_send: dict[tuple[str, str | None], list[str]] = {}
        self._next_heartbeat = self._next_sweep = 0.0
        self.num_failures = self.num_quarantined = 0

    # ---- the scheduler's meta (start_load_kv) ----
    def apply(self, meta: PullConnectorMeta) -> None:
        now = self.clock()
        was_waiting = bool(self.loads)
        for keep in meta.reqs_to_keep_alive:
            if not (keep.request_id in self.loads and self.loads[keep.request_id].is_reported):
                self.loads[keep.request_id] = Load(keep, LoadState.QUEUED)
        for keep in meta.reqs_to_release:  # after the keep-alives: one added and released in one step ends
            self._send_release(keep)
            if getattr(self.loads.get(keep.request_id), "spec", None) == keep:  # (only a QUEUED one's spec is)
                del self.loads[keep.request_id]
        for spec in meta.reqs_to_recv:
            self._add(spec, now)
        if not was_waiting and self.loads:  # the first heartbeat one period after the wait starts
            self._next_heartbeat = now + self.config.heartbeat_seconds
        for request_id in meta.reqs_to_cancel:
            self._cancel(request_id)

    def _add(self, spec: RecvSpec, now: float) -> None:
        load = self.loads[spec.request_id] = Load(spec, LoadState.HANDSHAKING)
        if not spec.local_block_ids:  # nothing to read: let P free its blocks
            return self._end(load, LoadState.DONE, release=True)
        peer = self._peer(spec, now)
        if peer.remote is not None:
            return self._to_claim(load, now)
        load.deadline = peer.deadline

    def _cancel(self, request_id: str) -> None:
        load = self.loads.get(request_id)
        if load is None or not load.is_reported:  # unknown here: report it so the scheduler never waits
            self._finished.add(request_id)
        elif load.state in (LoadState.HANDSHAKING, LoadState.CLAIMING):  # nothing writes its blocks yet
            self._end(load, LoadState.CANCELLED, release=True)
        # else READING / QUARANTINED: it may still write into its blocks; reported when it ends

    # ---- each step (get_finished) ----
    def step(self) -> set[str]:
        while not self._events.empty():
            self._apply_event(self._events.get_nowait())
        if self.loads:
            now = self.clock()
            for load in list(self.loads.values()):
                self._advance(load, now)
            self._send_claims(now)
            if now >= self._next_heartbeat:
                self._heartbeat(now)
        if self._done_to_send:  # one notice per P per step
            for key, pairs in self._done_to_send.items():
                if (peer := self.peers.get(key)) is not None:
                    self.t._send_done(peer, [r for r, _ in pairs], [c for _, c in pairs])
            self._done_to_send = {}
        self._sweep()  # (once a second)
        finished, self._finished = self._finished, set()
        return finished

    def _advance(self, load: Load, now: float) -> None:
        if load.state in (LoadState.READING, LoadState.QUARANTINED):
            try:
                state = self.t._check(load.handle)
            except Exception as e:  # e.g. NIXL raising for a peer gone mid-READ: that READ failed
                logger.warning("READ of %s: transfer status failed: %s: %s", load.spec.request_id, type(e).__name__, e)
                state = "ERR"
            if state != "PROC":
                self._complete(load, state)
            elif load.state == LoadState.READING and (now > load.deadline or now > load.lease_until):
                self._abort(load, now)
            elif load.state == LoadState.QUARANTINED and self._release_handle(load, log=False):
                self._report_quarantined(load)
        elif load.state in (LoadState.HANDSHAKING, LoadState.CLAIMING) and now > load.deadline:
            what = "handshake with" if load.state == LoadState.HANDSHAKING else "claim on its KV at"
            self._fail(load, f"the {what} the prefill instance did not complete within {self.claim_timeout:g}s",
                       None)

    def _abort(self, load: Load, now: float) -> None:
        """A READ past its deadline: fail it, but give its blocks back only once nothing writes them."""
        error = ("the prefill instance's lease on this request's KV ended during the read" if load.is_lost
                 else f"the READ from the prefill instance did not finish within {self.read_timeout:g}s"
                 if now > load.deadline else "the prefill instance stopped confirming its lease on this "
                 "request's KV during the read")
        logger.warning("READ of %s from %s: %s; aborting it", load.spec.request_id, load.spec.remote_engine_id, error)
        self.num_failures += 1
        self._send_release(load.spec)
        load.error = error
        if self._release_handle(load, log=True):
            self._report_quarantined(load)
        else:
            self.num_quarantined += 1
            load.state = LoadState.QUARANTINED

    def _report_quarantined(self, load: Load) -> None:
        load.state = LoadState.FAILED  # (counted, and P released, by _abort)
        self.t._load_failed(load, load.error, load.spec.local_block_ids)
        self._forget(load)

    def _release_handle(self, load: Load, log: bool) -> bool:
        try:
            self.t._release(load.handle)
        except Exception as e:  # still active and the transport cannot abort it
            if log:
                logger.warning("READ of %s: handle not released: %s", load.spec.request_id, e)
            return False
        load.handle = None
        return True

    def _complete(self, load: Load, state: str) -> None:
        spec = load.spec
        if not self._release_handle(load, log=True) and state != "DONE":
            # Failed, but a part of it may still write into the blocks (one tensor-parallel rank's READ
            # erred, another's is active and cannot be aborted): fail it as _abort does, and give its
            # blocks back only once nothing writes them.
            if load.state != LoadState.QUARANTINED:
                logger.warning("READ of %s from %s failed with a part still active; its blocks are held until "
                               "it ends", spec.request_id, spec.remote_engine_id)
                self.num_failures += 1
                self.num_quarantined += 1
                self._send_release(spec)
                if (peer := self.peers.get((spec.remote_engine_id, spec.remote_boot_id))) is not None:
                    peer.is_failed = True
                load.error, load.state = "transfer error", LoadState.QUARANTINED
            return
        if load.state == LoadState.QUARANTINED:  # it stopped writing: the blocks may go back now
            return self._report_quarantined(load)
        if state == "DONE":
            self.t._count_read(load, self.clock() - load.posted_at)
            if self.t.notifies_done:
                self._done_to_send.setdefault((spec.remote_engine_id, spec.remote_boot_id), []).append(
                    (spec.remote_request_id, spec.request_id))
        elif (peer := self.peers.get((spec.remote_engine_id, spec.remote_boot_id))) is not None:
            peer.is_failed = True  # dropped once no READ uses it; the next load handshakes again
        lost = state == "DONE" and self.clock() > load.lease_until  # P may have freed them under the READ
        invalid = list(spec.local_block_ids) if lost else self.t._invalid_blocks(load, state)
        if not invalid:
            return self._end(load, LoadState.DONE)
        cause = ("transfer error" if state != "DONE" else "the prefill instance's lease on this request's KV "
                 "ran out during the read" if lost else f"injected {self.t._inject_read_failure}")
        self._fail(load, f"{len(invalid)} of {len(spec.local_block_ids)} blocks invalid ({cause})", invalid,
                   release=state != "DONE")  # after an ERR P got no done notice: let it free now

    def _fail(self, load: Load, error: str, invalid: list[int] | None, release: bool = True) -> None:
        self.num_failures += 1
        self.t._load_failed(load, error, load.spec.local_block_ids if invalid is None else invalid)
        self._end(load, LoadState.FAILED, release=release)

    def _end(self, load: Load, state: LoadState, release: bool = False) -> None:
        """The one way out: a terminal state reports the load and forgets it."""
        load.state = state
        if release:
            self._send_release(load.spec)
        self._forget(load)

    def _forget(self, load: Load) -> None:
        if self.loads.get(load.spec.request_id) is load:
            del self.loads[load.spec.request_id]
        if load.is_reported:
            self._finished.add(load.spec.request_id)

    # ---- peers ----
    def _peer(self, spec: RecvSpec, now: float) -> Peer:
        key = (spec.remote_engine_id, spec.remote_boot_id)
        peer = self.peers.get(key)
        is_dead = peer is not None and (peer.is_failed or (peer.remote is None and now > peer.deadline))
        if is_dead and not self._loads_of(peer, *_BUSY):
            self._drop_peer(peer)  # its P failed a READ, or never answered, and nothing uses it: handshake again
        elif peer is not None:
            peer.last_used = now
            return peer
        peer = self.peers[key] = Peer(spec.remote_engine_id, spec.remote_boot_id,
                                      (spec.remote_host, spec.remote_port), now + self.claim_timeout, last_used=now)
        self.clients.get(peer.address).send(
            {"type": "handshake", "engine_id": self.t.engine_id, "compat_hash": self.t.compat_hash},
            on_reply=lambda reply, blob, sent_at: self._on_handshake(peer, reply, blob),
            on_error=lambda cause: self._drop_peer(peer, cause if "remote engine" in cause else  # (logged already)
                                                   f"handshake with remote engine {peer.engine_id} failed: {cause}"),
            accept_refusal=True)
        return peer

    def _on_handshake(self, peer: Peer, reply: dict[str, Any], blob: bytes) -> None:
        if self.peers.get((peer.engine_id, peer.boot_id)) is not peer:
            return  # given up on (deadline) meanwhile
        remote = self.t._parse_handshake(peer.engine_id, reply, blob)  # raises: fails the peer's loads
        if peer.boot_id is not None and reply.get("boot_id") != peer.boot_id:
            raise RuntimeError("the prefill instance restarted since it computed this request's KV")
        for key, old in list(self.peers.items()):  # an older boot of this engine: its P is gone
            if old is not peer and old.engine_id == peer.engine_id:
                self._drop_peer(old)
        self.t.connect_remote(remote)
        peer.remote = remote
        for load in self._loads_of(peer, LoadState.HANDSHAKING):
            self._to_claim(load, self.clock())

    def _loads_of(self, peer: Peer, *states: LoadState) -> list[Load]:
        return [load for load in self.loads.values() if load.is_reported and load.state in states
                and (load.spec.remote_engine_id, load.spec.remote_boot_id) == (peer.engine_id, peer.boot_id)]

    def _drop_peer(self, peer: Peer, error: str = "the prefill instance restarted since it computed this "
                   "request's KV") -> None:
        for load in self._loads_of(peer, LoadState.HANDSHAKING, LoadState.CLAIMING, LoadState.READING):
            if load.state == LoadState.READING:
                self._abort(load, self.clock())
            else:
                self._fail(load, error, None)
        if self.peers.get((peer.engine_id, peer.boot_id)) is peer:
            del self.peers[(peer.engine_id, peer.boot_id)]
        if peer.remote is not None:
            try:
                self.t._disconnect(peer.remote)
            except Exception as e:
                logger.warning("disconnecting from remote engine %s failed: %s", peer.engine_id, e)
            peer.remote = None

    def _sweep(self) -> None:
        now = self.clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + 1.0
        for peer in list(self.peers.values()):
            if not self._loads_of(peer, *_BUSY) and (peer.is_failed or (peer.remote is None and now > peer.deadline)
                               or now - peer.last_used > PEER_IDLE_S):
                self._drop_peer(peer)
        self.clients.sweep({(load.spec.remote_host, load.spec.remote_port) for load in self.loads.values()},
                           PEER_IDLE_S)

    # ---- claims, heartbeats, releases ----
    def _to_claim(self, load: Load, now: float) -> None:
        load.state, load.deadline, load.claim_at = LoadState.CLAIMING, now + self.claim_timeout, now

    def _send_claims(self, now: float) -> None:
        by_peer: dict[tuple[str, str | None], list[Load]] = {}
        for load in self.loads.values():
            if load.state == LoadState.CLAIMING and not load.is_claim_in_flight and load.claim_at <= now:
                by_peer.setdefault((load.spec.remote_engine_id, load.spec.remote_boot_id), []).append(load)
        for key, loads in by_peer.items():
            peer = self.peers[key]
            for load in loads:
                load.is_claim_in_flight = True
            self.clients.get(peer.address).send(  # the loads' claim deadlines bound the wait
                {"type": "claim", "engine_id": self.t.engine_id, "boot_id": peer.boot_id,
                 "claims": [{"request_id": load.spec.remote_request_id, "block_ids": load.spec.remote_block_ids,
                             "claimant": load.spec.request_id} for load in loads]},
                on_reply=lambda reply, _, sent_at, peer=peer, loads=loads: self._on_claim(peer, loads, reply, sent_at),
                on_error=lambda cause, loads=loads: [self._fail(load, f"the claim on its KV failed: {cause}", None)
                                                     for load in loads if self.loads.get(load.spec.request_id) is load])

    _REFUSALS = {
        "expired": "the prefill instance's lease on this request's KV expired",
        "stale_boot": "the prefill instance restarted since it computed this request's KV",
        "mismatch": "the block ids differ from what the prefill instance granted",
        "claimed": "another load already claimed this request's KV on the prefill instance",
        "read": "another load already read this request's KV from the prefill instance",
        "released": "the prefill instance already released this request's KV",
    }

    def _on_claim(self, peer: Peer, loads: list[Load], reply: dict[str, Any], sent_at: float) -> None:
        results, now = reply["results"], self.clock()
        for load in loads:
            load.is_claim_in_flight = False
            if self.loads.get(load.spec.request_id) is not load or load.state != LoadState.CLAIMING:
                continue  # cancelled meanwhile (its release follows the claim on the same thread)
            result = results.get(load.spec.remote_request_id)
            if result == "held":
                load.lease_until = sent_at + self.config.lease_seconds
                self._post(load, peer, now)
            elif result == "unknown":  # never granted, already forgotten, or its SendSpec not there yet
                load.claim_at = now + CLAIM_RETRY_S
            else:
                self._fail(load, self._REFUSALS.get(result, f"the prefill instance refused the claim ({result!r})"),
                           None, release=result not in ("stale_boot", "claimed", "read"))

    def _post(self, load: Load, peer: Peer, now: float) -> None:
        load.posted_at, load.deadline = now, now + self.read_timeout
        try:
            handle, state, load.num_descriptors, load.num_bytes = self.t._post_read(load, peer.remote)
        except ValueError as e:  # the block ids do not fit (nothing posted)
            return self._fail(load, str(e), None)
        except Exception as e:
            logger.warning("request %s: posting the READ from %s failed: %s", load.spec.request_id, peer.engine_id, e)
            return self._fail(load, "the transfer could not be posted", None)
        load.state, load.handle = LoadState.READING, handle
        if state != "PROC":
            self._complete(load, state)

    def _heartbeat(self, now: float) -> None:
        self._next_heartbeat = now + self.config.heartbeat_seconds
        groups: dict[tuple[str, int, str | None], list[Load]] = {}
        for load in self.loads.values():  # waiting for blocks here, a handshake, a claim, or reading
            if not load.is_lost and load.state != LoadState.QUARANTINED:
                groups.setdefault((load.spec.remote_host, load.spec.remote_port, load.spec.remote_boot_id),
                                  []).append(load)
        for (host, port, boot_id), loads in groups.items():
            client = self.clients.get((host, port))
            if client.num_heartbeats_pending:  # the last one has not come back: skip, never queue up
                continue
            message = {"type": "heartbeat", "engine_id": self.t.engine_id, "boot_id": boot_id,
                       "remote_request_ids": [load.spec.remote_request_id for load in loads]}
            client.send(message, on_reply=lambda reply, _, at, batch=loads: self._on_heartbeat(batch, reply, at))

    def _on_heartbeat(self, loads: list[Load], reply: dict[str, Any], sent_at: float) -> None:
        expired = set(reply.get("expired") or [])
        gone = expired | set(reply.get("unknown") or [])
        for load in loads:
            if self.loads.get(load.spec.request_id) is not load:
                continue  # ended meanwhile: a late reply leaves nothing behind
            if load.spec.remote_request_id not in gone:
                load.lease_until = max(load.lease_until, sent_at + self.config.lease_seconds)
            elif load.state == LoadState.QUEUED:
                load.is_lost = load.spec.remote_request_id in expired  # (unknown: maybe not arrived yet)
            elif load.state == LoadState.READING:  # P freed the blocks: this READ cannot be good
                load.is_lost, load.lease_until, load.deadline = True, 0.0, 0.0

    def _send_release(self, spec: RecvSpec | KeepAliveSpec) -> None:
        self._notify("release", (spec.remote_host, spec.remote_port), spec.remote_boot_id, [spec.remote_request_id],
                     [spec.request_id])

    def send_done(self, peer: Peer, request_ids: list[str], claimants: list[str], attempt: int = 1) -> None:
        """Sent again once when it fails on the way (P would otherwise hold the blocks a whole lease); not
        when nothing listens there (P is gone, and its blocks with it), nor after a timeout (it may have
        arrived, and another wait as long would hold up this P's lane twice)."""
        def on_error(cause: str) -> None:
            if attempt < DONE_ATTEMPTS and cause not in (side_channel.CAUSE_REFUSED, side_channel.CAUSE_TIMEOUT):
                self.send_done(peer, request_ids, claimants, attempt + 1)
        self._notify("done", peer.address, peer.boot_id, request_ids, claimants, on_error)

    def _notify(self, kind: str, address: tuple[str, int], boot_id: str | None, request_ids: list[str],
                claimants: list[str], on_error: Callable[[str], None] | None = None) -> None:
        """claimants: D's request ids, one per P request id (the claim named them: P trusts only them)."""
        self.clients.get(address).send({"type": kind, "engine_id": self.t.engine_id, "boot_id": boot_id,
                                        "remote_request_ids": request_ids, "claimants": claimants},
                                       on_reply=lambda *_: None, on_error=on_error)

    def _apply_event(self, event: tuple) -> None:
        client, message, handler, on_error, args = event
        client.num_pending -= 1
        client.num_heartbeats_pending -= message["type"] == "heartbeat"
        if handler is None:
            return
        try:
            handler(*args)
        except Exception as e:  # a malformed reply, or a failed connect: fail what waited on it
            logger.warning("%s reply from %s:%d: %s: %s", message["type"], *client.address, type(e).__name__, e)
            if on_error is not None:
                on_error(str(e) if isinstance(e, RuntimeError) else f"a malformed reply ({type(e).__name__})")

    def num_pending(self) -> int:
        return sum(load.is_reported for load in self.loads.values()) + len(self._finished)

    def shutdown(self) -> None:
        self.clients.close()
        for load in [load for load in self.loads.values() if load.handle is not None]:
            self._release_handle(load, log=True)
        self.loads = {}
        for peer in list(self.peers.values()):
            self._drop_peer(peer)
