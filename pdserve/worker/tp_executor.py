"""A tensor-parallel instance: rank 0's ModelRunner in the engine process, ranks 1..T-1 in their own.

The lifecycle, from rank 0's side (TPExecutor):
1. Open a TCPStore on 127.0.0.1 (the OS picks the port) and start one process per other rank
   (`python -m pdserve.worker.tp_executor FD PARENT_PID`), each with a socket to rank 0. A rank watches
   its parent from a thread of its own and exits within a second of it, even a SIGKILLed one, even while
   blocked in a collective (PR_SET_PDEATHSIG would fire when the thread that started the rank ends: an
   offline LLM built in a worker thread lost its ranks with that thread). One TP instance per process:
   torch.distributed has one default group.
2. Send each rank its (config, rank, size, store port, cores). Every rank joins the process group
   (gloo on CPU, NCCL on CUDA), loads its slices of the weights and allocates its KV cache (the ranks
   agree on the number of blocks), then reports "ready", or "failed" with the reason; rank 0 waits
   for all of them with a deadline.
3. Each step: send the SchedulerOutput to every rank, then run it here. All ranks build the same
   inputs and meet in the model's collectives; rank 0 samples and broadcasts the tokens. The other
   ranks answer nothing (no round trip per step).
   With a KV connector (P/D), its worker half is rank 0's alone (kv_transfer/nixl_tp.py): it reaches
   the other ranks' transports through call(), which the executor makes only between steps: the
   connector's start_load_kv runs before the step is sent, its report after the step is done, so no
   rank is inside a collective when asked. A call is answered within CALL_TIMEOUT_S or the rank is lost.
4. A rank that dies or hangs: rank 0's next collective fails (at once for a closed socket, after
   COLLECTIVE_TIMEOUT_S for a hung rank) and the step raises RankLost; so does any failure raised inside
   torch.distributed, and an interrupt (KeyboardInterrupt) in the middle of a step, since the ranks are
   then out of step for good. The engine is then broken and its process ends; whoever supervises the
   instance (`pdserve up`) starts it again. The engine loop also asks dead_rank() while idle, so a rank
   that died between requests ends the instance before a client pays for it.
5. shutdown(): "shutdown" to every rank, a bounded wait for each to exit, then SIGKILL.

The scheduler, the KV cache manager and the engine loop are those of one rank: they see this object
through the ModelRunner methods they call (launch, collect, execute_model, warm_up).
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.model.loader import load_model_config
from pdserve.parallel.group import COLLECTIVE_TIMEOUT_S, RankCallError, TPGroup, destroy_tp_group
from pdserve.parallel.sharding import check_tp_size
from pdserve.worker.cpu_threads import set_num_threads
from pdserve.core.batch import ModelRunnerOutput
from pdserve.worker.model_runner import ModelRunner, StepHandle, connector_output, resolve_device_and_dtype

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0     # every rank loaded and ready (weights from disk, a KV cache to touch)
RENDEZVOUS_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 10.0
CALL_TIMEOUT_S = COLLECTIVE_TIMEOUT_S   # a rank's answer to call(): it may first finish the step it is in
PARENT_CHECK_S = 1.0


class RankLost(RuntimeError):
    """A rank of the group died or stopped answering: the instance cannot step any more."""



def split_cores(cores: list[int], size: int) -> list[list[int]]:
    """Each rank's cores: disjoint contiguous shares when there are enough, else all of them for each
    (shared: see rank_threads)."""
    if len(cores) < size:
        return [list(cores) for _ in range(size)]
    share, extra = divmod(len(cores), size)
    out, start = [], 0
    for rank in range(size):
        end = start + share + (rank < extra)
        out.append(cores[start:end])
        start = end
    return out


def rank_threads(config: EngineConfig, cores: list[int], is_shared: bool) -> int:
    """--num-threads wins; else one thread per core of the rank's own share, or, where the ranks share
    their cores (fewer cores than ranks), one each: OpenMP threads that outnumber the cores wait on
    descheduled peers."""
    if config.num_threads:
        return config.num_threads
    return 1 if is_shared else len(cores)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    device, _ = resolve_device_and_dtype(config.model)
    if device.type != "cuda":
        return device
    size = config.parallel.tensor_parallel_size
    if torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size: {size} needs {size} visible GPUs (one per rank), "
                         f"found {torch.cuda.device_count()}")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def _join_group(rank: int, size: int, store: dist.Store, device: torch.device) -> TPGroup:
    if device.type == "cpu":
        # Every rank is on this host: gloo's sockets on loopback, whatever the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return TPGroup(rank, size)


class TPExecutor:
    """Rank 0 of a tensor-parallel group, with the ModelRunner interface the engine uses."""

    def __init__(self, config: EngineConfig, num_blocks: int | None = None) -> None:
        size = config.parallel.tensor_parallel_size
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size: one tensor-parallel instance per process (this one has a "
                             "process group already); shut the other down first")
        self._owns_group = False
        shape = load_model_config(config.model.model)   # refuse a size the model cannot take before any rank starts
        check_tp_size(size, shape.num_heads, shape.num_kv_heads, shape.intermediate_size)
        self.size, self.lost = size, None
        self._connector = None
        all_cores = sorted(os.sched_getaffinity(0))
        cores, is_shared = split_cores(all_cores, size), len(all_cores) < size
        self.workers: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
                              wait_for_workers=False)
        try:
            for rank in range(1, size):
                self._start_rank(rank, (config, rank, size, store.port, cores[rank], is_shared, num_blocks))
            os.sched_setaffinity(0, cores[0])
            set_num_threads(rank_threads(config, cores[0], is_shared), "tensor parallel rank 0")
            device = rank_device(config, 0)
            self.group = _join_group(0, size, store, device)
            self._owns_group = True
            self.runner = ModelRunner(config.model, config.cache, None, num_blocks,
                                      max_num_seqs=config.scheduler.max_num_seqs, tp=self.group, device=device)
            self._wait_ready()
        except BaseException as error:
            # A ValueError is the config's (every rank meets it alike): it says best what is wrong.
            reason = None if isinstance(error, ValueError) else self._reason_of_a_failed_rank()
            if reason is None and not isinstance(error, ValueError) and self.workers:
                # e.g. the rendezvous timed out: say which ranks were still starting
                reason = (f"{type(error).__name__} with every rank still running (pids "
                          f"{', '.join(str(p.pid) for p in self.workers)}; a slow start or a hung rank)")
            self.shutdown()
            if reason is not None:
                raise RuntimeError(f"tensor parallel start-up failed: {reason}") from error
            raise
        self._store = store   # the group keeps using it; it dies with this process
        logger.info("tensor parallel: %d ranks (pids %s), %d KV blocks each", size,
                    [os.getpid(), *(p.pid for p in self.workers)], self.runner.num_blocks)

    def _start_rank(self, rank: int, init: tuple) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.worker.tp_executor", str(theirs.fileno()),
                                     str(os.getpid())], pass_fds=(theirs.fileno(),), close_fds=True)
        conn = Connection(ours.detach())
        self.workers.append(proc)
        self.conns.append(conn)
        conn.send(init)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"tensor parallel rank {rank} was not ready after {START_TIMEOUT_S:.0f} s")
            kind, detail = conn.recv()
            if kind != "ready":
                raise RuntimeError(f"tensor parallel rank {rank} failed to start: {detail}")

    def _reason_of_a_failed_rank(self) -> str | None:
        """What a rank reported before it exited, or how it exited."""
        for rank, (proc, conn) in enumerate(zip(self.workers, self.conns), start=1):
            try:
                while conn.poll(0):
                    kind, detail = conn.recv()
                    if kind == "failed":
                        return f"rank {rank}: {detail}"
            except (EOFError, OSError):
                pass
            if proc.poll() is not None:
                return f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"
        return None

    # -- the ModelRunner interface ------------------------------------------------------------
    @property
    def info(self):
        return self.runner.info

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def connector(self):
        """The KV connector's worker half, run here around the steps (the runners have none)."""
        return self._connector

    @connector.setter
    def connector(self, connector) -> None:
        self._connector = connector

    def warm_up(self, max_num_batched_tokens: int) -> None:
        self._send(("warm_up", max_num_batched_tokens))
        self._guarded(self.runner.warm_up, max_num_batched_tokens)

    def execute_model(self, out) -> ModelRunnerOutput:
        return self.collect(self.launch(out))

    def launch(self, out) -> StepHandle:
        return self._guarded(self._launch, out)

    def _launch(self, out) -> StepHandle:
        if self._connector is not None and out.connector_meta is not None:
            self._connector.start_load_kv(out.connector_meta)   # before the ranks enter the step
        self._send(("step", out))
        return self.runner.launch(out)

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        return self._guarded(self._collect, handle)

    def _collect(self, handle: StepHandle) -> ModelRunnerOutput:
        output = self.runner.collect(handle)
        if self._connector is None:
            return output
        return ModelRunnerOutput(output.sampled_token_ids, connector_output(self._connector, self.info.vocab_size))

    def call(self, op: str, per_rank_args: list[tuple] | None = None) -> list:
        """Run `op` on ranks 1..T-1 (RankCalls), each with its args; their results in rank order. A
        rank's own failure raises RankCallError naming it (with the others' results); a rank gone or
        silent raises RankLost."""
        self._send(None, [("call", op, args) for args in (per_rank_args or [()] * (self.size - 1))])
        results, errors = [], []
        deadline = time.monotonic() + CALL_TIMEOUT_S
        for rank, conn in enumerate(self.conns, start=1):
            try:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"rank {rank} did not answer {op} within {CALL_TIMEOUT_S:.0f} s")
                kind, value = conn.recv()
            except (EOFError, OSError, TimeoutError) as error:
                self.lost = self._reason_of_a_failed_rank() or str(error)
                raise RankLost(self.lost) from None
            if kind == "error":
                errors.append(f"rank {rank}: {value}")
            results.append(value if kind != "error" else None)
        if errors:
            raise RankCallError(f"{op} failed on tensor parallel {'; '.join(errors)}", results)
        return results

    def _send(self, message: tuple | None, per_rank: list[tuple] | None = None) -> None:
        """`message` to every rank (pickled once), or per_rank[r - 1] to rank r."""
        if self.lost is not None:
            raise RankLost(self.lost)
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL) if per_rank is None else None
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(payload if per_rank is None
                                else pickle.dumps(per_rank[rank - 1], protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:
                self.lost = self._reason_of_a_failed_rank() or f"rank {rank} closed its connection"
                raise RankLost(self.lost) from None

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except Exception as error:
            # A collective that failed (a rank gone or hung: gloo's timeout is a plain RuntimeError) leaves
            # the ranks out of step for good; a failure every rank met alike outside the collectives (the
            # same inputs) leaves them in step, and fails its requests only.
            reason = self._reason_of_a_failed_rank()
            if reason is None and (isinstance(error, dist.DistError) or _raised_in_torch_distributed(error)):
                # (clients see this reason: the exception's text, with its addresses, goes to the log only)
                logger.error("tensor parallel collective failed: %s: %s", type(error).__name__, error)
                reason = f"a collective failed ({type(error).__name__})"
            if reason is not None:
                self.lost = reason
                raise RankLost(reason) from error
            raise
        except BaseException:   # an interrupt mid-step: rank 0 left the step the others are in
            self.lost = "interrupted in the middle of a step: the ranks are out of step"
            raise

    def dead_rank(self) -> str | None:
        """Why the group cannot step any more (a rank exited), or None; cheap enough for an idle loop."""
        if self.lost is None and any(proc.poll() is not None for proc in self.workers):
            self.lost = self._reason_of_a_failed_rank()
        return self.lost

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("shutdown",)))
            except OSError:
                pass
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for proc in self.workers:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.workers, self.conns = [], []
        if self._owns_group:
            destroy_tp_group()
            self._owns_group = False


