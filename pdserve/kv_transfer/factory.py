"""Connector name → implementation: the only module that imports transports."""
from __future__ import annotations

import uuid
from typing import Any

from pdserve.config import PUSH_KV_CONNECTORS, TP_KV_CONNECTORS, KVTransferConfig, parse_host_port
from pdserve.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from pdserve.kv_transfer.pull import PullConnectorScheduler
from pdserve.kv_transfer.push import PushConnectorScheduler

CONNECTORS = ("loopback", "nixl", "cuda_ipc", "nixl-push", "store")
PUSH_CONNECTORS = PUSH_KV_CONNECTORS
TP_CONNECTORS = TP_KV_CONNECTORS


def create_connector(config: KVTransferConfig, block_size: int, compat: dict[str, Any], hash_extra: str = "",
                     ranks: Any = None, num_kv_heads: int | None = None
                     ) -> tuple[KVConnectorScheduler | None, KVConnectorWorker | None]:
    """Both halves of the configured connector, or (None, None) when disaggregation is off. hash_extra: the
    prefix cache's (the store names blocks by the cache's hash). ranks: a tensor-parallel instance's other
    ranks (worker/tp_executor.py), for the connectors that move every rank's KV (TP_CONNECTORS); num_kv_heads:
    the model's, for nixl readers of a P of another size and for a store rank's share of each slot."""
    if config.kv_connector is None:
        return None, None
    engine_id = config.engine_id or f"{config.kv_role}-{uuid.uuid4().hex[:8]}"
    if ranks is not None and config.kv_connector not in TP_CONNECTORS:
        raise ValueError(f"kv_connector: {config.kv_connector!r} does not serve tensor-parallel instances yet "
                         f"(one of {TP_CONNECTORS} does)")
    if config.kv_connector == "nixl" and (ranks is not None or config.is_consumer) and num_kv_heads:
        # every rank's KV, or a reader that may meet a P of another tensor-parallel size
        from pdserve.kv_transfer.nixl_tp import TPNixlConnectorWorker
        worker: KVConnectorWorker = TPNixlConnectorWorker(config, engine_id, compat, ranks, num_kv_heads)
        host, port = config.side_channel_host, worker.side_channel_port
    elif config.kv_connector == "loopback":
        from pdserve.kv_transfer.loopback import LoopbackConnectorWorker
        worker = LoopbackConnectorWorker(config, engine_id)
        host, port = "loopback", 0
    elif config.kv_connector == "nixl":
        from pdserve.kv_transfer.nixl import NixlConnectorWorker
        worker = NixlConnectorWorker(config, engine_id, compat)
        host, port = config.side_channel_host, worker.side_channel_port
    elif config.kv_connector == "cuda_ipc":
        from pdserve.kv_transfer.cuda_ipc import CudaIpcConnectorWorker
        worker = CudaIpcConnectorWorker(config, engine_id, compat)
        host, port = config.side_channel_host, worker.side_channel_port
    elif config.kv_connector == "nixl-push":   # (one rank too: its peer may be tensor-parallel)
        from pdserve.kv_transfer.nixl_tp_push import TPNixlPushConnectorWorker
        push_worker: KVConnectorWorker = TPNixlPushConnectorWorker(config, engine_id, compat, ranks,
                                                                   num_kv_heads or 0)
        return PushConnectorScheduler(engine_id, block_size, is_producer=config.is_producer,
                                      is_consumer=config.is_consumer), push_worker
    elif config.kv_connector == "store":
        from pdserve.kv_transfer.store import DEFAULT_WAIT_S, StoreConnectorScheduler
        from pdserve.kv_transfer.store_client import StoreClient
        from pdserve.kv_transfer.store_worker import StoreConnectorWorker
        client = StoreClient(parse_host_port(config.kv_store or "", "kv_store"), config.auth_key)
        if ranks is not None:
            from pdserve.kv_transfer.store_tp import TPStoreConnectorWorker
            store_worker: KVConnectorWorker = TPStoreConnectorWorker(config, engine_id, compat, client, ranks,
                                                                     num_kv_heads or 0)
        else:
            store_worker = StoreConnectorWorker(config, engine_id, compat, client)
        wait_s = float(config.extra.get("store_wait_seconds", DEFAULT_WAIT_S))
        return StoreConnectorScheduler(engine_id, block_size, client, config.is_producer, hash_extra,
                                       wait_s), store_worker
    else:
        raise ValueError(f"kv_connector: expected one of {CONNECTORS}, got {config.kv_connector!r}")
    scheduler = PullConnectorScheduler(engine_id, host, port, block_size, is_producer=config.is_producer,
                                       is_consumer=config.is_consumer, boot_id=getattr(worker, "boot_id", None))
    return scheduler, worker
