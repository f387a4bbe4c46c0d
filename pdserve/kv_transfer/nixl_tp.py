"""The `nixl` pull handoff between tensor-parallel instances of the same size T.

Each rank's KV cache holds its own KV heads, in its own process (and GPU), so each rank registers it
with an agent of its own, and D's rank r READs P's rank r's blocks: the same block ids, the same runs,
one descriptor per run per rank. The lifecycle (leases, claims, heartbeats, the side channel) stays whole
on rank 0 (pull_worker_common.py, lifecycle.py, as for one rank); only the transport hooks fan out:

  register: every rank registers its cache; rank 0's handshake lists the other ranks' agents and
            regions (their agent metadata base64-encoded), and the compatibility hash holds T, so a
            pair of different sizes is refused at the handshake, naming both
  connect:  D's rank r adds P's rank r's agent
  post:     every rank posts its READ of the runs (notif: P's request id, on each P rank's agent)
  check:    once per step, one call gathers every rank's transfer states (and P's notifications); a
            READ is DONE when every rank's is, ERR when any rank's is
  notifs:   P counts a request's READ done once every rank's agent was notified of it
  release, disconnect, deregister: on every rank

Ranks 1..T-1 run RankNixl (below) in their own processes. Rank 0 reaches them through `ranks`, the
engine's tensor-parallel executor (worker/tp_executor.py): ranks.call(op, per_rank_args) → one result
per rank 1..T-1, in order, or an exception. The executor makes these calls only between steps (before
it hands a step to the ranks, after the step is done), so a rank is never inside a collective when
asked.
"""
from __future__ import annotations

import base64
import itertools
import time
from typing import Any, Protocol

import torch

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.nixl import NixlConnectorWorker, nixl_agent, nixl_agent_config, post_transfer, transfer_state
from pdserve.kv_transfer.pull_worker_common import Load, Region, RemoteEngine
from pdserve.kv_transfer.transport_worker import region_of

NOTIF_TTL_S = 600.0   # P: a request notified by some ranks only (a D rank that died mid-READ) is forgotten


class Ranks(Protocol):
    size: int

    def call(self, op: str, per_rank_args: list[tuple] | None = None) -> list[Any]: ...


