"""The connector contract, run against every registered connector: both halves built by the factory,
driven the way the scheduler and the model runner drive them, ending in a leak check."""
from __future__ import annotations

import time
import uuid

import pytest
import torch

from pdserve.config import KVTransferConfig
from pdserve.core.request import Request
from pdserve.kv_transfer.factory import CONNECTORS, PUSH_CONNECTORS, create_connector
from pdserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 16
COMPAT = {"model": "contract-test", "dtype": "float32", "block_size": BLOCK_SIZE}


def connectors_here() -> list[str]:
    """The pull connectors (the push ones have their own contract test below, the store its own in
    tests/kv_store/test_store_handoff.py: it needs a running store)."""
    return [name for name in CONNECTORS if name not in PUSH_CONNECTORS and name != "store"]


def make_pair(name: str, **cfg):
    # cuda_ipc moves VRAM when there is a GPU, and shared memory otherwise: both are its real paths.
    device = "cuda" if name == "cuda_ipc" and torch.cuda.is_available() else "cpu"
    halves = []
    for role in ("producer", "consumer"):
        config = KVTransferConfig(kv_connector=name, kv_role=role, engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
                                  **cfg)
        sched, worker = create_connector(config, BLOCK_SIZE, COMPAT)
        kv = torch.zeros(NUM_BLOCKS, 2, 2, BLOCK_SIZE, 1, 8, device=device)  # [blocks, layers, kv, slots, heads, dim]
        worker.register_kv_caches(kv)
        halves.append((sched, worker, kv))
    return halves


def poll(workers, until, timeout=10.0):
    """Step every worker (as idle engines do) until `until(finished)` holds."""
    seen = {id(w): (set(), set()) for w in workers}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w in workers:
            sending, recving = w.get_finished()
            seen[id(w)][0].update(sending)
            seen[id(w)][1].update(recving)
        if until(seen):
            return seen
        time.sleep(0.005)
    raise AssertionError(f"timed out; seen {seen}")


@pytest.mark.parametrize("name", connectors_here())
def test_pull_handoff_through_the_contract(name):
    (p_sched, p_worker, p_kv), (d_sched, d_worker, d_kv) = make_pair(name)
    try:
        prompt = list(range(13))  # 4 blocks, the last one partial
        # P: the request finishes; request_finished holds the blocks and returns params for D.
        p_req = Request("p-req", prompt, SamplingParams(max_tokens=1),
                        kv_transfer_params={"do_remote_decode": True})
        p_req.status = p_req.status.FINISHED_LENGTH_CAPPED
        p_blocks = [3, 4, 9, 10]
        for b in p_blocks:
            p_kv[b].fill_(float(b))
        delay_free, params = p_sched.request_finished(p_req, p_blocks)
        assert delay_free and params["do_remote_prefill"] and params["remote_block_ids"] == p_blocks
        p_worker.start_load_kv(p_sched.build_connector_meta(None))

        # D: the scheduler learns how much can be loaded, allocates, and hands the load over.
        d_req = Request("d-req", prompt, SamplingParams(max_tokens=4), kv_transfer_params=params)
        num_external, load_async = d_sched.get_num_new_matched_tokens(d_req, 0)
        assert (num_external, load_async) == (13, True)
        d_blocks = [0, 1, 2, 7]
        d_sched.update_state_after_alloc(d_req, d_blocks, num_external)
        d_worker.start_load_kv(d_sched.build_connector_meta(None))

        seen = poll([p_worker, d_worker], lambda s: "d-req" in s[id(d_worker)][1]
                    and "p-req" in s[id(p_worker)][0])
        assert d_worker.get_block_ids_with_load_errors() == set()
        for local, remote in zip(d_blocks, p_blocks):
            assert torch.equal(d_kv[local], p_kv[remote])
        # one descriptor per coalesced run (loopback copies block by block)
        # d 0,1 ← p 3,4 | d 2 ← p 9 | d 7 ← p 10: three runs
        runs = len(d_blocks) if name == "loopback" else 3
        assert d_worker.get_stats()["kv_transfer_descriptors_total"] == runs
        assert seen[id(p_worker)][1] == set() and seen[id(d_worker)][0] == set()
        assert p_worker.num_pending_requests() == 0 and d_worker.num_pending_requests() == 0
    finally:
        p_worker.shutdown()
        d_worker.shutdown()


@pytest.mark.parametrize("name", connectors_here())
def test_lease_expiry_through_the_contract(name):
    (p_sched, p_worker, _), (_, d_worker, _) = make_pair(name, lease_seconds=0.3)
    try:
        req = Request("held", list(range(8)), SamplingParams(max_tokens=1),
                      kv_transfer_params={"do_remote_decode": True})
        req.status = req.status.FINISHED_STOPPED
        assert p_sched.request_finished(req, [5, 6])[0]
        p_worker.start_load_kv(p_sched.build_connector_meta(None))
        poll([p_worker], lambda s: "held" in s[id(p_worker)][0])
        assert p_worker.get_stats()["kv_lease_expirations_total"] == 1
        assert p_worker.num_pending_requests() == 0
    finally:
        p_worker.shutdown()
        d_worker.shutdown()


