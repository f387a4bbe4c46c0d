"""NixlConnectorWorker over real NIXL (UCX, CPU DRAM): a P and a D worker in one process; what only
NIXL's side has (heartbeats, handshakes). The lifecycle shared with cuda_ipc: test_pull_worker.py.

Without the progress thread a READ completes only while both agents are progressed, so every
wait polls both workers, as two engines stepping would.
"""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.pull import PullConnectorMeta, RecvSpec, SendSpec

from tests.kv_transfer.helpers import (BLOCK_BYTES, COMPAT, KV_SHAPE, assert_idle, nixl_available, poll, recv_spec,
                                       worker_factory)

if not nixl_available():
    pytest.skip("needs NIXL (nixl or nixl_cu13)", allow_module_level=True)


@pytest.fixture
def make_worker():
    yield from worker_factory("nixl")


def test_heartbeats_extend_lease(make_worker):
    p = make_worker("producer", lease_seconds=0.3)
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
    for _ in range(8):  # 0.8 s > lease, heartbeats every 0.1 s
        reply, _ = side_channel.request("127.0.0.1", p.side_channel_port, {
            "type": "heartbeat", "engine_id": "d", "remote_request_ids": ["p-req", "unknown"]})
        assert reply == {"ok": True, "boot_id": p.boot_id, "num_extended": 1, "expired": [],
                         "unknown": ["unknown"]}  # "unknown": not seen (maybe not arrived yet), not expired
        assert p.get_finished() == (set(), set())
        time.sleep(0.1)
    sending, _ = poll([p], lambda s, r: "p-req" in s)
    assert p.get_stats()["kv_lease_expirations_total"] == 1
    reply, _ = side_channel.request("127.0.0.1", p.side_channel_port, {
        "type": "heartbeat", "engine_id": "d", "remote_request_ids": ["p-req", "unknown"]})
    assert reply == {"ok": True, "boot_id": p.boot_id, "num_extended": 0, "expired": ["p-req"],
                     "unknown": ["unknown"]}
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
        _, recving = poll([d], lambda s, r: "d-req" in r)
        fake_p.handshake_may_answer.set()  # the release follows the handshake on its P's lane
        _, later = poll([d], lambda s, r: fake_p.releases and not d.loader.peers)  # the late handshake fails nothing
        assert recving + later == ["d-req"]
        assert fake_p.releases == ["p-req"]
        assert d.get_block_ids_with_load_errors() == set()
        assert d.get_stats()["kv_transfer_failures_total"] == 0
        assert_idle(d)
    finally:
        fake_p.handshake_may_answer.set()
        fake_p.server.close()


def test_cancel_in_flight_reports_once_after_read(make_worker, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp,self")   # an emulated READ: in flight until P's agent progresses
    p = make_worker("producer")
    p._progress.stop()   # (and P's progress thread does not do it)
    d = make_worker("consumer")
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-warm", [0]), SendSpec("p-req", [3, 4])]))
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("warm", p, [0], [0], "p-warm")]))
    poll([p, d], lambda s, r: "warm" in r)  # handshake done: the next load claims at once
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [1, 2], [3, 4])]))
    poll([d], lambda s, r: d.loader.loads["d-req"].state.value == "reading")  # posted; P not stepped
    d.start_load_kv(PullConnectorMeta(reqs_to_cancel={"d-req"}))
    _, recving = poll([p, d], lambda s, r: "d-req" in r)
    _, later = poll([p, d], lambda s, r: True)
    assert recving + later == ["d-req"]
    poll([p, d], lambda s, r: not p.num_pending_requests())  # the claimed grant ends with the READ
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
    error = d.get_load_error("d-req")
    assert error.startswith("handshake with remote engine gone-p failed") and str(port) not in error
    assert d.get_load_error("d-req") is None  # returned and forgotten
    assert_idle(d)


def two_handoffs_the_second_stepping_only_d(make_worker, p_progress_thread: bool) -> None:
    """Two handoffs of blocks P holds; the first connects the two agents with both stepping, the second
    steps only D (P inside a long step), and must complete all the same."""
    p_cache = torch.arange(torch.zeros(KV_SHAPE).numel(), dtype=torch.float32).reshape(KV_SHAPE)
    p, d = make_worker("producer", kv_cache=p_cache.clone()), make_worker("consumer")
    if not p_progress_thread:
        p._progress.stop()
    for n, blocks in enumerate(([1, 2], [3, 4, 5])):
        p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec(f"p{n}", blocks)]))
        d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec(f"d{n}", p, [7, 8, 9][:len(blocks)], blocks,
                                                                   p_request_id=f"p{n}")]))
        poll([p, d] if n == 0 else [d], lambda s, r: f"d{n}" in r, timeout=3.0)
        assert torch.equal(d._kv_cache[[7, 8, 9][:len(blocks)]], p_cache[blocks])
        poll([p], lambda s, r: f"p{n}" in s)   # P's next step frees the blocks D read
    assert p.get_stats()["num_blocks_held_for_transfer"] == 0