class RankNixl:
    """One rank's agent (ranks 1..T-1, in the rank's process), driven by rank 0's TPNixlConnectorWorker."""

    def __init__(self, agent_name: str, enable_prog_thread: bool) -> None:
        if nixl_agent is None:
            raise ImportError("kv_connector nixl: neither nixl nor nixl_cu13 is installed")
        self.agent_name = agent_name
        self.agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=enable_prog_thread,
                                                              backends=["UCX"]))
        self.region: Region | None = None
        self._kv_cache: torch.Tensor | None = None
        self._reg_descs = None
        self._handles: dict[int, Any] = {}
        self._ids = itertools.count()

    def register(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        self._kv_cache = kv_cache
        self._reg_descs = self.agent.register_memory(kv_cache)
        self.region = region_of(kv_cache)
        return {"agent_name": self.agent_name, "region": self.region.__dict__,
                "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode()}

    def connect(self, metadata: str) -> str:
        return self.agent.add_remote_agent(base64.b64decode(metadata))

    def post(self, remote_region: dict, remote_agent: str, runs: list[tuple[int, int, int]], notif: str
             ) -> tuple[int, str]:
        handle, state = post_transfer(self.agent, "READ", self.region, Region(**remote_region), remote_agent,
                                      runs, notif.encode())
        handle_id = next(self._ids)
        self._handles[handle_id] = handle
        return handle_id, state

    def poll(self) -> tuple[dict[int, str], list[str]]:
        """Every live READ's state, and the notifications that arrived (P's side)."""
        states = {i: transfer_state(self.agent, h) for i, h in self._handles.items()}
        notifs = [m.decode() for messages in self.agent.get_new_notifs().values() for m in messages]
        return states, notifs

    def release(self, handle_id: int) -> None:
        handle = self._handles.get(handle_id)
        if handle is not None:
            handle.release()   # raises for an active READ it cannot abort: the handle stays ours
            del self._handles[handle_id]

    def disconnect(self, agent_name: str) -> None:
        self.agent.remove_remote_agent(agent_name)

    def deregister(self) -> None:
        for handle in self._handles.values():
            try:
                handle.release()
            except Exception:
                pass
        self._handles.clear()
        if self._reg_descs is not None:
            self.agent.deregister_memory(self._reg_descs)
            self._reg_descs = None
        self._kv_cache = None


class _TPHandle:
    """Rank 0's READ and the other ranks' READ ids; each part is let go once."""

    def __init__(self, handle0: Any, rank_ids: list[int]) -> None:
        self.handle0, self.rank_ids = handle0, rank_ids


class TPNixlConnectorWorker(NixlConnectorWorker):
    """Rank 0's worker half of a tensor-parallel instance; see the module docstring."""

    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, str | int], ranks: Ranks) -> None:
        self.ranks = ranks
        self._rank_states: list[dict[int, str]] = []
        self._rank_notifs: list[list[str]] = []
        self._notif_counts: dict[str, tuple[int, float]] = {}   # P: request id → (ranks notified, first seen)
        super().__init__(config, engine_id, compat)
        self.ranks.call("kv_init", [(f"{engine_id}-rank{r}", config.enable_prog_thread)
                                    for r in range(1, ranks.size)])

    def _register(self, kv_cache: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        fields, blob = super()._register(kv_cache)
        fields["ranks"] = self.ranks.call("kv_register")
        return fields, blob

    def _connect(self, remote: RemoteEngine) -> None:
        remote_ranks = remote.reply.get("ranks")
        if not isinstance(remote_ranks, list) or len(remote_ranks) != self.ranks.size - 1:
            raise RuntimeError(f"remote engine {remote.engine_id} has {1 + len(remote_ranks or [])} tensor "
                               f"parallel ranks, this one {self.ranks.size}")
        super()._connect(remote)
        names = self.ranks.call("kv_connect", [(r["metadata"],) for r in remote_ranks])
        remote.conn = (remote.conn, names, [r["region"] for r in remote_ranks])

    def _post(self, load: Load, remote: RemoteEngine, runs: list[tuple[int, int, int]]) -> tuple[Any, str]:
        agent0, names, regions = remote.conn
        handle0, state0 = post_transfer(self.agent, "READ", self._region, remote.region, agent0, runs,
                                        load.spec.remote_request_id.encode())
        try:
            posted = self.ranks.call("kv_post", [(region, name, runs, load.spec.remote_request_id)
                                                 for region, name in zip(regions, names)])
        except Exception:
            handle0.release()
            raise
        handle = _TPHandle(handle0, [handle_id for handle_id, _ in posted])
        return handle, _combine([state0, *(state for _, state in posted)])

    def _post_read(self, load: Load, remote: RemoteEngine) -> tuple[Any, str, int, int]:
        handle, state, num_descriptors, num_bytes = super()._post_read(load, remote)
        return handle, state, num_descriptors * self.ranks.size, num_bytes * self.ranks.size  # every rank's

    def _check(self, handle: _TPHandle) -> str:
        states = [transfer_state(self.agent, handle.handle0) if handle.handle0 is not None else "DONE"]
        for rank_states, handle_id in zip(self._rank_states, handle.rank_ids):
            states.append(rank_states.get(handle_id, "PROC"))   # posted after this step's poll
        return _combine(states)

    def _release(self, handle: _TPHandle | None) -> None:
        """Raises while some rank's READ is active and cannot be aborted (the lifecycle then quarantines
        the load and calls again later; parts already let go are not let go twice)."""
        if handle is None:
            return
        if handle.handle0 is not None:
            handle.handle0.release()
            handle.handle0 = None
        self.ranks.call("kv_release", [(handle_id,) for handle_id in handle.rank_ids])

    def get_finished(self) -> tuple[set[str], set[str]]:
        # One round to the ranks a step, and only while something may be moving: D's READs, or P's blocks
        # under a lease (a READ of them completes, and notifies, only as the ranks' agents progress).
        if self._region is not None and (self.loader.num_pending() or self.holder.num_pending()):
            polled = self.ranks.call("kv_poll")
            self._rank_states = [states for states, _ in polled]
            self._rank_notifs = [notifs for _, notifs in polled]
        else:
            self._rank_states, self._rank_notifs = [], []
        return super().get_finished()

    def _take_notifs(self) -> list[str]:
        now = time.monotonic()
        notified = [m.decode() for messages in self.agent.get_new_notifs().values() for m in messages]
        for notifs in self._rank_notifs:
            notified += notifs
        done = []
        for request_id in notified:
            count, first = self._notif_counts.get(request_id, (0, now))
            if count + 1 == self.ranks.size:
                self._notif_counts.pop(request_id, None)
                done.append(request_id)
            else:
                self._notif_counts[request_id] = (count + 1, first)
        if self._notif_counts:
            self._notif_counts = {r: c for r, c in self._notif_counts.items() if now - c[1] < NOTIF_TTL_S}
        return done

    def _disconnect(self, remote: RemoteEngine) -> None:
        agent0, names, _ = remote.conn
        self.agent.remove_remote_agent(agent0)
        self.ranks.call("kv_disconnect", [(name,) for name in names])

    def _deregister(self) -> None:
        super()._deregister()
        self.ranks.call("kv_deregister")


def _combine(states: list[str]) -> str:
    if "ERR" in states:
        return "ERR"
    return "DONE" if all(s == "DONE" for s in states) else "PROC"