@pytest.mark.parametrize("name", connectors_here())
def test_injected_failure_reports_blocks_through_the_contract(name):
    (p_sched, p_worker, _), (d_sched, d_worker, _) = make_pair(name, extra={"inject_read_failure": "last_block"})
    try:
        req = Request("p", list(range(8)), SamplingParams(max_tokens=1), kv_transfer_params={"do_remote_decode": True})
        req.status = req.status.FINISHED_STOPPED
        _, params = p_sched.request_finished(req, [1, 2])
        p_worker.start_load_kv(p_sched.build_connector_meta(None))
        d_req = Request("d", list(range(8)), SamplingParams(max_tokens=1), kv_transfer_params=params)
        n, _ = d_sched.get_num_new_matched_tokens(d_req, 0)
        d_sched.update_state_after_alloc(d_req, [11, 12], n)
        d_worker.start_load_kv(d_sched.build_connector_meta(None))
        poll([p_worker, d_worker], lambda s: "d" in s[id(d_worker)][1] and "p" in s[id(p_worker)][0])
        assert d_worker.get_block_ids_with_load_errors() == {12}
    finally:
        p_worker.shutdown()
        d_worker.shutdown()


@pytest.mark.parametrize("name", PUSH_CONNECTORS)
def test_push_handoff_through_the_contract(name):
    """P and D get the request at once with one transfer id; D's cache already holds the first block, so
    D asks P for the three others only, and P writes them without either waiting for the other's answer."""
    (p_sched, p_worker, p_kv), (d_sched, d_worker, d_kv) = make_pair(name)
    try:
        prompt = list(range(13))  # 4 blocks, the last one partial
        p_req = Request("p-req", prompt, SamplingParams(max_tokens=1),
                        kv_transfer_params={"do_remote_decode": True, "transfer_id": "t-1"})
        d_params = {"do_remote_prefill": True, "transfer_id": "t-1", "remote_engine_id": p_sched.engine_id,
                    "remote_request_id": "t-1", "remote_host": "127.0.0.1",
                    "remote_port": p_worker.side_channel_port, "remote_boot_id": p_worker.boot_id}
        d_req = Request("d-req", prompt, SamplingParams(max_tokens=4), kv_transfer_params=d_params)
        d_sched.request_added(d_req)
        assert d_sched.get_num_new_matched_tokens(d_req, 4) == (9, True)
        d_blocks = [0, 5, 6, 7]
        d_req.num_computed_tokens = 4  # (the scheduler sets its local hit before it calls this)
        d_sched.update_state_after_alloc(d_req, d_blocks, 9)
        d_worker.start_load_kv(d_sched.build_connector_meta(None))  # the announce goes out
        p_blocks = [3, 4, 9, 10]
        for b in p_blocks:
            p_kv[b].fill_(float(b))
        p_sched.request_added(p_req)
        p_req.status = p_req.status.FINISHED_LENGTH_CAPPED
        delay_free, params = p_sched.request_finished(p_req, p_blocks)
        assert delay_free and params["transfer_id"] == "t-1"
        p_worker.start_load_kv(p_sched.build_connector_meta(None))
        poll([p_worker, d_worker], lambda s: "d-req" in s[id(d_worker)][1] and "p-req" in s[id(p_worker)][0])
        assert d_worker.get_block_ids_with_load_errors() == set()
        assert torch.count_nonzero(d_kv[0]) == 0  # D's own cached block is not written
        for local, remote in zip(d_blocks[1:], p_blocks[1:]):
            assert torch.equal(d_kv[local], p_kv[remote])
        assert p_worker.get_stats()["kv_transfer_descriptors_total"] == 2  # d 5 ← p 4 | d 6,7 ← p 9,10
        assert p_worker.num_pending_requests() == 0 and d_worker.num_pending_requests() == 0
    finally:
        p_worker.shutdown()
        d_worker.shutdown()


@pytest.mark.parametrize("name", PUSH_CONNECTORS)
def test_push_params_without_a_transfer_id_are_refused_at_admission(name):
    (p_sched, p_worker, _), (d_sched, d_worker, _) = make_pair(name)
    try:
        from pdserve.kv_transfer.base import KVTransferParams
        for sched, data in ((p_sched, {"do_remote_decode": True}),
                            (d_sched, {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "x",
                                       "remote_host": "127.0.0.1", "remote_port": 1})):
            with pytest.raises(ValueError, match="transfer_id"):
                sched.check_params(KVTransferParams.from_dict(data))
    finally:
        p_worker.shutdown()
        d_worker.shutdown()
