"""The pull handoff's worker lifecycle (lifecycle.py, through pull_worker_common.py), the same for every
transport: a scattered READ is byte-exact and coalesced, a claim may come before P's SendSpec, leases
expire, fault injection. P and D workers in one process; NIXL over DRAM, cuda_ipc through the shared tensor."""
from __future__ import annotations

import time

import pytest
import torch

from pdserve.kv_transfer.pull import KeepAliveSpec, PullConnectorMeta, SendSpec
from pdserve.kv_transfer.pull_worker_common import coalesce

from tests.kv_transfer.helpers import (BLOCK_BYTES, KV_SHAPE, NUM_BLOCKS, assert_idle, nixl_available, poll,
                                       recv_spec, keep_alive_spec, worker_factory)

TRANSPORTS = ["cuda_ipc", pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="needs NIXL"))]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


@pytest.fixture(params=TRANSPORTS)
def make_worker(request):
    yield from worker_factory(request.param)


def test_coalesce_splits_where_either_side_breaks():
    assert coalesce([3, 4, 5, 9, 10], [10, 11, 12, 2, 4]) == [(3, 10, 3), (9, 2, 1), (10, 4, 1)]
    assert coalesce(list(range(8)), list(range(0, 16, 2))) == [(i, 2 * i, 1) for i in range(8)]
    assert coalesce([], []) == []


@pytest.mark.parametrize("device", DEVICES)
def test_read_scattered_blocks_is_byte_exact(make_worker, device):
    p_cache = torch.arange(torch.Size(KV_SHAPE).numel(), dtype=torch.float32, device=device).reshape(KV_SHAPE)
    p = make_worker("producer", p_cache)
    d_cache = torch.zeros(KV_SHAPE, device=device)
    d = make_worker("consumer", d_cache)
    local, remote = [3, 4, 5, 9, 0, 12, 13], [10, 11, 12, 2, 7, 20, 22]  # one run of 3, then scattered

    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", remote)]))
    assert p.get_stats()["num_blocks_held_for_transfer"] == len(remote)
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, local, remote)]))
    sending, recving = poll([p, d], lambda s, r: "p-req" in s and "d-req" in r)

    assert sending == ["p-req"] and recving == ["d-req"]
    assert torch.equal(d_cache[local], p_cache[remote])
    untouched = [b for b in range(NUM_BLOCKS) if b not in local]
    assert not d_cache[untouched].any()
    stats = d.get_stats()
    assert stats["kv_transfer_descriptors_total"] == len(coalesce(local, remote)) == 5
    assert stats["kv_transfer_bytes_total"] == len(local) * BLOCK_BYTES
    assert stats["kv_transfer_failures_total"] == 0 and stats["kv_transfer_seconds"]["count"] == 1
    assert stats["kv_transfer_seconds"]["counts"][-1] == 1
    assert p.get_stats()["kv_lease_expirations_total"] == 0  # freed by D's done, not by the lease
    assert d.get_block_ids_with_load_errors() == set() and d.get_load_error("d-req") is None
    assert_idle(p, d)


def test_claim_before_send_spec_arrives_waits_for_it(make_worker):
    """D may claim before P's scheduler hands its worker the SendSpec: P answers "unknown", and D
    claims again (until its claim deadline) instead of failing or reading unclaimed blocks."""
    p = make_worker("producer")
    d = make_worker("consumer")
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [1], [2])]))
    deadline = time.monotonic() + 0.1
    poll([p, d], lambda s, r: time.monotonic() > deadline)
    assert d.loader.loads["d-req"].state.value == "claiming"
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [2])]))
    sending, recving = poll([p, d], lambda s, r: "p-req" in s and "d-req" in r)
    assert sending == ["p-req"] and recving == ["d-req"] and d.get_load_error("d-req") is None
    assert p.get_stats()["kv_lease_expirations_total"] == 0
    assert_idle(p, d)


def test_lease_expires_without_reader(make_worker):
    p = make_worker("producer", lease_seconds=0.3)
    start = time.monotonic()
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
    assert p.get_finished() == (set(), set())
    sending, _ = poll([p], lambda s, r: "p-req" in s)
    assert time.monotonic() - start >= 0.3
    assert sending == ["p-req"] and p.get_stats()["kv_lease_expirations_total"] == 1
    assert_idle(p)