# -- ranks 1..T-1 -------------------------------------------------------------------------------

def _die_with_parent(parent_pid: int) -> None:
    """End this process within PARENT_CHECK_S of the engine process's end (however it ends): an orphan
    is adopted by another process, so its parent id changes."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="tp-parent-watch").start()


def _raised_in_torch_distributed(error: BaseException) -> bool:
    return any("torch/distributed" in frame.filename.replace("\\", "/")
               for frame in traceback.extract_tb(error.__traceback__))


def _serve_rank(conn: Connection) -> None:
    config, rank, size, store_port, cores, is_shared, num_blocks = conn.recv()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    try:
        os.sched_setaffinity(0, cores)
        set_num_threads(rank_threads(config, cores, is_shared), f"tensor parallel rank {rank}")
        device = rank_device(config, rank)
        store = dist.TCPStore("127.0.0.1", store_port, size, False,
                              timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        group = _join_group(rank, size, store, device)
        runner = ModelRunner(config.model, config.cache, None, num_blocks,
                             max_num_seqs=config.scheduler.max_num_seqs, tp=group, device=device)
    except Exception as error:
        logger.exception("start-up failed")
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready", runner.num_blocks))
    calls = RankCalls(runner)
    try:
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return   # rank 0 is gone
            kind = message[0]
            if kind == "shutdown":
                return
            if kind == "call":
                conn.send(calls.run(message[1], message[2]))
                continue
            try:
                if kind == "step":
                    runner.execute_model(message[1])
                elif kind == "warm_up":
                    runner.warm_up(message[1])
            except Exception:
                # The same inputs fail rank 0's step too, which fails its requests; a failure of this rank
                # alone shows there as a collective that fails.
                logger.exception("%s failed", kind)
    finally:
        calls.close()


class RankCalls:
    """What rank 0 may ask of rank 1..T-1 between steps: its part of the KV connector's transport."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.transport = None
        self.handlers = {"kv_init": self.kv_init, "kv_register": lambda: self.transport.register(runner.kv_cache),
                         "kv_connect": lambda *a: self.transport.connect(*a),
                         "kv_post": lambda *a: self.transport.post(*a), "kv_poll": lambda *a: self.transport.poll(*a),
                         "kv_poll_writes": lambda: self.transport.poll_writes(),
                         "kv_regroup": lambda *a: self.transport.regroup(*a),
                         "kv_release": lambda *a: self.transport.release(*a),
                         "kv_disconnect": lambda *a: self.transport.disconnect(*a),
                         "kv_deregister": lambda: self.transport.deregister(),
                         "kv_store_attach": lambda *a: self.transport.attach_store(*a),
                         "kv_store_copy": lambda *a: self.transport.copy_store(*a),
                         "kv_store_detach": lambda: self.transport.detach_store()}

    def kv_init(self, agent_name: str, enable_prog_thread: bool, rank: int, tp_size: int, num_kv_heads: int,
                progress_while_holding: bool = False, staging_bytes: int = KVTransferConfig.staging_bytes) -> None:
        from pdserve.kv_transfer.nixl_tp import RankReader
        self.transport = RankReader.create(agent_name, enable_prog_thread, rank, tp_size, num_kv_heads,
                                           progress_while_holding, staging_bytes)

    def run(self, op: str, args: tuple) -> tuple[str, object]:
        """("ok", result) or ("error", why): a failure of one call is rank 0's to handle, not this rank's end."""
        handler = self.handlers.get(op)
        if handler is None:
            return "error", f"unknown call {op!r}"
        if self.transport is None and op != "kv_init":
            return "error", f"{op}: no transport (kv_init first)"
        try:
            return "ok", handler(*args)
        except Exception as error:
            logger.warning("%s failed: %s: %s", op, type(error).__name__, error)
            return "error", f"{type(error).__name__}: {error}"

    def close(self) -> None:
        if self.transport is not None:
            try:
                self.transport.deregister()
            except Exception:
                logger.exception("deregistering the KV cache")


def main() -> None:
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    # The engine process stops the ranks; a Ctrl-C or a group-wide SIGTERM mid-step would leave them out of
    # step for good (RankLost) while the server drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    conn = Connection(fd)
    try:
        _serve_rank(conn)
    finally:
        destroy_tp_group()
        conn.close()


if __name__ == "__main__":
    main()
