"""Issue 13, bugs 1-9: one test each, over the real transports (NIXL over DRAM, cuda_ipc through shared
memory), P and D workers in one process, each ending in a leak check. Every one of them failed (or
hung until its poll's timeout) before lifecycle.py."""
from __future__ import annotations

import logging
import socket
import threading
import time
import uuid

import pytest
import torch

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.pull import PullConnectorMeta, RecvSpec, SendSpec

from tests.kv_transfer.helpers import (COMPAT, KV_SHAPE, assert_idle, keep_alive_spec, nixl_available, poll,
                                       recv_spec, request_state, worker_factory)

NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="needs NIXL"))
TRANSPORTS = ["cuda_ipc", NIXL]


@pytest.fixture(params=TRANSPORTS)
def make_worker(request):
    yield from worker_factory(request.param)


@pytest.fixture
def make_nixl_worker():
    if not nixl_available():
        pytest.skip("needs NIXL")
    yield from worker_factory("nixl")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Recorder:
    """A P side channel that records what D sends; heartbeats may be held back and answered as told."""

    def __init__(self, heartbeat_reply=None):
        self.engine_id, self.messages = "recorder-p", []
        self.may_answer = threading.Event()
        self.may_answer.set()
        self.heartbeat_reply = heartbeat_reply or {"ok": True, "num_extended": 0}

        def heartbeat(message, blob):
            self.messages.append(message)
            self.may_answer.wait(5)
            return self.heartbeat_reply, b""
        self.server = side_channel.SideChannelServer("127.0.0.1", 0, {
            "heartbeat": heartbeat, "release": lambda m, b: (self.messages.append(m) or {"ok": True}, b"")})
        self.side_channel_port = self.server.port

    def types(self):
        return [m["type"] for m in self.messages]

    def close(self):
        self.may_answer.set()
        self.server.close()


def test_bug1_params_after_the_lease_ran_out_fail_cleanly_and_free_everything(make_worker):
    """The lease ran out before D got the params, and P went idle (it steps no more): D answers
    within a bound with the lease's fate, reads nothing, and holds nothing afterwards."""
    p = make_worker("producer", lease_seconds=0.3)
    d = make_worker("consumer")
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
    poll([p], lambda s, r: "p-req" in s)                      # expired; P now idle
    start = time.monotonic()
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [5, 6], [1, 2])]))
    _, recving = poll([d], lambda s, r: "d-req" in r, timeout=3)  # only D steps
    assert time.monotonic() - start < 2
    assert "lease on this request's KV expired" in (d.get_load_error("d-req") or "")
    assert d.get_block_ids_with_load_errors() == {5, 6}
    assert d.get_stats()["kv_transfer_bytes_total"] == 0
    assert_idle(p, d)


def test_bug1_a_read_that_never_completes_has_a_deadline(make_nixl_worker):
    p = make_nixl_worker("producer")
    d = make_nixl_worker("consumer", extra={"read_timeout_seconds": 0.3})
    transfer = d.agent.transfer
    d.agent.transfer = lambda handle: (transfer(handle), "PROC")[1]  # as if the READ never progressed
    d.agent.check_xfer_state = lambda handle: "PROC"
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [5, 6], [1, 2])]))
    sending, recving = poll([p, d], lambda s, r: "d-req" in r and "p-req" in s, timeout=3)
    assert "did not finish within 0.3s" in d.get_load_error("d-req")
    assert d.get_block_ids_with_load_errors() == {5, 6}
    assert_idle(p, d)


def test_bug2_transfer_status_raising_fails_that_request_not_the_engine(make_nixl_worker):
    p = make_nixl_worker("producer")
    d = make_nixl_worker("consumer")
    transfer = d.agent.transfer
    d.agent.transfer = lambda handle: (transfer(handle), "PROC")[1]

    def dead_peer(handle):
        raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")  # what the binding does when P died mid-READ
    d.agent.check_xfer_state = dead_peer
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [5, 6], [1, 2])]))
    poll([p, d], lambda s, r: "d-req" in r and "p-req" in s)  # never raises out of get_finished
    assert "transfer error" in d.get_load_error("d-req")
    assert d.get_block_ids_with_load_errors() == {5, 6}
    assert_idle(p, d)