def test_request_queued_on_d_keeps_p_lease_alive_then_releases_it(make_worker):
    """D heartbeats for a request still queued in its scheduler (no RecvSpec yet): P's lease outlives
    the wait; when the request will not load after all, D's release frees P's blocks at once."""
    p = make_worker("producer", lease_seconds=0.4)
    d = make_worker("consumer", heartbeat_seconds=0.1)
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
    keep = keep_alive_spec("d-req", p, "p-req")
    d.start_load_kv(PullConnectorMeta(reqs_to_keep_alive=[keep]))
    start = time.monotonic()
    while time.monotonic() - start < 1.2:  # three leases long
        sending, _ = p.get_finished()
        assert not sending, "P's lease expired while D kept the request alive"
        d.get_finished()
        time.sleep(0.01)
    d.start_load_kv(PullConnectorMeta(reqs_to_release=[keep]))
    sending, _ = poll([p, d], lambda s, r: "p-req" in s, timeout=0.35)  # before a lease could run out
    assert sending == ["p-req"] and p.get_stats()["kv_lease_expirations_total"] == 0
    assert_idle(p, d)


def test_load_fails_when_p_lease_ran_out_before_the_first_heartbeat(make_worker):
    """P freed the blocks before D's first heartbeat reached it (a long hop to D): D's claim is
    answered "expired", and D fails the load (the load-failure policy then applies) without reading."""
    p = make_worker("producer", lease_seconds=0.2)
    d = make_worker("consumer", heartbeat_seconds=0.5)
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
    d.start_load_kv(PullConnectorMeta(reqs_to_keep_alive=[keep_alive_spec("d-req", p)]))
    poll([p], lambda s, r: "p-req" in s)                  # the lease runs out first
    assert p.get_stats()["kv_lease_expirations_total"] == 1
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [5, 6], [1, 2])]))
    _, recving = poll([p, d], lambda s, r: "d-req" in r)
    assert recving == ["d-req"] and d.get_block_ids_with_load_errors() == {5, 6}
    assert d.get_load_error("d-req") == (f"KV load from remote engine {p.engine_id} failed: the prefill "
                                         "instance's lease on this request's KV expired")
    assert d.get_stats()["kv_transfer_descriptors_total"] == 0  # nothing was read
    assert_idle(p, d)


def test_release_of_a_reused_request_id_frees_only_the_old_copy(make_worker):
    p = make_worker("producer", lease_seconds=30)
    d = make_worker("consumer")
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p1", [1]), SendSpec("p2", [2])]))
    old = keep_alive_spec("x", p, "p1")
    new = keep_alive_spec("x", p, "p2")
    d.start_load_kv(PullConnectorMeta(reqs_to_keep_alive=[old]))
    d.start_load_kv(PullConnectorMeta(reqs_to_keep_alive=[new], reqs_to_release=[old]))  # one step
    sending, _ = poll([p, d], lambda s, r: "p1" in s)
    time.sleep(0.1)
    sending += list(p.get_finished()[0])
    assert sending == ["p1"]  # p2, which the new "x" will read, is still held
    d.start_load_kv(PullConnectorMeta(reqs_to_release=[new]))
    poll([p, d], lambda s, r: "p2" in s)
    assert_idle(p, d)


@pytest.mark.parametrize("mode, invalid", [("all", {1, 2, 7}), ("last_block", {7})])
def test_inject_read_failure(make_worker, mode, invalid):
    p_cache = torch.rand(KV_SHAPE)
    p = make_worker("producer", p_cache)
    d_cache = torch.zeros(KV_SHAPE)
    d = make_worker("consumer", d_cache, extra={"inject_read_failure": mode})
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [4, 5, 9])]))
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [1, 2, 7], [4, 5, 9])]))
    sending, recving = poll([p, d], lambda s, r: "d-req" in r and "p-req" in s)
    assert recving == ["d-req"] and sending == ["p-req"]
    assert d.get_block_ids_with_load_errors() == invalid
    assert d.get_block_ids_with_load_errors() == set()  # returned and cleared
    assert f"{len(invalid)} of 3 blocks invalid" in d.get_load_error("d-req")
    assert d.get_stats()["kv_transfer_failures_total"] == 1
    assert torch.equal(d_cache[[1, 2, 7]], p_cache[[4, 5, 9]])  # the copy itself was done
    assert_idle(p, d)
