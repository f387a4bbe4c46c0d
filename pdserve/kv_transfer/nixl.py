"""The worker halves over NIXL: pull (`nixl`: D READs P's KV blocks, P holds them under a lease) and push
(`nixl-push`: P WRITEs into blocks D announced).

The scheduler halves are pull.py's and push.py's; the lifecycles (leases, handshakes, claims or announces,
heartbeats, deadlines, cancels, failures) are lifecycle.py's and push_lifecycle.py's, reached through
PullConnectorWorker (pull_worker_common.py) and PushConnectorWorker (push_worker.py). NixlTransport fills
their transport hooks with NIXL calls:

  register: the KV cache is registered with the agent; the handshake carries the agent's metadata
  connect:  D adds P's agent (engine thread: the agent runs without locks, but for a pull P's on CPU,
            which its progress thread shares: NIXL's thread-safe mode)
  post:     one READ per request, one descriptor per coalesced run, without a NIXL notification: D
            tells P "done" over the side channel (notifies_done). A notification completes only once the
            target's agent is progressed, which P's engine does between steps, and a CPU prefill step
            lasts seconds: D's READ (and D's stream, after its first token) waited that long. Without it,
            the READ is one-sided and completes in D's own calls;
            push: one WRITE per transfer, notif_msg = the transfer id, which D's agent receives once the
            data is in its blocks (D's steps are short)
  check:    check_xfer_state, polled from get_finished; never blocks; the binding raising (a peer
            gone mid-READ) is that READ's "ERR", never an exception out of the engine loop
  release:  release_xfer_handle; for an active READ (past its deadline) NIXL tries to abort it and
            raises when it cannot: the lifecycle then keeps its blocks quarantined

A transfer UCX can only emulate (no zero-copy path between the two memories), and now and then one it
could move one-sided, needs both agents progressed: P's engine does it between steps, and a pull P's
own thread every HOLDING_PROGRESS_S while it holds grants.
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any, Callable

import numpy as np
import torch

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.pull_worker_common import Load, PullConnectorWorker, Region, RemoteEngine
from pdserve.kv_transfer.push_worker import PushConnectorWorker

try:
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError:
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError:
        nixl_agent = nixl_agent_config = nixl_thread_sync_t = None

logger = logging.getLogger(__name__)

# UCX settings pdserve's agents start with unless the environment sets them (UCX reads them as each
# agent starts). Measured with benchmarks/gpu_nixl_paths.py on one H100, two processes,
# 256 MiB (docs/benchmarks.md, 2026-12-07):
#   CUDA_IPC_ENABLE_GET_ZCOPY=y: a READ of another process's VRAM on the same GPU (pull with P and D
#     sharing a GPU) goes by cuda_ipc instead of UCX's software emulation over TCP: 0.59 -> 243 GB/s.
#   TCP_{TX,RX}_SEG_SIZE=1m: what has no zero-copy path between two processes (VRAM <-> another process's
#     DRAM: the store's pool) is emulated over TCP loopback in segments of this size: 8 KiB moved 0.6-1.0
#     GB/s, 1 MiB 2.5-4 GB/s. DRAM <-> DRAM goes by CMA either way (4-6 GB/s). UCX refuses a TCP segment
#     larger than the receiver's (the transfer fails): both sizes are set together, only where neither
#     is, and the pull and push handshakes compare them (ucx_tcp_segments in the compatibility dict), so
#     a peer with other sizes is refused naming both instead of failing its transfers.
UCX_DEFAULTS = {
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
}


def new_agent(name: str, enable_prog_thread: bool, what: str, thread_safe: bool = False) -> Any:
    """A NIXL agent over UCX, with UCX_DEFAULTS where the environment is silent. enable_prog_thread: a
    NIXL thread progresses UCX (a busy-polling core); off, progress happens inside our calls (once per
    engine step). thread_safe: calls from two threads are serialized by NIXL. `what` names the caller in
    the error when NIXL is not installed."""
    if nixl_agent is None:
        raise ImportError(f"{what}: neither nixl nor nixl_cu13 is installed")
    if torch.cuda.is_available():   # (without CUDA, UCX warns of a variable no loaded transport reads)
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", UCX_DEFAULTS["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"])
    if "UCX_TCP_TX_SEG_SIZE" not in os.environ and "UCX_TCP_RX_SEG_SIZE" not in os.environ:
        for key in ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"):
            os.environ[key] = UCX_DEFAULTS[key]
    sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if thread_safe else None
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=enable_prog_thread, backends=["UCX"], sync_mode=sync))


def ucx_tcp_segments() -> str:
    """The TCP segment sizes this process's agents use, for the handshake's compatibility check."""
    return "/".join(os.environ.get(key, "ucx-default") for key in ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"))


def _run_descs(region: Region, first_block_ids: list[int], num_blocks: list[int]) -> np.ndarray:
    """[num_runs, 3] descriptor rows (address, length, device id) for runs of blocks in region."""
    rows = np.empty((len(first_block_ids), 3), dtype=np.uint64)
    block_bytes = np.uint64(region.block_bytes)
    rows[:, 0] = np.uint64(region.base_addr) + np.array(first_block_ids, dtype=np.uint64) * block_bytes
    rows[:, 1] = np.array(num_blocks, dtype=np.uint64) * block_bytes
    rows[:, 2] = region.device_id
    return rows


def post_transfer(agent: Any, op: str, local: Region, remote: Region, remote_agent: str,
                  runs: list[tuple[int, int, int]], notif: bytes) -> tuple[Any, str]:
    """One READ or WRITE of the runs (local start, remote start, blocks) between two registered regions;
    (handle, state). The handle is released here when the post itself fails."""
    local_ids, remote_ids, num_blocks = zip(*runs)
    handle = agent.initialize_xfer(
        op, agent.get_xfer_descs(_run_descs(local, local_ids, num_blocks), local.mem_type),
        agent.get_xfer_descs(_run_descs(remote, remote_ids, num_blocks), remote.mem_type), remote_agent, notif)
    try:
        return handle, agent.transfer(handle)
    except Exception:
        handle.release()
        raise


def transfer_state(agent: Any, handle: Any) -> str:
    """PROC, DONE or ERR; never raises (the binding raises for a failed transfer, e.g. the peer died)."""
    try:
        return agent.check_xfer_state(handle)
    except Exception as e:
        logger.warning("NIXL transfer status: %s: %s", type(e).__name__, e)
        return "ERR"


class NixlTransport:
    """The NIXL hooks, for either direction (a mixin before the direction's worker class)."""

    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, str | int]) -> None:
        # A name per boot: a peer may still hold an earlier boot's agent (an idle connection, dropped only
        # after a while), and NIXL refuses a second agent of the same name.
        self.agent_name = f"{engine_id}-{uuid.uuid4().hex[:8]}"
        self.agent = new_agent(self.agent_name, config.enable_prog_thread, f"kv_connector {config.kv_connector}",
                               thread_safe=self._progresses_while_holding(config))
        self._reg_descs = None
        super().__init__(config, engine_id, {**compat, "ucx_tcp_segments": ucx_tcp_segments()})

    def _register(self, kv_cache: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        self._reg_descs = self.agent.register_memory(kv_cache)  # DRAM or VRAM from the tensor's device
        return {"agent_name": self.agent_name}, self.agent.get_agent_metadata()  # includes the registration

    def _connect(self, remote: RemoteEngine) -> None:
        self.agent.add_remote_agent(remote.blob)
        remote.conn = remote.reply["agent_name"]

    def _xfer(self, op: str, remote: RemoteEngine, runs: list[tuple[int, int, int]], notif: str) -> tuple[Any, str]:
        """One READ or WRITE of the runs (local start, remote start, blocks); (handle, state)."""
        return post_transfer(self.agent, op, self._region, remote.region, remote.conn, runs, notif.encode())

    def _check(self, handle: Any) -> str:
        return transfer_state(self.agent, handle)

    def _release(self, handle: Any) -> None:
        if handle is not None:
            handle.release()

    def _progresses_while_holding(self, config: KVTransferConfig) -> bool:
        return False

    def _take_notifs(self) -> list[str]:
        # Push's D: the notifications of WRITEs that landed (also progresses the agent); pull overrides it.
        return [m.decode() for messages in self.agent.get_new_notifs().values() for m in messages if m]

    def _disconnect(self, remote: RemoteEngine) -> None:
        self.agent.remove_remote_agent(remote.conn)

    def _deregister(self) -> None:
        if self._reg_descs is not None:
            self.agent.deregister_memory(self._reg_descs)
            self._reg_descs = None


HOLDING_PROGRESS_S = 0.002   # P: how often its agent is progressed while it holds grants (see below)


class ProgressWhileHolding:
    """A thread that progresses a P's agent every HOLDING_PROGRESS_S while holding() says it holds grants,
    and sleeps otherwise: what NIXL's own progress thread does for a READ that needs the target's agent,
    without polling a core while there is nothing to move. The agent must be thread-safe
    (new_agent(thread_safe=True)); what the progress brings in is dropped (only the claimant's "done" over
    the side channel ends a grant). Used by a pull P and by each of its tensor-parallel ranks."""

    def __init__(self, agent: Any, name: str, holding: Callable[[], bool]) -> None:
        self._agent, self._name, self._holding = agent, name, holding
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"nixl-progress-{name}")
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HOLDING_PROGRESS_S if self._holding() else 0.05):
            if self._holding():
                try:
                    self._agent.get_new_notifs()
                except Exception as e:   # never let the thread die on a transient binding error
                    logger.debug("NIXL progress: %s: %s", type(e).__name__, e)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=1.0)
        if self.thread.is_alive():
            logger.warning("NIXL progress thread of %s still running after 1 s", self._name)