def make_named(connector, role, engine_id, cache=None, **config):
    """A worker with a chosen engine id (worker_factory's are random); the caller shuts it down."""
    if connector == "nixl":
        from pdserve.kv_transfer.nixl import NixlConnectorWorker as worker_cls
    else:
        from pdserve.kv_transfer.cuda_ipc import CudaIpcConnectorWorker as worker_cls
    worker = worker_cls(KVTransferConfig(kv_connector=connector, kv_role=role, **config), engine_id, COMPAT)
    worker.register_kv_caches(cache if cache is not None else torch.zeros(KV_SHAPE))
    return worker


@pytest.mark.parametrize("connector", TRANSPORTS)
def test_bug3_p_restarted_with_the_same_engine_id_is_handshaken_again(connector):
    make = lambda role, engine_id, cache: make_named(connector, role, engine_id, cache)  # noqa: E731
    engine_id = f"p-same-{uuid.uuid4().hex[:6]}"  # as `pdserve up` names its instances
    d_cache = torch.zeros(KV_SHAPE)
    d = make("consumer", "d", d_cache)
    p1 = make("producer", engine_id, torch.full(KV_SHAPE, 1.0))
    p2 = None
    try:
        p1.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [3])]))
        d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("a", p1, [1], [3])]))
        poll([p1, d], lambda s, r: "a" in r and "p-req" in s)
        p1.shutdown()
        p2 = make("producer", engine_id, torch.full(KV_SHAPE, 2.0))  # restarted: same id, new boot
        p2.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [3])]))
        d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("b", p2, [2], [3])]))
        poll([p2, d], lambda s, r: "b" in r and "p-req" in s)
        assert d.get_load_error("b") is None
        assert torch.equal(d_cache[2], torch.full(KV_SHAPE[1:], 2.0))  # the new P's KV, not the dead one's
        assert list(d.loader.peers) == [(engine_id, p2.boot_id)]      # no mapping of the dead P left
        assert_idle(p2, d)
    finally:
        for worker in (d, p1, p2):
            if worker is not None:
                worker.shutdown()


def test_bug4_replayed_params_are_refused_once_claimed(make_worker):
    p = make_worker("producer")
    d1 = make_worker("consumer")
    d2 = make_worker("consumer")
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
    d1.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [5, 6], [1, 2])]))
    poll([p, d1], lambda s, r: "d-req" in r and "p-req" in s)
    assert d1.get_load_error("d-req") is None
    d2.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [7, 8], [1, 2])]))  # a replay
    poll([p, d2], lambda s, r: "d-req" in r, timeout=2)
    assert "already read this request's KV" in d2.get_load_error("d-req")
    assert d2.get_block_ids_with_load_errors() == {7, 8} and d2.get_stats()["kv_transfer_bytes_total"] == 0
    assert_idle(p, d1, d2)


def test_bug4_p_restarted_on_the_same_port_refuses_the_old_boots_params_at_once(make_nixl_worker):
    port, engine_id = free_port(), f"p-{uuid.uuid4().hex[:6]}"
    p1 = make_named("nixl", "producer", engine_id, side_channel_port=port)
    p1.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
    old_params = recv_spec("d-req", p1, [5, 6], [1, 2])
    p1.shutdown()
    p2 = make_named("nixl", "producer", engine_id, side_channel_port=port)  # as `pdserve up` restarts it
    d = make_nixl_worker("consumer")
    start = time.monotonic()
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[old_params]))
    poll([p2, d], lambda s, r: "d-req" in r, timeout=3)
    assert time.monotonic() - start < 2  # (the handshake deadline is 5 s)
    assert "restarted" in d.get_load_error("d-req") and d.get_stats()["kv_transfer_bytes_total"] == 0
    assert d.get_block_ids_with_load_errors() == {5, 6}
    assert_idle(p2, d)
    p2.shutdown()


