"""NixlConnectorWorker over real NIXL (UCX, CPU DRAM): a P and a D worker in one process.

Without the progress thread a READ completes only while both agents are progressed, so every
wait polls both workers, as two engines stepping would.
"""
from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest
import torch

pytest.importorskip("numpy")
try:
    import nixl._api  # noqa: F401
except ImportError:
    pytest.importorskip("nixl_cu13._api")

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.nixl import NixlConnectorWorker
from pdserve.kv_transfer.pull_worker_common import coalesce
from pdserve.kv_transfer.pull import PullConnectorMeta, RecvSpec, SendSpec

NUM_BLOCKS = 32
KV_SHAPE = (NUM_BLOCKS, 2, 2, 4, 2, 8)  # [blocks, layers, k/v, slots, heads, dim]: 1 KiB blocks
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4
COMPAT = {"model": "toy", "dtype": "float32", "block_size": 4, "kv_layout": "blocks,layers,kv,slots,heads,dim"}


@pytest.fixture
def make_worker():
    workers = []

    def make(role: str, kv_cache: torch.Tensor | None = None, compat: dict | None = None,
             **config) -> NixlConnectorWorker:
        cfg = KVTransferConfig(kv_connector="nixl", kv_role=role, **config)
        worker = NixlConnectorWorker(cfg, f"{role}-{uuid.uuid4().hex[:8]}", compat or COMPAT)
        worker.register_kv_caches(kv_cache if kv_cache is not None else torch.zeros(KV_SHAPE))
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.shutdown()


def recv_spec(request_id, p, local_block_ids, remote_block_ids, p_request_id="p-req"):
    return RecvSpec(request_id, local_block_ids, remote_block_ids, p.engine_id, p_request_id,
                    "127.0.0.1", p.side_channel_port)


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
    for worker in workers:
        assert worker.num_pending_requests() == 0
        assert worker.get_stats()["num_blocks_held_for_transfer"] == 0


def test_coalesce_splits_where_either_side_breaks():
    assert coalesce([3, 4, 5, 9, 10], [10, 11, 12, 2, 4]) == [(3, 10, 3), (9, 2, 1), (10, 4, 1)]
    assert coalesce([], []) == []


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="VRAM path needs a GPU"))])
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
    assert stats["kv_transfer_failures_total"] == 0
    assert stats["kv_transfer_seconds"]["count"] == 1
    assert stats["kv_transfer_seconds"]["counts"][-1] == 1
    assert d.get_block_ids_with_load_errors() == set() and d.get_load_error("d-req") is None
    assert_idle(p, d)


def test_read_finished_before_send_spec_arrives(make_worker):
    """D may READ (and notify) before P's scheduler hands its worker the SendSpec."""
    p = make_worker("producer")
    d = make_worker("consumer")
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [1], [2])]))
    poll([p, d], lambda s, r: "d-req" in r)
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [2])]))
    sending, _ = poll([p], lambda s, r: "p-req" in s)
    assert sending == ["p-req"]
    assert p.get_stats()["kv_lease_expirations_total"] == 0
    assert_idle(p, d)


def test_lease_expires_without_reader(make_worker):
    p = make_worker("producer", lease_seconds=0.3)
    start = time.monotonic()
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
    assert p.get_finished() == (set(), set())
    sending, _ = poll([p], lambda s, r: "p-req" in s)
    assert time.monotonic() - start >= 0.3
    assert sending == ["p-req"]
    assert p.get_stats()["kv_lease_expirations_total"] == 1
    assert_idle(p)


def test_heartbeats_extend_lease(make_worker):
    p = make_worker("producer", lease_seconds=0.3)
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
    for _ in range(8):  # 0.8 s > lease, heartbeats every 0.1 s
        reply, _ = side_channel.request("127.0.0.1", p.side_channel_port, {
            "type": "heartbeat", "engine_id": "d", "remote_request_ids": ["p-req", "unknown"]})
        assert reply == {"ok": True, "num_extended": 1}
        assert p.get_finished() == (set(), set())
        time.sleep(0.1)
    sending, _ = poll([p], lambda s, r: "p-req" in s)
    assert p.get_stats()["kv_lease_expirations_total"] == 1
    assert_idle(p)


class FakeProducer:
    """A P side channel whose handshake waits on an event; records heartbeats and releases."""

    def __init__(self) -> None:
        self.engine_id = "fake-p"
        self.handshake_may_answer = threading.Event()
        self.heartbeats: list[list[str]] = []
        self.releases: list[str] = []
        self.server = side_channel.SideChannelServer("127.0.0.1", 0, {
            "handshake": self.handshake, "heartbeat": self.heartbeat, "release": self.release})
        self.side_channel_port = self.server.port

    def handshake(self, message, blob):
        self.handshake_may_answer.wait(timeout=5)
        return {"ok": False, "engine_id": self.engine_id, "compat": COMPAT, "error": "going away"}, b""

    def heartbeat(self, message, blob):
        self.heartbeats.append(message["remote_request_ids"])
        return {"ok": True, "num_extended": 0}, b""

    def release(self, message, blob):
        self.releases.extend(message["remote_request_ids"])
        return {"ok": True}, b""


