"""What the pull transports' tests share: a toy KV cache, a worker factory, and polling helpers."""
from __future__ import annotations

import time
import uuid

import torch

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.pull import KeepAliveSpec, RecvSpec

NUM_BLOCKS = 32
KV_SHAPE = (NUM_BLOCKS, 2, 2, 4, 2, 8)  # [blocks, layers, k/v, slots, heads, dim]: 1 KiB blocks (fp32)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4
COMPAT = {"model": "toy", "dtype": "float32", "block_size": 4, "kv_layout": "blocks,layers,kv,slots,heads,dim"}


def nixl_available() -> bool:
    for module in ("nixl._api", "nixl_cu13._api"):
        try:
            __import__(module)
            return True
        except ImportError:
            pass
    return False


def worker_factory(connector: str):
    """For a fixture: `yield from worker_factory("nixl")` gives make(role, kv_cache=None, compat=None,
    **config) and shuts every worker it made down afterwards."""
    if connector == "nixl":
        from pdserve.kv_transfer.nixl import NixlConnectorWorker as worker_cls
    elif connector == "nixl-push":   # what the engine builds for one rank (ranks None)
        from functools import partial

        from pdserve.kv_transfer.nixl_tp_push import TPNixlPushConnectorWorker
        worker_cls = partial(TPNixlPushConnectorWorker, ranks=None, num_kv_heads=KV_SHAPE[4])
    else:
        from pdserve.kv_transfer.cuda_ipc import CudaIpcConnectorWorker as worker_cls
    workers = []

    def make(role: str, kv_cache: torch.Tensor | None = None, compat: dict | None = None, **config):
        cfg = KVTransferConfig(kv_connector=connector, kv_role=role, **config)
        worker = worker_cls(cfg, f"{role}-{uuid.uuid4().hex[:8]}", compat or COMPAT)
        worker.register_kv_caches(kv_cache if kv_cache is not None else torch.zeros(KV_SHAPE))
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.shutdown()


def _boot(p) -> list:
    boot_id = getattr(p, "boot_id", None)  # P's per-boot nonce (none on a fake P)
    return [] if boot_id is None else [boot_id]


def recv_spec(request_id, p, local_block_ids, remote_block_ids, p_request_id="p-req", port=None):
    return RecvSpec(request_id, local_block_ids, remote_block_ids, p.engine_id, p_request_id,
                    "127.0.0.1", port or p.side_channel_port, *_boot(p))


def keep_alive_spec(request_id, p, p_request_id="p-req", port=None):
    return KeepAliveSpec(request_id, p.engine_id, p_request_id, "127.0.0.1", port or p.side_channel_port,
                         *_boot(p))


def poll(workers, until, timeout=5.0):
    """Step every worker until `until(sending, recving)` holds; returns everything reported."""
    sending, recving = [], []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for worker in workers:
            s, r = worker.get_finished()
            sending.extend(s)
            recving.extend(r)
        if until(sending, recving):
            return sending, recving
        time.sleep(0.001)
    raise AssertionError(f"timed out: sending={sending} recving={recving}")


def assert_idle(*workers):
    """The leak check: no request tracked, no block held, no load record left on either side."""
    for worker in workers:
        assert worker.num_pending_requests() == 0
        assert worker.get_stats()["num_blocks_held_for_transfer"] == 0
        assert_no_request_state(worker)


# Containers that may stay non-empty on an idle worker: configuration, connections to peers (dropped
# when idle), and ended grants, tombstones and abandoned ids (remembered for one lease period, bounded).
_NOT_REQUEST_STATE = {"compat", "_handshake_fields", "peers", "clients", "_remotes", "_handshakes", "_ended",
                      "_expired", "_streams", "extra", "stats", "_tombstones", "_abandoned"}


def request_state(worker) -> dict[str, int]:
    """Every non-empty per-request container of a worker half (and of its lifecycle objects)."""
    found = {}
    for owner in (worker, *(getattr(worker, name, None) for name in ("loader", "holder", "pusher", "receiver"))):
        for name, value in (vars(owner) if owner is not None else {}).items():
            if isinstance(value, (dict, set, list)) and value and name not in _NOT_REQUEST_STATE:
                found[name] = len(value)
    return found


def assert_no_request_state(worker) -> None:
    state = request_state(worker)
    assert state == {}, state