def test_bug5_a_p_that_never_answers_does_not_starve_the_others(make_nixl_worker):
    p = make_nixl_worker("producer", lease_seconds=1.0)
    d = make_nixl_worker("consumer", lease_seconds=1.0, heartbeat_seconds=0.2)
    with socket.socket() as black_hole:  # accepts connections, never answers
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen(64)
        hole = black_hole.getsockname()[1]
        p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
        keep = keep_alive_spec("queued", p)
        stuck = [RecvSpec(f"stuck{i}", [10 + i], [1], f"hole-{i}", "x", "127.0.0.1", hole) for i in range(4)]
        d.start_load_kv(PullConnectorMeta(reqs_to_keep_alive=[keep], reqs_to_recv=stuck))
        start = time.monotonic()
        recving = []
        while time.monotonic() - start < 3.0:  # three leases: P's lease lives on D's heartbeats alone
            sending, r = p.get_finished()
            assert not sending, "a healthy P's lease expired while D heartbeated it"
            recving += d.get_finished()[1]
            time.sleep(0.005)
        assert sorted(recving) == [f"stuck{i}" for i in range(4)]  # each failed at its own deadline
        assert all("handshake" in d.get_load_error(f"stuck{i}") for i in range(4))
        assert d.get_block_ids_with_load_errors() == {10, 11, 12, 13}
        d.start_load_kv(PullConnectorMeta(reqs_to_release=[keep]))
        poll([p, d], lambda s, r: "p-req" in s)
    assert p.get_stats()["kv_lease_expirations_total"] == 0
    assert_idle(p, d)


def test_bug6_keep_alive_released_in_the_same_step_leaves_nothing(make_nixl_worker):
    recorder = Recorder()
    try:
        d = make_nixl_worker("consumer", heartbeat_seconds=0.05)
        keep = keep_alive_spec("d-req", recorder)
        d.start_load_kv(PullConnectorMeta(reqs_to_keep_alive=[keep], reqs_to_release=[keep]))
        deadline = time.monotonic() + 0.4
        poll([d], lambda s, r: time.monotonic() > deadline)
        assert recorder.types() == ["release"]  # and no heartbeat, ever
        assert_idle(d)
    finally:
        recorder.close()


def test_bug7_an_expired_reply_after_the_release_leaves_nothing(make_nixl_worker):
    recorder = Recorder(heartbeat_reply={"ok": True, "num_extended": 0, "expired": ["p-req"]})
    try:
        d = make_nixl_worker("consumer", heartbeat_seconds=0.05)
        keep = keep_alive_spec("d-req", recorder)
        recorder.may_answer.clear()
        d.start_load_kv(PullConnectorMeta(reqs_to_keep_alive=[keep]))
        poll([d], lambda s, r: "heartbeat" in recorder.types())  # sent; its reply is held back
        d.start_load_kv(PullConnectorMeta(reqs_to_release=[keep]))
        recorder.may_answer.set()                                 # "expired" lands after the release
        deadline = time.monotonic() + 0.3
        poll([d], lambda s, r: time.monotonic() > deadline)
        assert_idle(d)
    finally:
        recorder.close()


def test_bug7_releases_of_unknown_ids_stay_bounded_on_an_idle_p(make_nixl_worker):
    p = make_nixl_worker("producer")
    reply, _ = side_channel.request("127.0.0.1", p.side_channel_port, {
        "type": "release", "engine_id": "d", "remote_request_ids": [f"x{i}" for i in range(20_000)]})
    assert reply["ok"]
    assert sum(request_state(p).values()) <= 5_000
    assert p.num_pending_requests() == 0


def test_bug8_lease_not_longer_than_the_heartbeat_is_refused_at_start():
    with pytest.raises(ValueError, match=r"lease_seconds \(4\).*heartbeat_seconds \(5"):
        KVTransferConfig.from_json('{"lease_seconds": 4}', kv_connector="nixl")
    with pytest.raises(ValueError, match="heartbeat_seconds"):
        KVTransferConfig.from_json('{"lease_seconds": 2, "heartbeat_seconds": 2}', kv_connector="nixl")
    KVTransferConfig.from_json('{"lease_seconds": 4, "heartbeat_seconds": 1}', kv_connector="nixl")