class NixlConnectorWorker(NixlTransport, PullConnectorWorker):
    notifies_done = True   # the side channel, not a NIXL notification: see the module docstring

    def __init__(self, config: KVTransferConfig, engine_id: str, compat: dict[str, str | int]) -> None:
        super().__init__(config, engine_id, compat)
        # P, without NIXL's busy progress thread: most READs are one-sided, but UCX moved one in eight by a
        # path that waits for P's agent (docs/benchmarks.md, session 45), which P's engine progresses only
        # between steps of seconds on CPU. While P holds grants a thread of ours progresses it every
        # HOLDING_PROGRESS_S (the agent is thread-safe for it); idle, it sleeps.
        self._progress = (ProgressWhileHolding(self.agent, engine_id, lambda: self.holder.num_pending() > 0)
                          if self._progresses_while_holding(config) else None)

    def _progresses_while_holding(self, config: KVTransferConfig) -> bool:
        # On a GPU P's steps last milliseconds, so the thread rarely matters there; it costs nothing idle.
        return config.is_producer and not config.enable_prog_thread

    def _shutdown_lifecycle(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        super()._shutdown_lifecycle()

    def _post(self, load: Load, remote: RemoteEngine, runs: list[tuple[int, int, int]]) -> tuple[Any, str]:
        return self._xfer("READ", remote, runs, "")

    def _take_notifs(self) -> list[str]:
        # Progress, and drop what arrives: only the claimant's "done" ends a grant. A NIXL notification
        # names no claimant, and one from a single rank of a tensor-parallel D is not the whole READ.
        self.agent.get_new_notifs()
        return []


class NixlPushConnectorWorker(NixlTransport, PushConnectorWorker):
    """The push worker half over NIXL; engines run its tensor-parallel form (nixl_tp_push.py), for one rank
    too, which posts the WRITEs (_write) on every rank."""
