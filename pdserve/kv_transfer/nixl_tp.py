"""The `nixl` pull handoff for tensor-parallel instances, of the same size or not; and RankTransfers, RankFanOut
and RankReader, the rank fan-out and the ranks' transports that the push handoff (nixl_tp_push.py) and, for
its transfers, the store handoff (store_tp.py) share.

Each rank's KV cache holds its own KV heads, in its own process (and GPU), so each rank registers it
with an agent of its own and READs what it needs itself. The lifecycle (leases, claims, heartbeats, the
side channel) stays whole on rank 0 (pull_worker_common.py, lifecycle.py, as for one rank); only the
transport hooks fan out, to RankReader (below) on every rank:

  register: every rank registers its cache; rank 0's handshake reply lists the other ranks' agents
            (metadata base64-encoded) and regions. The compatibility hash holds the whole model's KV
            shape, not a rank's, so P and D of different sizes pair.
  connect:  each D rank adds the agents of the P ranks holding its heads (read_plan)
  post:     of the same size, D's rank r READs P's rank r's block runs into its cache (one descriptor
            per run per rank, as with one rank). Of different sizes, a rank's heads of a block are
            strided in the [blocks, layers, 2, slots, heads, dim] layout, so each D rank READs whole
            block runs of the P ranks holding its heads into its staging pool (staging.py; one
            descriptor per run per P rank), then copies its heads into its cache blocks once every READ
            of the round is done, in rounds when the pool is smaller than the load: P of T ranks to D of
            T/k reads k P ranks per D rank, nothing extra; P of T/k to D of T reads each P block k
            times, once per D rank that needs a part of it.
  check:    once per step one call gathers every rank's states; a load is DONE when every rank's READs
            (and copies) are, ERR when any is
  done:     D's READs carry no NIXL notification (one completes only as its target agent progresses,
            between P's steps: nixl.py); D tells P "done" over the side channel (notifies_done), once
            every rank's READ is done.
  progress: a P's ranks 1..T-1 progress their agents from a thread of their own every
            HOLDING_PROGRESS_S while rank 0 holds grants, as rank 0 does (a READ UCX can only emulate
            needs the target's agent progressed, and P's step can last seconds). Rank 0 tells them with
            each step's poll whether it holds any; between steps the last word stands.

A one-rank decode instance uses this worker too (ranks None), so that it can read a tensor-parallel P;
from a one-rank P it reads exactly as NixlConnectorWorker does. Ranks 1..T-1 are reached through
`ranks`, the engine's tensor-parallel executor (worker/tp_executor.py): ranks.call(op, per_rank_args) →
one result per rank, or an exception. The executor makes these calls only between steps, so a rank is
never inside a collective when asked.
"""
from __future__ import annotations

import base64
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.nixl import (NixlConnectorWorker, ProgressWhileHolding, new_agent, post_transfer,
                                      transfer_state)
from pdserve.kv_transfer.pull_worker_common import Load, Region, RemoteEngine
from pdserve.kv_transfer.staging import StagingPool
from pdserve.kv_transfer.tp_layout import grouped_layout, regroup_run, runs_of
from pdserve.kv_transfer.transport_worker import TransportWorker, coalesce, region_of, remote_tp_size
from pdserve.parallel.group import RankCallError

logger = logging.getLogger(__name__)



class Ranks(Protocol):
    size: int

    def call(self, op: str, per_rank_args: list[tuple] | None = None) -> list[Any]: ...


@dataclass(frozen=True)
class ReadPiece:
    remote_rank: int   # the remote rank to read from
    src_head: int      # first of the heads taken, within the remote rank's heads
    dst_head: int      # where they go, within this rank's heads
    num_heads: int