def test_a_read_completes_while_p_is_inside_a_long_step(make_worker):
    """P's engine progresses its agent only between steps, and a CPU prefill step lasts seconds: D's READ
    must not wait for it (a READ that notified P through NIXL did, and D's stream stalled a whole P step
    after its first token). P learns the READ is done over the side channel, at its next step. (P's own
    progress thread is stopped: the READ is one-sided.)"""
    two_handoffs_the_second_stepping_only_d(make_worker, p_progress_thread=False)


def test_a_nixl_notification_naming_a_grant_frees_nothing(make_worker):
    """Before, any agent's notification naming P's request id freed its grant, claimed or not (an older D's
    READ notification, from one rank of a tensor-parallel D whose other ranks were still reading): only
    the claimant's "done" over the side channel ends a grant now."""
    from pdserve.kv_transfer.nixl import new_agent
    p = make_worker("producer")
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [3, 4])]))
    other = new_agent("old-d-rank0", False, "test")
    name = other.add_remote_agent(p.agent.get_agent_metadata())
    deadline, freed = time.monotonic() + 1.0, set()
    while time.monotonic() < deadline:
        try:
            other.send_notif(name, b"p-req")
        except Exception:   # (until the connection is up)
            pass
        other.get_new_notifs()
        freed |= p.get_finished()[0]
        time.sleep(0.01)
    assert "p-req" not in freed and p.get_stats()["num_blocks_held_for_transfer"] == 2
    p.release_held(["p-req"])
    poll([p], lambda s, r: "p-req" in s)


def test_p_progresses_its_agent_while_it_holds_grants(make_worker, monkeypatch):
    """A READ UCX moves by a path that needs P's agent (here: TCP only, emulated) completes while P's
    engine is inside a long step: P's own thread progresses the agent while it holds grants. Before, it
    waited for P's next step (seconds of prefill on CPU)."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    two_handoffs_the_second_stepping_only_d(make_worker, p_progress_thread=True)


def test_shutdown_stops_p_s_progress_thread_even_while_it_holds_grants(make_worker):
    p = make_worker("producer")
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [3, 4])]))
    poll([p], lambda s, r: p.holder.num_pending() == 1)
    assert p._progress is not None and p._progress.thread.is_alive()   # (CPU host: it runs)
    started = time.monotonic()
    p.shutdown()
    assert not p._progress.thread.is_alive() and time.monotonic() - started < 1.0


def test_a_p_rank_progresses_its_agent_while_rank_0_holds_grants(monkeypatch):
    """A tensor-parallel P's rank 1 (RankReader): a READ UCX can only emulate (TCP) completes while the
    rank is told rank 0 holds grants and is never polled again (P inside a long step), because its own
    thread progresses its agent; the thread stops at deregister. Before, that READ waited for P's next
    step."""
    from pdserve.kv_transfer.nixl_tp import RankReader
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    p_cache = torch.arange(torch.zeros(KV_SHAPE).numel(), dtype=torch.float32).reshape(KV_SHAPE)
    heads = 2 * KV_SHAPE[4]
    p_rank = RankReader.create("p-rank1-progress", False, 1, 2, heads, progress_while_holding=True)
    d_rank = RankReader.create("d-rank1-progress", False, 1, 2, heads)
    try:
        entry = p_rank.register(p_cache)
        d_rank.register(torch.zeros(KV_SHAPE))
        d_rank.connect("P:boot", [{}, entry])   # rank 1 reads P's rank 1 only
        p_rank.poll(holding=True)               # rank 0's last poll before its long step
        for blocks in ([1, 2], [3, 4, 5]):
            read_id, state, _ = d_rank.post("P:boot", [7, 8, 9][:len(blocks)], blocks)
            deadline = time.monotonic() + 3.0
            while (state := d_rank.poll()[read_id]) == "PROC" and time.monotonic() < deadline:
                time.sleep(0.001)
            assert state == "DONE"
            assert torch.equal(d_rank.kv_cache[[7, 8, 9][:len(blocks)]], p_cache[blocks])
            d_rank.release(read_id)
    finally:
        d_rank.disconnect("P:boot", keep_first=False)
        d_rank.deregister()
        started = time.monotonic()
        p_rank.deregister()
        assert not p_rank._progress.thread.is_alive() and time.monotonic() - started < 1.0