def test_bug9_side_channel_errors_are_logged_with_the_peer(make_nixl_worker, caplog):
    caplog.set_level(logging.WARNING)
    recorder = Recorder(heartbeat_reply={"ok": True, "num_extended": 0, "expired": 5})  # malformed
    try:
        d = make_nixl_worker("consumer", heartbeat_seconds=0.05)
        keep = keep_alive_spec("d-req", recorder)
        d.start_load_kv(PullConnectorMeta(reqs_to_keep_alive=[keep]))
        poll([d], lambda s, r: "heartbeat" in recorder.types() and "heartbeat reply from" in caplog.text)
        assert f"heartbeat reply from 127.0.0.1:{recorder.side_channel_port}: TypeError" in caplog.text
        d.start_load_kv(PullConnectorMeta(reqs_to_release=[keep]))
        poll([d], lambda s, r: "release" in recorder.types())
        assert_idle(d)
    finally:
        recorder.close()


def test_bug9_a_malformed_handshake_reply_fails_the_request_cleanly(make_nixl_worker, caplog):
    fake = side_channel.SideChannelServer("127.0.0.1", 0, {
        "handshake": lambda m, b: ({"ok": True, "engine_id": "odd-p", "region": {"base_addr": "x"}}, b"")})
    try:
        d = make_nixl_worker("consumer")
        d.start_load_kv(PullConnectorMeta(reqs_to_recv=[
            RecvSpec("d-req", [1], [1], "odd-p", "p-req", "127.0.0.1", fake.port)]))
        poll([d], lambda s, r: "d-req" in r)
        assert "malformed reply" in d.get_load_error("d-req") and d.get_block_ids_with_load_errors() == {1}
        assert f"handshake reply from 127.0.0.1:{fake.port}" in caplog.text
        assert_idle(d)
    finally:
        fake.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_bug1_through_the_schedulers_answers_and_frees_everything(policy):
    """Bug 1 as a user meets it: D gets the params after P's lease ran out and P reused the blocks.
    fail: a clean error naming the lease; recompute: D computes the prompt itself (never P's stale
    blocks); either way nothing stays allocated on D or held on P."""
    from pdserve.core.request import Request, RequestStatus
    from pdserve.kv_transfer.factory import create_connector
    from pdserve.sampling_params import SamplingParams
    from tests.core.helpers import assert_no_leaks, fake_token, make_scheduler
    from tests.kv_transfer.test_cuda_ipc import TensorRunner

    block_size, prompt = 4, list(range(100, 113))
    p, d = [TensorRunner(make_scheduler(num_blocks=16, block_size=block_size, connector=conn_s, policy=policy),
                         conn_w, 16, block_size)
            for conn_s, conn_w in (create_connector(KVTransferConfig(
                kv_connector="cuda_ipc", kv_role=role, engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
                lease_seconds=0.3, heartbeat_seconds=0.1, kv_load_failure_policy=policy), block_size, COMPAT)
                for role in ("producer", "consumer"))]
    try:
        p.scheduler.add_request(Request("req", prompt, SamplingParams(max_tokens=1),
                                        kv_transfer_params={"do_remote_decode": True}))
        params = None
        while params is None:
            params = next((u.kv_transfer_params for u in p.step() if u.finished), None)
        while p.worker.get_stats()["kv_lease_expirations_total"] == 0:  # the proxy's second hop was slow
            p.step()
            time.sleep(0.01)
        p.kv_cache.fill_(-1.0)  # P reused the blocks for other requests
        d.scheduler.add_request(Request("req", prompt, SamplingParams(max_tokens=3), kv_transfer_params=params))
        tokens, finished, deadline = [], None, time.monotonic() + 5
        while finished is None and time.monotonic() < deadline:
            for u in d.step():
                tokens += u.new_token_ids
                finished = u.request if u.finished else finished
            time.sleep(0.001)
        assert finished is not None, "D never answered"
        if policy == "fail":
            assert finished.status == RequestStatus.FINISHED_ERROR
            assert "lease on this request's KV expired" in d.worker.get_load_error("req")
        else:
            assert tokens == [fake_token(len(prompt) - 1 + i) for i in range(3)]
            assert (d.kv_cache >= 0).all()  # nothing of P's reused blocks reached D's cache
            assert "lease on this request's KV expired" in d.worker.get_load_error("req")  # (or gone after 60 s)
        assert_no_leaks(p.scheduler)
        assert_no_leaks(d.scheduler)
        assert_idle(p.worker, d.worker)
    finally:
        p.worker.shutdown()
        d.worker.shutdown()