def read_plan(local_tp: int, rank: int, remote_tp: int, num_kv_heads: int) -> list[ReadPiece]:
    """What local rank `rank` of `local_tp` reads from a remote instance of `remote_tp` ranks, for a model
    of num_kv_heads KV heads; ValueError when one size does not divide the other."""
    local_heads, remote_heads = num_kv_heads // local_tp, num_kv_heads // remote_tp
    if remote_tp == local_tp:
        return [ReadPiece(rank, 0, 0, local_heads)]
    if max(local_tp, remote_tp) % min(local_tp, remote_tp):
        raise ValueError(f"tensor parallel sizes {local_tp} (here) and {remote_tp} (remote): one must divide "
                         "the other")
    if remote_tp < local_tp:   # a remote rank holds the heads of k of ours: ours are a part of its
        k = local_tp // remote_tp
        return [ReadPiece(rank // k, (rank % k) * local_heads, 0, local_heads)]
    k = remote_tp // local_tp
    return [ReadPiece(rank * k + j, 0, j * remote_heads, remote_heads) for j in range(k)]


@dataclass
class _Rounds:
    """A staged transfer's progress through the rank's staging pool (staging.py): blocks done .. done + n move
    through the range at start, then the next round takes a range."""
    op: str
    notif: str                   # a WRITE's: sent with its last round only (D counts it as the whole)
    agents: dict[int, tuple[str, Region]]
    remote_heads: int
    remote_block_ids: list[int]
    unit_bytes: int              # staging bytes of one block (every piece's)
    done: int = 0
    start: int | None = None     # the range held now
    n: int = 0
    failed: bool = False         # a round failed, or the transfer was let go: ERR, and no more rounds


@dataclass(eq=False)   # (one transfer is one _Read: the staging pool's line compares by identity)
class _Read:
    """One rank's part of one load: its transfers (the current round's, when staged), and its rounds when heads
    are regrouped through the staging pool."""
    xfers: list[Any]
    plan: list[ReadPiece]
    local_block_ids: list[int]
    rounds: _Rounds | None = None


class RankReader:
    """One rank's transport: its agent and cache, the remote ranks it reads, its reads in flight.
    Ranks 1..T-1 run one in their processes; rank 0 runs one over the worker half's own agent."""

    def __init__(self, agent: Any, agent_name: str, rank: int, tp_size: int, num_kv_heads: int,
                 staging_bytes: int = KVTransferConfig.staging_bytes) -> None:
        self.agent, self.agent_name = agent, agent_name
        self.staging_bytes = staging_bytes
        self.staging: StagingPool | None = None   # made at the first staged transfer
        self.rank, self.tp_size, self.num_kv_heads = rank, tp_size, num_kv_heads
        self.kv_cache: torch.Tensor | None = None
        self.region: Region | None = None
        self._reg_descs = None
        self.remotes: dict[str, tuple[int, dict[int, tuple[str, Region]]]] = {}  # key → (remote tp, rank → agent)
        self._reads: dict[int, _Read] = {}
        self._ids = itertools.count()
        self.holding = False   # a P's rank: rank 0 holds grants (its last poll said so)
        self._progress: ProgressWhileHolding | None = None
        self.store_pool = None   # the KV store's pool, where mapped on this host (store_tp.py)

    @classmethod
    def create(cls, agent_name: str, enable_prog_thread: bool, rank: int, tp_size: int,
               num_kv_heads: int, progress_while_holding: bool = False,
               staging_bytes: int = KVTransferConfig.staging_bytes) -> RankReader:
        agent = new_agent(agent_name, enable_prog_thread, "a tensor-parallel rank's KV transfers",
                          thread_safe=progress_while_holding)
        reader = cls(agent, agent_name, rank, tp_size, num_kv_heads, staging_bytes)
        if progress_while_holding:
            reader._progress = ProgressWhileHolding(agent, agent_name, lambda: reader.holding)
        return reader

    def register(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        self.check_staging_bytes(kv_cache)
        self.kv_cache = kv_cache
        self._reg_descs = self.agent.register_memory(kv_cache)
        self.region = region_of(kv_cache)
        return {"agent_name": self.agent_name, "region": self.region.__dict__,
                "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode()}

    def adopt(self, kv_cache: torch.Tensor, region: Region) -> None:
        """Rank 0: the worker half registered the cache already (and checked staging_bytes before the ranks
        registered theirs)."""
        self.kv_cache, self.region = kv_cache, region

    def check_staging_bytes(self, kv_cache: torch.Tensor) -> None:
        """At start: the pool must hold one block's staging for a peer of any size, at most a block of the
        whole model's KV (a peer of one rank, or the store); found only at the first transfer, every
        request would fail."""
        whole_block = kv_cache[0].numel() * kv_cache.element_size() * self.tp_size
        if not StagingPool.holds(self.staging_bytes, whole_block):
            raise ValueError(f"staging_bytes ({self.staging_bytes}) must hold a block of the model's whole KV "
                             f"({whole_block} bytes): transfers between tensor-parallel sizes move through it")

    def connect(self, key: str, remote_ranks: list[dict[str, Any]]) -> None:
        """remote_ranks: every remote rank's {agent_name, region, metadata or None (rank 0's agent, added by
        the worker half already)}; only the ranks this one reads are added."""
        remote_tp = len(remote_ranks)
        agents = {}
        for piece in read_plan(self.tp_size, self.rank, remote_tp, self.num_kv_heads):
            entry = remote_ranks[piece.remote_rank]
            name = self.agent.add_remote_agent(base64.b64decode(entry["metadata"])) if entry["metadata"] \
                else entry["agent_name"]
            agents[piece.remote_rank] = (name, Region(**entry["region"]))
        self.remotes[key] = (remote_tp, agents)

    def disconnect(self, key: str, keep_first: bool) -> None:
        remote = self.remotes.pop(key, None)
        if remote is not None:
            for remote_rank, (name, _) in remote[1].items():
                if not (keep_first and remote_rank == 0):   # rank 0's own agent: the worker half's to remove
                    self.agent.remove_remote_agent(name)

    def post(self, key: str, local_block_ids: list[int], remote_block_ids: list[int], op: str = "READ",
             notif: str = "") -> tuple[int, str, int]:
        """(transfer id here, state, NIXL descriptors posted). A WRITE (push) carries its notification to
        every remote rank it writes into (read_plan names those too)."""
        remote_tp, agents = self.remotes[key]
        plan = read_plan(self.tp_size, self.rank, remote_tp, self.num_kv_heads)
        read = _Read([], plan, list(local_block_ids))
        try:
            if remote_tp == self.tp_size:
                name, region = agents[plan[0].remote_rank]   # the same heads: straight into the cache
                runs = coalesce(local_block_ids, remote_block_ids)
                read.xfers.append(post_transfer(self.agent, op, self.region, region, name, runs, notif.encode())[0])
                num_descriptors = len(runs)
            elif op == "WRITE" and remote_tp < self.tp_size:
                num_descriptors = self._post_write_between_sizes(read, agents, remote_tp, remote_block_ids, notif)
            else:
                num_descriptors = self._start_rounds(read, agents, remote_tp, remote_block_ids, op, notif)
        except Exception:
            self._let_go(read)
            raise
        read_id = next(self._ids)
        self._reads[read_id] = read
        return read_id, self._state(read), num_descriptors

    def _start_rounds(self, read: _Read, agents: dict, remote_tp: int, remote_block_ids: list[int], op: str,
                      notif: str) -> int:
        """Through the staging pool, in the remote ranks' block layout: a READ lands there and each round is
        copied into the cache once its READs are done; a WRITE (push to a D of more ranks, whose heads are a
        part of ours) sends each remote rank its heads of the blocks, copied there first. The first round
        is posted here when the pool has room. The descriptors returned are those of the transfer's runs (per
        piece); one split into rounds posts up to one more per piece at each round's boundary."""
        layers, _, slots, _, dim = self.kv_cache.shape[1:]
        remote_heads = self.num_kv_heads // remote_tp
        unit = len(read.plan) * layers * 2 * slots * remote_heads * dim * self.kv_cache.element_size()
        pool = self._staging_pool()
        if not pool.fits(unit):
            raise ValueError(f"staging_bytes ({pool.num_bytes}) cannot hold one block's staging ({unit} bytes) "
                             f"for a peer of {remote_tp} ranks (here {self.tp_size}): raise staging_bytes in "
                             "--kv-transfer-config")
        read.rounds = _Rounds(op, notif, agents, remote_heads, list(remote_block_ids), unit)
        n = len(remote_block_ids)
        return len(read.plan) * len(coalesce(list(range(n)), remote_block_ids))

    def _staging_pool(self) -> StagingPool:
        if self.staging is None:
            try:
                self.staging = StagingPool(self.agent, self.staging_bytes, self.kv_cache.device)
            except RuntimeError as error:   # (torch.OutOfMemoryError on a GPU; the CPU allocator's own)
                raise RuntimeError(f"no memory for the {self.staging_bytes}-byte staging buffer that transfers "
                                   "between tensor-parallel sizes need: lower staging_bytes in "
                                   f"--kv-transfer-config or the KV cache's share of memory ({error})") from None
        return self.staging

    def _staging_view(self, read: _Read) -> torch.Tensor:
        """[pieces * n, layers, 2, slots, remote heads, dim] of this round: piece j's blocks at j * n .."""
        r = read.rounds
        layers, _, slots, _, dim = self.kv_cache.shape[1:]
        return self.staging.view(r.start, (len(read.plan) * r.n, layers, 2, slots, r.remote_heads, dim),
                                 self.kv_cache.dtype)

    def _advance(self, read: _Read) -> str:
        """A staged transfer's state, moving it on: a round done is copied in (READ) and its range given
        back; the next takes a range (when it is this transfer's turn and one is free) and is posted. Never
        raises (it runs inside every poll): a round that fails makes the transfer ERR."""
        r = read.rounds
        if r.failed:   # (a round NIXL could not abort yet still moves: not over until it is)
            return "PROC" if any(transfer_state(self.agent, x) == "PROC" for x in read.xfers) else "ERR"
        while not r.failed:
            if r.start is None:
                total = len(r.remote_block_ids)
                if r.done == total:
                    return "DONE"
                taken = self.staging.take(read, r.unit_bytes, total - r.done) if self.staging else None
                if taken is None:
                    return "PROC"   # (its turn comes as earlier transfers give their ranges back)
                r.start, r.n = taken
                if not self._guarded(read, "post", self._post_round):
                    break
            state = combine([transfer_state(self.agent, x) for x in read.xfers])
            if state != "DONE":
                return state
            if not self._guarded(read, "finish", self._finish_round):
                break
        return "ERR"

    def _guarded(self, read: _Read, what: str, step: Any) -> bool:
        """step(read); False once it raised: the transfer is ERR, and its round is let go where NIXL can (where
        it cannot, the range stays the round's and release() tries again)."""
        try:
            step(read)
            return True
        except Exception as error:
            r = read.rounds
            logger.warning("a staged %s failed to %s a round of %d blocks: %s: %s", r.op, what, r.n,
                           type(error).__name__, error)
            r.failed = True
            try:
                self._drop_round(read)
            except Exception as e:
                logger.warning("NIXL could not release a transfer yet: %s", e)
            return False

    def _finish_round(self, read: _Read) -> None:
        r = read.rounds
        event = None
        if r.op == "READ":
            staging, n = self._staging_view(read), r.n
            index = torch.tensor(read.local_block_ids[r.done:r.done + n], device=self.kv_cache.device)
            for j, p in enumerate(read.plan):
                self.kv_cache[index, :, :, :, p.dst_head:p.dst_head + p.num_heads] = \
                    staging[j * n:(j + 1) * n, :, :, :, p.src_head:p.src_head + p.num_heads]
            if staging.is_cuda:   # the range is free once the copy has run, not when it is queued
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(staging.device))
        self._drop_round(read, event)
        r.done += r.n
        r.n = 0

    def _post_round(self, read: _Read) -> None:
        r = read.rounds
        staging, n = self._staging_view(read), r.n
        if r.op == "WRITE":
            index = torch.tensor(read.local_block_ids[r.done:r.done + n], device=self.kv_cache.device)
            for j, p in enumerate(read.plan):
                staging[j * n:(j + 1) * n] = self.kv_cache[index, :, :, :, p.dst_head:p.dst_head + p.num_heads]
            if staging.is_cuda:   # NIXL reads the staging by DMA, outside the stream that fills it
                torch.cuda.current_stream(staging.device).synchronize()
        region = region_of(staging)
        last = r.done + n == len(r.remote_block_ids)
        notif = (r.notif if last else "").encode()
        for j, piece in enumerate(read.plan):
            name, remote = r.agents[piece.remote_rank]
            runs = coalesce(list(range(j * n, (j + 1) * n)), r.remote_block_ids[r.done:r.done + n])
            read.xfers.append(post_transfer(self.agent, r.op, region, remote, name, runs, notif)[0])

    def _drop_round(self, read: _Read, event: Any = None) -> None:
        """Lets the round's transfers go (raises for one still active that cannot be aborted: the range stays
        its), then gives its range back."""
        r = read.rounds
        while read.xfers:
            read.xfers[-1].release()
            read.xfers.pop()
        if r.start is not None:
            self.staging.give_back(r.start, r.n * r.unit_bytes, event)
            r.start = None

    def _post_write_between_sizes(self, read: _Read, agents: dict, remote_tp: int, remote_block_ids: list[int],
                                  notif: str) -> int:
        """Push to a D of fewer ranks (k = ours / its): this rank's heads are a contiguous k-th of each slot
        there, strided in D's blocks, so it writes its blocks whole into the k-th part of each run of D's
        blocks (grouped_layout), one descriptor per run; D regroups once every rank's has come (regroup).
        (A D of more ranks takes rounds through the staging pool: _start_rounds.)"""
        k = self.tp_size // remote_tp
        name, region = agents[read.plan[0].remote_rank]
        # D's cache seen in blocks of our size: its block b is our-sized blocks b*k .. b*k+k-1
        fine = Region(region.base_addr, region.num_blocks * k, region.block_bytes // k, region.mem_type,
                      region.device_id)
        if fine.block_bytes * k != region.block_bytes or fine.block_bytes != self.region.block_bytes:
            raise ValueError(f"a block of {region.block_bytes} bytes there does not hold {k} of "
                             f"{self.region.block_bytes} bytes here")
        runs = coalesce(read.local_block_ids, grouped_layout(remote_block_ids, k, self.rank % k))
        read.xfers.append(post_transfer(self.agent, "WRITE", self.region, fine, name, runs, notif.encode())[0])
        return len(runs)

    def regroup(self, block_ids: list[int], k: int) -> None:
        """D: k ranks of a bigger P wrote their heads of these blocks in grouped_layout; put every head back
        in its place in each slot ([blocks, layers, 2, slots, heads, dim])."""
        outer = self.kv_cache.shape[1] * self.kv_cache.shape[2] * self.kv_cache.shape[3]
        blocks = self.kv_cache.view(-1).view(torch.uint8).view(self.kv_cache.shape[0], -1)
        for start, n in runs_of(block_ids):
            regroup_run(blocks[start:start + n], k, outer)

    def attach_store(self, description: Any, boot_id: str, num_slots: int, block_bytes: int) -> bool:
        """The KV store's pool mapped here for this rank's heads (kv_transfer/store_tp.py); False: it cannot be."""
        from pdserve.kv_transfer.store_shm import attach
        self.detach_store()
        self.store_pool = attach(description, boot_id, num_slots, block_bytes, self.kv_cache,
                                 (self.rank, self.tp_size))
        return self.store_pool is not None

    def copy_store(self, op: str, runs: list[tuple[int, int, int]]) -> None:
        """A store transfer by copies, this rank's heads: done when this returns."""
        if self.store_pool is None:
            raise RuntimeError("the KV store's pool is not mapped on this rank")
        self.store_pool.copy(op, runs).release()   # (release waits for a GPU's copies)

    def detach_store(self) -> None:
        if self.store_pool is not None:
            self.store_pool.close()
            self.store_pool = None

    def _state(self, read: _Read) -> str:
        if read.rounds is not None:
            return self._advance(read)
        return combine([transfer_state(self.agent, x) for x in read.xfers])

    def state_of(self, read_id: int) -> str:
        return self._state(self._reads[read_id])

    def poll(self, holding: bool = False) -> dict[int, str]:
        """Every read's state (copied into the cache once done); progresses the agent. holding: whether
        rank 0 (of a P) holds grants, so that this rank's thread progresses the agent until told otherwise."""
        self.holding = holding
        states = {i: self._state(r) for i, r in self._reads.items()}
        self.agent.get_new_notifs()
        return states

    def poll_writes(self) -> tuple[dict[int, str], list[str]]:
        """Push: the state of every WRITE posted here (P), and the notifications of WRITEs into this rank
        that arrived since the last call (D: write_notif messages); progresses the agent."""
        states = {i: self._state(r) for i, r in self._reads.items()}
        notifs = [m.decode() for messages in self.agent.get_new_notifs().values() for m in messages if m]
        return states, notifs

    def release(self, read_id: int) -> None:
        read = self._reads.get(read_id)
        if read is not None:
            self._let_go(read)   # raises for a READ still active that cannot be aborted: it stays ours
            del self._reads[read_id]

    def _let_go(self, read: _Read) -> None:
        if read.rounds is None:
            while read.xfers:
                read.xfers[-1].release()
                read.xfers.pop()
            return
        read.rounds.failed = True   # let go: never another round, even while this one cannot be aborted
        if self.staging is not None:
            self.staging.leave(read)
        self._drop_round(read)

    def deregister(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        self.detach_store()
        for read in self._reads.values():
            try:
                self._let_go(read)
            except Exception:
                pass
        self._reads.clear()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self._reg_descs is not None:
            self.agent.deregister_memory(self._reg_descs)
            self._reg_descs = None
        self.kv_cache = None


def combine(states: list[str]) -> str:
    if "ERR" in states:
        return "ERR"
    return "DONE" if all(s == "DONE" for s in states) else "PROC"


class _TPHandle:
    """A transfer's id on every rank (rank 0's first); each is let go once. erred: some rank's part failed
    to post or was let go before the whole was done: the transfer can never be done, whatever the other
    ranks' parts say (a rank without an id would otherwise count as done)."""

    def __init__(self, read_ids: list[int | None], num_descriptors: int) -> None:
        self.read_ids, self.num_descriptors = read_ids, num_descriptors
        self.erred = False


class RankTransfers:
    """A transfer on every rank of a tensor-parallel instance, from rank 0's worker half: posting it and its
    release (each handoff judges its combined state: RankFanOut._check, store_tp._state). self.local is rank
    0's RankReader over the worker half's own agent (the worker class provides agent, agent_name and config);
    self._rank_states the ranks' last poll."""

    ranks: Ranks | None
    tp_size: int
    local: RankReader
    _rank_states: list[dict[int, str]]

    def _init_ranks(self, ranks: Ranks | None, num_kv_heads: int, progress_while_holding: bool) -> None:
        self.local = RankReader(self.agent, self.agent_name, 0, self.tp_size, num_kv_heads,
                                self.config.staging_bytes)
        self._call("kv_init", [(f"{self.agent_name}-rank{r}", self.config.enable_prog_thread, r, self.tp_size,
                                num_kv_heads, progress_while_holding, self.config.staging_bytes)
                               for r in range(1, self.tp_size)])

    def _call(self, op: str, per_rank_args: list[tuple] | None = None) -> list[Any]:
        return self.ranks.call(op, per_rank_args) if self.ranks is not None else []

    def get_stats(self) -> dict[str, Any]:
        """Plus rank 0's staging pool (every rank's moves the same transfers): what an operator looks at when
        transfers between sizes wait, e.g. behind one NIXL cannot abort."""
        pool = self.local.staging
        return {**super().get_stats(),
                "kv_staging_bytes_in_use": pool.num_bytes - pool.bytes_free() if pool is not None else 0,
                "kv_staging_transfers_waiting": pool.num_waiting() if pool is not None else 0}

    def _call_quietly(self, op: str, per_rank_args: list[tuple] | None = None) -> None:
        """An undo on the ranks: failures are logged, not raised."""
        try:
            self._call(op, per_rank_args)
        except Exception as error:
            logger.warning("tensor parallel %s: %s: %s", op, type(error).__name__, error)

    def _post_on_ranks(self, request_id: str, key: str, local_block_ids: list[int], remote_block_ids: list[int],
                       op: str, notifs: list[str] | None = None) -> tuple[_TPHandle, str]:
        """The transfer on every rank, to the remote connected under key; notifs: each rank's notification (a
        WRITE's), rank 0's first."""
        notifs = notifs or [""] * self.tp_size
        transfer_id, state0, num_descriptors = self.local.post(key, local_block_ids, remote_block_ids, op,
                                                               notifs[0])
        handle = _TPHandle([transfer_id], num_descriptors)
        try:
            posted = self._call("kv_post", [(key, local_block_ids, remote_block_ids, op, notif)
                                            for notif in notifs[1:]])
        except RankCallError as error:
            # Some ranks posted: the transfer fails through the caller's ERR path, which lets every posted
            # transfer go before the blocks go back to the pool (or quarantines them while one cannot be aborted).
            logger.warning("request %s: %s", request_id, error)
            handle.read_ids += [r[0] if r is not None else None for r in error.results]
            handle.erred = True
            return handle, "ERR"
        except Exception:
            self._release(handle)
            raise
        handle.read_ids += [read_id for read_id, _, _ in posted]
        handle.num_descriptors += sum(n for _, _, n in posted)
        return handle, combine([state0, *(state for _, state, _ in posted)])

    def _release(self, handle: _TPHandle | None) -> None:
        """Raises while some rank's transfer is active and cannot be aborted (the caller then quarantines
        it and calls again later; parts already let go are not let go twice)."""
        if handle is None:
            return
        handle.erred = True   # (let go: checked again only while a part cannot be aborted, never done)
        if handle.read_ids[0] is not None:
            self.local.release(handle.read_ids[0])
            handle.read_ids[0] = None
        rest = handle.read_ids[1:]
        if any(r is not None for r in rest):
            self._call("kv_release", [(r,) for r in rest])   # (None: that rank holds nothing)
            handle.read_ids[1:] = [None] * len(rest)


class RankFanOut(RankTransfers):
    """What rank 0's worker half of a pull or push handoff fans out to ranks 1..T-1, whatever the direction (a
    mixin before the direction's NIXL worker class): registration and connections to the peers, beside the
    transfers (RankTransfers)."""

    def _register(self, kv_cache: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        self.local.check_staging_bytes(kv_cache)   # here, before the ranks would each refuse it less plainly
        fields, blob = super()._register(kv_cache)
        fields["tp_ranks"] = self._call("kv_register")   # ranks 1..T-1
        return fields, blob

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        self.local.adopt(self._kv_cache, self._region)

    def _connect(self, remote: RemoteEngine) -> None:
        super()._connect(remote)   # rank 0's agent → the remote rank 0's agent (named remote.conn)
        entries = [{"agent_name": remote.conn, "region": remote.region.__dict__, "metadata": None},
                   *(remote.reply.get("tp_ranks") or [])]
        key = f"{remote.engine_id}:{remote.reply.get('boot_id')}"
        try:
            self.local.connect(key, entries)
            # ranks 1..T-1 may need the remote rank 0 too (a remote of fewer ranks): they get its metadata
            entries[0] = {**entries[0], "metadata": base64.b64encode(remote.blob).decode()}
            self._call("kv_connect", [(key, entries)] * (self.tp_size - 1))
        except Exception:   # undo what the handshake did here and on the ranks that connected
            self.local.disconnect(key, keep_first=True)
            self.agent.remove_remote_agent(remote.conn)
            self._call_quietly("kv_disconnect", [(key, False)] * (self.tp_size - 1))   # (a no-op where not)
            raise
        remote.conn = (remote.conn, key, len(entries))

    def _post_ranks(self, request_id: str, remote: RemoteEngine, local_block_ids: list[int],
                    remote_block_ids: list[int], op: str, notifs: list[str] | None = None) -> tuple[_TPHandle, str]:
        return self._post_on_ranks(request_id, remote.conn[1], local_block_ids, remote_block_ids, op, notifs)

    def _check(self, handle: _TPHandle) -> str:
        if handle.erred:
            return "ERR"
        states = [self.local.state_of(handle.read_ids[0]) if handle.read_ids[0] is not None else "DONE"]
        for rank_states, read_id in zip(self._rank_states, handle.read_ids[1:]):
            states.append(rank_states.get(read_id, "PROC") if read_id is not None else "DONE")
        return combine(states)

    def _check_tp_pair(self, region: Region, reply: dict[str, Any], engine_id: str) -> None:
        """RuntimeError naming the peer when its blocks cannot pair with ours: of the same size, a block of
        another size; of another size, sizes of which neither divides the other."""
        remote_tp = remote_tp_size(reply)
        if remote_tp == self.tp_size:
            TransportWorker._check_remote_region(self, region, reply, engine_id)
        else:   # a rank's block is another size there: the plan must exist
            try:
                read_plan(self.tp_size, 0, remote_tp, self.local.num_kv_heads)
            except ValueError as e:
                raise RuntimeError(f"KV layout mismatch with remote engine {engine_id}: {e}") from None

    def _disconnect(self, remote: RemoteEngine) -> None:
        agent0, key, _ = remote.conn
        self.local.disconnect(key, keep_first=True)
        self.agent.remove_remote_agent(agent0)
        self._call("kv_disconnect", [(key, False)] * (self.tp_size - 1))

    def _deregister(self) -> None:
        self.local.deregister()   # its transfers; the cache's registration is the worker half's
        super()._deregister()
        try:
            self._call("kv_deregister")
        except Exception as error:   # a rank lost: its process ends with the instance anyway
            logger.warning("tensor parallel kv_deregister: %s: %s", type(error).__name__, error)


class TPNixlConnectorWorker(RankFanOut, NixlConnectorWorker):
    """Rank 0's worker half of a tensor-parallel instance, or a one-rank decode instance's (ranks None)."""

    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, str | int],
                 ranks: Ranks | None, num_kv_heads: int) -> None:
        self.ranks = ranks
        self.tp_size = ranks.size if ranks is not None else 1
        self._rank_states: list[dict[int, str]] = []
        self._ranks_holding = False   # what the last poll told the ranks
        super().__init__(config, engine_id, compat)
        self._init_ranks(ranks, num_kv_heads, self._progress is not None)

    def start_load_kv(self, meta: Any) -> None:
        super().start_load_kv(meta)
        # Grants begin here, before the step goes to the ranks: tell them now, not after that step (a
        # READ arriving during it would wait the step out on ranks 1..T-1).
        if (self._progress is not None and not self._ranks_holding and self.ranks is not None
                and self._region is not None and self.holder.num_pending()):
            self._call("kv_poll", [(True,)] * (self.tp_size - 1))
            self._ranks_holding = True

    def _check_remote_region(self, region: Region, reply: dict[str, Any], engine_id: str) -> None:
        self._check_tp_pair(region, reply, engine_id)

    def _post(self, load: Load, remote: RemoteEngine, runs: list[tuple[int, int, int]]) -> tuple[Any, str]:
        spec = load.spec
        return self._post_ranks(spec.request_id, remote, spec.local_block_ids, spec.remote_block_ids, "READ")

    def _post_read(self, load: Load, remote: RemoteEngine) -> tuple[Any, str, int, int]:
        """The KV handed over (every rank's heads; the blocks of a P of fewer ranks are read more than
        once, which is not counted) and every rank's descriptors."""
        handle, state, _, num_bytes = super()._post_read(load, remote)
        return handle, state, handle.num_descriptors, num_bytes * self.tp_size

    def get_finished(self) -> tuple[set[str], set[str]]:
        # One round to the ranks a step, and only while something may be moving: D's READs, or P's blocks
        # under a lease (a READ UCX can only emulate needs the ranks' agents progressed), or to tell the
        # ranks' progress threads that P holds nothing any more.
        holding = self._progress is not None and self.holder.num_pending() > 0
        if self.ranks is not None and self._region is not None and (
                self.loader.num_pending() or self.holder.num_pending() or holding != self._ranks_holding):
            self._rank_states = self._call("kv_poll", [(holding,)] * (self.tp_size - 1))
            self._ranks_holding = holding
        else:
            self._rank_states = []
        return super().get_finished()
