"""The store handoff with KV in VRAM: P's WRITE into the pool and D's READ from it, through the pool mapped
and pinned in each client (copies on a CUDA stream), over NIXL (UCX's VRAM <-> host path), and with the
pool itself in VRAM (--pool-device cuda: CUDA IPC through NIXL)."""
from __future__ import annotations

import uuid

import pytest
import torch

from pdserve.config import KVTransferConfig
from pdserve.core.request import Request
from pdserve.kv_transfer.factory import create_connector
from pdserve.sampling_params import SamplingParams
from tests.kv_store.test_store_handoff import (BLOCK_SIZE, COMPAT, assert_idle, lookup, store_prompt, step_until,
                                               wait_for)
from tests.kv_transfer.helpers import nixl_available

pytestmark = pytest.mark.gpu

NUM_BLOCKS = 64
KV_SHAPE = (NUM_BLOCKS, 2, 2, BLOCK_SIZE, 2, 64)   # bfloat16: 4 KiB blocks


@pytest.mark.skipif(not nixl_available(), reason="needs NIXL")
@pytest.mark.parametrize("pool", ["shared-memory", "nixl", "vram"])
def test_kv_in_vram_goes_through_the_store_exactly(pool):
    from pdserve.kv_store.server import KVStoreServer
    block_bytes = 2 * 2 * BLOCK_SIZE * 2 * 64 * 2
    shared_memory = pool == "shared-memory"
    server = KVStoreServer("127.0.0.1", 0, 256 * block_bytes, shared_memory=shared_memory,
                           pool_device="cuda" if pool == "vram" else "cpu")
    workers = []
    try:
        def instance():
            config = KVTransferConfig(kv_connector="store", kv_role="both", engine_id=f"gpu-{uuid.uuid4().hex[:6]}",
                                      kv_store=f"127.0.0.1:{server.port}")
            sched, worker = create_connector(config, BLOCK_SIZE, {**COMPAT, "dtype": "bfloat16"}, hash_extra="gpu")
            kv = torch.zeros(KV_SHAPE, dtype=torch.bfloat16, device="cuda")
            worker.register_kv_caches(kv)
            workers.append(worker)
            wait_for(lambda: (worker.get_finished(), sched.client.is_ready)[1], "the handshake")
            return sched, worker, kv

        a_sched, a_worker, a_kv = instance()
        b_sched, b_worker, b_kv = instance()
        prompt = list(range(40 * BLOCK_SIZE))
        a_blocks = list(range(3, 43))
        a_kv.copy_(torch.randn(KV_SHAPE, device="cuda").to(torch.bfloat16))
        store_prompt(server, a_sched, a_worker, a_kv.clone(), "a", prompt, a_blocks)   # (insert fills blocks)
        request = Request("r", prompt + [7], SamplingParams(max_tokens=2))
        assert lookup(b_sched, b_worker, request) == (len(prompt), True)
        b_blocks = list(range(20, 61))
        b_sched.update_state_after_alloc(request, b_blocks, len(prompt))
        if shared_memory:   # the copy waits for the engine's stream's work
            torch.cuda._sleep(2_000_000_000)   # ~1 s of GPU time on the engine's stream
        b_worker.start_load_kv(b_sched.build_connector_meta(None))
        if shared_memory:
            assert "r" not in b_worker.get_finished()[1]
        step_until([b_worker], lambda s, r: "r" in r)
        assert b_worker.get_block_ids_with_load_errors() == set()
        assert torch.equal(b_kv[20:60], a_kv[3:43])   # (no synchronize: DONE means the copy has ended)
        assert b_worker.get_stats()["kv_store_shared_memory"] == int(shared_memory)
        assert_idle(server, a_worker, b_worker)
    finally:
        for worker in workers:
            worker.shutdown()
        server.close()