def test_cancel_before_handshake_completes(make_worker):
    fake_p = FakeProducer()
    d = make_worker("consumer", heartbeat_seconds=0.05)
    try:
        d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", fake_p, [1, 2], [5, 6])]))
        poll([d], lambda s, r: fake_p.heartbeats)  # heartbeats cover requests awaiting a handshake
        assert fake_p.heartbeats[0] == ["p-req"]
        d.start_load_kv(PullConnectorMeta(reqs_to_cancel={"d-req"}))
        _, recving = poll([d], lambda s, r: "d-req" in r and fake_p.releases)
        fake_p.handshake_may_answer.set()
        _, later = poll([d], lambda s, r: not d._handshakes)  # the late handshake fails nothing
        assert recving + later == ["d-req"]
        assert fake_p.releases == ["p-req"]
        assert d.get_block_ids_with_load_errors() == set()
        assert d.get_stats()["kv_transfer_failures_total"] == 0
        assert_idle(d)
    finally:
        fake_p.handshake_may_answer.set()
        fake_p.server.close()


def test_cancel_in_flight_reports_once_after_read(make_worker):
    p = make_worker("producer")
    d = make_worker("consumer")
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("warm", p, [0], [0], "p-warm")]))
    poll([p, d], lambda s, r: "warm" in r)  # handshake done: the next READ posts at once
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [1, 2], [3, 4])]))
    d.start_load_kv(PullConnectorMeta(reqs_to_cancel={"d-req"}))
    _, recving = poll([p, d], lambda s, r: "d-req" in r)
    _, later = poll([p, d], lambda s, r: True)
    assert recving + later == ["d-req"]
    assert d.get_stats()["kv_transfer_bytes_total"] == 3 * BLOCK_BYTES  # it did finish its READ
    assert_idle(p, d)


def test_compat_mismatch_fails_request_naming_both_values(make_worker):
    p = make_worker("producer")
    d = make_worker("consumer", compat={**COMPAT, "block_size": 8})
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [5, 6])]))
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [1, 2], [5, 6])]))
    sending, recving = poll([p, d], lambda s, r: "d-req" in r and "p-req" in s)  # D releases P's blocks

    assert recving == ["d-req"] and sending == ["p-req"]
    assert d.get_block_ids_with_load_errors() == {1, 2}
    assert d.get_load_error("d-req") == (
        f"KV layout mismatch with remote engine {p.engine_id}: block_size local=8 remote=4")
    assert d.get_stats()["kv_transfer_failures_total"] == 1
    assert p.get_stats()["kv_lease_expirations_total"] == 0
    assert_idle(p, d)


def test_unreachable_remote_fails_request(make_worker):
    d = make_worker("consumer")
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = RecvSpec("d-req", [1, 2], [3, 4], "gone-p", "p-req", "127.0.0.1", port)
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[spec]))
    _, recving = poll([d], lambda s, r: "d-req" in r)
    assert recving == ["d-req"]
    assert d.get_block_ids_with_load_errors() == {1, 2}
    assert d.get_load_error("d-req").startswith(f"handshake with remote engine gone-p at 127.0.0.1:{port} failed")
    assert d.get_load_error("d-req") is None  # returned and forgotten
    assert_idle(d)


@pytest.mark.parametrize("mode, invalid", [("all", {1, 2, 7}), ("last_block", {7})])
def test_inject_read_failure(make_worker, mode, invalid):
    p_cache = torch.rand(KV_SHAPE)
    p = make_worker("producer", p_cache)
    d_cache = torch.zeros(KV_SHAPE)
    d = make_worker("consumer", d_cache, extra={"inject_read_failure": mode})
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [4, 5, 9])]))
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [1, 2, 7], [4, 5, 9])]))
    sending, recving = poll([p, d], lambda s, r: "d-req" in r and "p-req" in s)

    assert recving == ["d-req"]
    assert d.get_block_ids_with_load_errors() == invalid
    assert d.get_block_ids_with_load_errors() == set()  # returned and cleared
    assert f"{len(invalid)} of 3 blocks invalid" in d.get_load_error("d-req")
    assert d.get_stats()["kv_transfer_failures_total"] == 1
    assert torch.equal(d_cache[[1, 2, 7]], p_cache[[4, 5, 9]])  # the READ itself was done
    assert_idle(p, d)
