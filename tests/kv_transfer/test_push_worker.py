"""The push handoff's worker halves over real NIXL (UCX, CPU DRAM): a P and a D worker in one process.

The safety rule under test everywhere: D reports a transfer (and so frees or reuses its blocks) only
once no WRITE can land in them, and P frees its blocks once its WRITE is over or will never start.
Without the progress thread a WRITE completes only while both agents are progressed, so every wait
polls both workers, as two engines stepping would.
"""
from __future__ import annotations

import time

import pytest
import torch

from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.pull import KeepAliveSpec
from pdserve.kv_transfer.push import PushConnectorMeta, PushRecvSpec, PushSendSpec
from pdserve.kv_transfer.push_lifecycle import write_notif

from tests.kv_transfer.helpers import KV_SHAPE, assert_idle, nixl_available, poll, worker_factory

if not nixl_available():
    pytest.skip("needs NIXL (nixl or nixl_cu13)", allow_module_level=True)


@pytest.fixture
def make_worker():
    yield from worker_factory("nixl-push")


def filled(seed: int) -> torch.Tensor:
    return torch.randn(KV_SHAPE, generator=torch.Generator().manual_seed(seed))


def recv_spec(p, transfer_id="t1", local=(3, 4, 5), first=0, request_id="d-req", port=None, boot_id=None):
    return PushRecvSpec(request_id, transfer_id, list(local), first, p.engine_id, "127.0.0.1",
                        port or p.side_channel_port, boot_id or p.boot_id)


def keep_alive(p, transfer_id="t1", request_id="d-req"):
    return KeepAliveSpec(request_id, p.engine_id, transfer_id, "127.0.0.1", p.side_channel_port, p.boot_id)


def test_write_lands_in_the_announced_blocks_announce_first(make_worker):
    p_cache, d_cache = filled(0), torch.zeros(KV_SHAPE)
    p, d = make_worker("producer", p_cache), make_worker("consumer", d_cache)
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=[7, 8, 20], first=1)]))
    poll([p, d], lambda s, r: "t1" in p.pusher.sends and p.pusher.sends["t1"].target is not None)
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [10, 11, 12, 13])]))
    sending, recving = poll([p, d], lambda s, r: "p-req" in s and "d-req" in r)
    for local, remote in zip([7, 8, 20], [11, 12, 13]):  # P's blocks [1, 4) → D's announced ids
        assert torch.equal(d_cache[local], p_cache[remote])
    assert torch.count_nonzero(d_cache[[0, 1, 2, 9, 10]]) == 0
    assert d.get_load_error("d-req") is None and not d.get_block_ids_with_load_errors()
    stats = p.get_stats()
    assert stats["kv_transfer_bytes_total"] == 3 * p_cache[0].numel() * 4
    assert stats["kv_transfer_descriptors_total"] == 2  # [11,12]→[7,8] and 13→20
    assert_idle(p, d)


def test_the_writes_notification_brings_ps_first_token_to_d(make_worker):
    """With push, D computed the prompt's last position again to sample its first token; in bfloat16 that
    can pick another token than P's prefill on a near-tie (one request in three on an H100, session 47).
    P's token now comes with the WRITE's notification, for D to start from as pull's D does."""
    p, d = make_worker("producer", filled(0)), make_worker("consumer", torch.zeros(KV_SHAPE))
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, transfer_id='t"1|\n', local=[4, 5])]))
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", 't"1|\n', [1, 2], (977,))]))
    tokens = {}
    poll([p, d], lambda s, r: tokens.update(d.get_first_token_ids()) or ("p-req" in s and "d-req" in r))
    assert tokens == {"d-req": [977]}
    d.get_finished()
    assert d.get_first_token_ids() == {}   # reported once, with the receive
    assert_idle(p, d)


@pytest.mark.parametrize("announce_first", [True, False])
def test_ps_token_reaches_d_ahead_of_the_kv(make_worker, monkeypatch, announce_first):
    """P sends its token over the side channel as soon as it has both the token and D's announce, for D to
    send on before the KV lands (as a pull D does); the notification carries it again. Here the notification
    is lost, so the token can only have come ahead."""
    from pdserve.kv_transfer import push_lifecycle
    monkeypatch.setattr(push_lifecycle, "NOTIF_GRACE_S", 0.5)
    p = make_worker("producer", filled(0))
    d = make_worker("consumer", torch.zeros(KV_SHAPE), heartbeat_seconds=0.05)
    d._take_notifs = lambda: [] if d.agent.get_new_notifs() else []   # progressed (P's WRITE ends), lost
    send = PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2], (977,))])
    if not announce_first:
        p.start_load_kv(send)
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=[4, 5])]))
    if announce_first:
        poll([p, d], lambda s, r: "t1" in p.pusher.sends and p.pusher.sends["t1"].target is not None)
        p.start_load_kv(send)
    tokens = {}
    poll([p, d], lambda s, r: tokens.update(d.get_first_token_ids()) or bool(tokens))
    assert tokens == {"d-req": [977]}
    poll([p, d], lambda s, r: "p-req" in s and "d-req" in r, timeout=5)   # (the lost notification's way out)
    assert d.get_block_ids_with_load_errors() == {4, 5} and d.get_load_error("d-req")
    assert_idle(p, d)


def test_a_token_ahead_is_taken_only_for_an_announced_receive_and_only_once(make_worker):
    """Before, a token came through for a request D only kept alive (no blocks, never announced: a real P
    sends only after the announce), and every repeat, with any value, was passed on (hostile review,
    session 48)."""
    p, d = make_worker("producer", filled(0)), make_worker("consumer", torch.zeros(KV_SHAPE))

    def token(value):
        d.receiver.on_first_token({"type": "first_token", "engine_id": p.engine_id, "boot_id": d.boot_id,
                                   "transfer_id": "t1", "token_ids": [value]})
        d.get_finished()
        return d.get_first_token_ids()
    d.start_load_kv(PushConnectorMeta(reqs_to_keep_alive=[keep_alive(p)]))
    assert token(5) == {}
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=[4, 5])]))
    assert token(6) == {"d-req": [6]}
    assert token(7) == {}
    d.start_load_kv(PushConnectorMeta(reqs_to_cancel={"d-req"}))
    poll([p, d], lambda s, r: "d-req" in r)
    assert_idle(p, d)


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_write_p_says_is_done_whose_notification_never_comes_fails_the_load(make_worker, monkeypatch, cancelled):
    """A D that cannot read P's notification (another format: a P of another version, before the handshake
    refused it) or never gets it held the request for ever, P answering "written" to every heartbeat (hostile
    review, session 48). NOTIF_GRACE_S after P's first "written" the load fails."""
    from pdserve.kv_transfer import push_lifecycle
    monkeypatch.setattr(push_lifecycle, "NOTIF_GRACE_S", 0.5)
    p = make_worker("producer", filled(0))
    d = make_worker("consumer", torch.zeros(KV_SHAPE), heartbeat_seconds=0.05)
    d._take_notifs = lambda: [] if d.agent.get_new_notifs() else []   # progressed (P's WRITE ends), lost
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=[4, 5])]))
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2], (9,))]))
    poll([p, d], lambda s, r: "p-req" in s)   # P's WRITE is over
    if cancelled:   # the request is aborted now: D releases, and P answers "written"
        d.start_load_kv(PushConnectorMeta(reqs_to_cancel={"d-req"}))
    poll([p, d], lambda s, r: "d-req" in r, timeout=5)
    assert d.get_first_token_ids() == {}
    if not cancelled:
        assert "notification never came" in d.get_load_error("d-req")
        assert d.get_block_ids_with_load_errors() == {4, 5}
    assert_idle(p, d)


def test_a_cancelled_receive_reports_no_first_token(make_worker):
    """The request was aborted while P wrote: its blocks go back when the WRITE is over, without P's token."""
    p, d = make_worker("producer", filled(0)), make_worker("consumer", torch.zeros(KV_SHAPE))
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=[4, 5])]))
    poll([p, d], lambda s, r: "t1" in p.pusher.sends and p.pusher.sends["t1"].target is not None)
    d.start_load_kv(PushConnectorMeta(reqs_to_cancel={"d-req"}))
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2], (9,))]))
    tokens = {}
    poll([p, d], lambda s, r: tokens.update(d.get_first_token_ids()) or ("p-req" in s and "d-req" in r))
    assert tokens == {}
    assert_idle(p, d)


def test_a_notification_that_is_not_a_transfers_is_ignored(make_worker):
    """Malformed ones, and the bare transfer id of the format before (which ended the receive), leave a
    receive waiting for t1 waiting: only a well-formed notification says its data is in."""
    p, d = make_worker("producer"), make_worker("consumer", torch.zeros(KV_SHAPE))
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=[4, 5])]))
    get_new_notifs = d.agent.get_new_notifs

    def arriving(message):   # a notification from P's agent, as D's agent hands it over (and progress)
        d.agent.get_new_notifs = lambda: {**get_new_notifs(), "p": [message.encode()]}

    for message in ["t1", "", "[1, 2]", '["t1", [-1], 0, 1]', '["t1", [1, 2], 0, 1]', '["t1", [true], 0, 1]',
                    '["t1", [], 1, 1]', '["t1", [], 0, 0]', "{", '["t1"]', '["t1", []]']:
        arriving(message)
        assert d.get_finished()[1] == set() and d.get_first_token_ids() == {}, message
        assert "d-req" in d.receiver.recvs
    arriving(write_notif("t1", (3,)))   # (the well-formed one, for contrast)
    assert d.get_finished()[1] == {"d-req"}
    assert d.get_first_token_ids() == {"d-req": [3]}
    d.agent.get_new_notifs = get_new_notifs


def test_write_after_prefill_when_the_announce_comes_second(make_worker):
    p_cache, d_cache = filled(1), torch.zeros(KV_SHAPE)
    p, d = make_worker("producer", p_cache), make_worker("consumer", d_cache)
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [2, 3])]))
    assert p.get_finished() == (set(), set()) and p.get_stats()["num_blocks_held_for_transfer"] == 2
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=[5, 6])]))
    poll([p, d], lambda s, r: "p-req" in s and "d-req" in r)
    assert torch.equal(d_cache[5:7], p_cache[2:4])
    assert_idle(p, d)


def test_p_request_aborted_fails_the_load_at_once(make_worker):
    p, d = make_worker("producer"), make_worker("consumer")
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p)]))
    poll([p, d], lambda s, r: p.pusher.sends.get("t1") is not None and p.pusher.sends["t1"].target is not None)
    p.start_load_kv(PushConnectorMeta(reqs_not_sent=[("p-req", "t1")]))
    poll([p, d], lambda s, r: "d-req" in r)
    assert "did not compute the prompt" in d.get_load_error("d-req")
    assert d.get_block_ids_with_load_errors() == {3, 4, 5}
    assert_idle(p, d)


def test_d_cancel_before_the_write_frees_both_sides(make_worker):
    p, d = make_worker("producer"), make_worker("consumer")
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p)]))
    poll([p, d], lambda s, r: p.pusher.sends.get("t1") is not None)
    d.start_load_kv(PushConnectorMeta(reqs_to_cancel={"d-req"}))
    poll([p, d], lambda s, r: "d-req" in r)
    assert d.get_load_error("d-req") is None  # an abort: the scheduler frees, no error for anyone
    # P computes it afterwards: the release came first, so its blocks go back at once, nothing is written
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2, 3])]))
    sending, _ = poll([p, d], lambda s, r: "p-req" in s)
    assert p.get_stats()["kv_transfer_bytes_total"] == 0
    assert_idle(p, d)


def test_p_holds_for_a_queued_d_while_it_heartbeats(make_worker):
    p = make_worker("producer", lease_seconds=0.4, heartbeat_seconds=0.1)
    d = make_worker("consumer", lease_seconds=0.4, heartbeat_seconds=0.1)
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2])]))
    d.start_load_kv(PushConnectorMeta(reqs_to_keep_alive=[keep_alive(p)]))
    end = time.monotonic() + 1.0  # 2.5 leases: only the keep-alive keeps P's hold
    while time.monotonic() < end:
        assert p.get_finished() == (set(), set())
        d.get_finished()
        time.sleep(0.01)
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=[4, 5])]))
    poll([p, d], lambda s, r: "p-req" in s and "d-req" in r)
    assert d.get_load_error("d-req") is None
    assert p.get_stats()["kv_lease_expirations_total"] == 0
    assert_idle(p, d)


def test_no_announce_within_a_lease_frees_p(make_worker):
    p = make_worker("producer", lease_seconds=0.3, heartbeat_seconds=0.1)
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2])]))
    poll([p], lambda s, r: "p-req" in s, timeout=3)
    assert p.get_stats()["kv_lease_expirations_total"] == 1
    reply, _ = side_channel.request("127.0.0.1", p.side_channel_port, {
        "type": "heartbeat", "engine_id": "d", "boot_id": p.boot_id, "transfer_ids": ["t1", "t2"]})
    assert reply["states"] == {"t1": "expired", "t2": "unknown"}
    assert_idle(p)


def test_p_gone_fails_the_load_without_waiting_out_the_write_bound(make_worker):
    p = make_worker("producer", lease_seconds=2.0, heartbeat_seconds=0.1)
    d = make_worker("consumer", lease_seconds=2.0, heartbeat_seconds=0.1)
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p)]))
    poll([p, d], lambda s, r: d.receiver.recvs["d-req"].state.value == "waiting")
    p.shutdown()  # its side channel closes: nothing listens, so nothing of it can write
    start = time.monotonic()
    poll([d], lambda s, r: "d-req" in r, timeout=5)
    assert time.monotonic() - start < 2.0
    assert "gone" in d.get_load_error("d-req")
    assert d.get_block_ids_with_load_errors() == {3, 4, 5}
    assert_idle(d)


def test_p_silent_holds_d_blocks_until_no_write_can_land(make_worker):
    """A P that accepts and never answers: D reports only after announce lease + write timeout."""
    import socket
    p = make_worker("producer")
    d = make_worker("consumer", lease_seconds=0.4, heartbeat_seconds=0.1,
                    extra={"write_timeout_seconds": 0.5})
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(64)  # accepts (the kernel does), never answers
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, port=sink.getsockname()[1])]))
    start = time.monotonic()
    poll([d], lambda s, r: "d-req" in r, timeout=12)
    waited = time.monotonic() - start
    # announce sent at ~0, its reply timed out (0.2 s = lease / 2): held until 0 + 0.4 + 0.5 + margin
    assert waited >= 0.9, waited
    assert "did not answer" in d.get_load_error("d-req")
    assert d.get_block_ids_with_load_errors() == {3, 4, 5}
    sink.close()
    assert_idle(d)


def test_d_layout_mismatch_fails_naming_both_values(make_worker):
    p = make_worker("producer")
    d = make_worker("consumer", compat={"model": "other", "dtype": "float32", "block_size": 4,
                                        "kv_layout": "blocks,layers,kv,slots,heads,dim"})
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p)]))
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2, 3])]))
    poll([p, d], lambda s, r: "p-req" in s and "d-req" in r)
    error = d.get_load_error("d-req")
    assert "mismatch" in error and "model local=" in error, error
    assert d.get_block_ids_with_load_errors() == {3, 4, 5}
    assert_idle(p, d)


def test_a_d_of_another_notification_format_is_refused_naming_both(make_worker, monkeypatch):
    """A P of session 48 pushing to an older D (its notifications the bare transfer id) wrote the KV, and D,
    unable to read the notification, held the request for ever (hostile review, session 48): the format is
    in the compatibility hash, so the handshake refuses the pair and the load fails at once."""
    from pdserve.kv_transfer import push_worker
    p = make_worker("producer")
    monkeypatch.setattr(push_worker, "NOTIF_FORMAT", 1)
    d = make_worker("consumer")
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p)]))
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2, 3])]))
    poll([p, d], lambda s, r: "p-req" in s and "d-req" in r)
    error = d.get_load_error("d-req")
    assert "push_notif local=2 remote=1" in error or "push_notif local=1 remote=2" in error, error
    assert d.get_block_ids_with_load_errors() == {3, 4, 5}
    assert_idle(p, d)


def test_a_second_d_announcing_the_same_transfer_is_refused(make_worker):
    p, d1, d2 = make_worker("producer"), make_worker("consumer"), make_worker("consumer")
    d1.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p)]))
    poll([p, d1], lambda s, r: d1.receiver.recvs["d-req"].state.value == "waiting")
    d2.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, request_id="d2-req")]))
    poll([p, d2], lambda s, r: "d2-req" in r)
    assert "another decode instance" in d2.get_load_error("d2-req")
    assert d2.get_block_ids_with_load_errors() == {3, 4, 5}
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2, 3])]))
    poll([p, d1], lambda s, r: "p-req" in s and "d-req" in r)
    assert d1.get_load_error("d-req") is None
    assert_idle(p, d1, d2)


def test_router_release_on_d_fails_the_load_once_p_confirms(make_worker):
    p, d = make_worker("producer"), make_worker("consumer")
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p)]))
    poll([p, d], lambda s, r: d.receiver.recvs["d-req"].state.value == "waiting")
    d.release_held(["t1"])  # the router: P's hop failed
    poll([p, d], lambda s, r: "d-req" in r)
    # D computes the prompt itself, whatever its kv_load_failure_policy: no error for the client
    assert d.get_block_ids_with_load_errors() == {3, 4, 5} and d.get_recompute_request_ids() == {"d-req"}
    assert d.get_load_error("d-req") is None and d.get_recompute_request_ids() == set()
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2, 3])]))
    poll([p, d], lambda s, r: "p-req" in s)  # released first: freed at once, never written
    assert p.get_stats()["kv_transfer_bytes_total"] == 0
    assert_idle(p, d)


def test_stale_boot_is_refused_at_once(make_worker):
    p, d = make_worker("producer"), make_worker("consumer")
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, boot_id="an-earlier-boot")]))
    poll([p, d], lambda s, r: "d-req" in r)
    assert "restarted" in d.get_load_error("d-req")
    assert d.get_block_ids_with_load_errors() == {3, 4, 5}
    assert_idle(p, d)


# ---- found by a hostile review: each failed before its fix ----------------------------------------

def _slow_handler(worker, kind, gate):
    handlers = worker._server._server.handlers
    real = handlers[kind]
    handlers[kind] = lambda message, blob: (gate.wait(10), real(message, blob))[1]


class StuckWrite:
    """A transport whose WRITE never ends and cannot be aborted (NIXL raising from release)."""

    def __init__(self, worker):
        worker._write = lambda transfer_id, remote, local_ids, remote_ids, tokens: (object(), "PROC", 1)
        worker._check = lambda handle: "PROC"
        worker._release = self.release

    @staticmethod
    def release(handle):
        if handle is not None:
            raise RuntimeError("cannot abort an active transfer")


def test_a_heartbeat_overtaking_the_announce_never_frees_the_blocks(make_worker):
    """P answers a heartbeat "unknown" before it serves the announce: that says nothing about a WRITE to
    come (the announce, served next, makes one), so D must not report the load on it."""
    import threading
    p_cache, d_cache = filled(5), torch.zeros(KV_SHAPE)
    p = make_worker("producer", p_cache)
    d = make_worker("consumer", d_cache, lease_seconds=2.0, heartbeat_seconds=0.05)
    gate = threading.Event()
    _slow_handler(p, "announce", gate)
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p)]))
    end = time.monotonic() + 0.6  # a dozen heartbeat periods, less than the announce's own deadline (1 s)
    while time.monotonic() < end:
        assert d.get_finished() == (set(), set())
        time.sleep(0.01)
    gate.set()
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [10, 11, 12])]))
    poll([p, d], lambda s, r: "p-req" in s and "d-req" in r)
    assert d.get_load_error("d-req") is None and torch.equal(d_cache[3:6], p_cache[10:13])
    assert_idle(p, d)


def test_an_error_p_cannot_abort_holds_both_sides(make_worker):
    """A WRITE that ended in an error but cannot be released may still land: P keeps its blocks and says
    "quarantined", and D keeps its blocks whatever its timers say. (A lease of 1 s: with 0.4 s, P's answers to
    D's heartbeats came late under the full suite's load once, and D took P for silent.)"""
    cfg = dict(lease_seconds=1.0, heartbeat_seconds=0.2, extra={"write_timeout_seconds": 0.3})
    p, d = make_worker("producer", **cfg), make_worker("consumer", **cfg)
    StuckWrite(p)
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p)]))
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2, 3])]))
    end = time.monotonic() + 4.5  # past D's silent-P bound (1.0 + 0.3 + 2 s): P answers, so no timer applies
    while time.monotonic() < end:
        assert p.get_finished()[0] == set() and d.get_finished()[1] == set()
        time.sleep(0.01)
    assert p.pusher.sends["t1"].state.value == "quarantined"
    p._release = lambda handle: None  # the transport lets go at last
    poll([p, d], lambda s, r: "p-req" in s and "d-req" in r)
    assert "did not finish" in d.get_load_error("d-req") and d.get_block_ids_with_load_errors() == {3, 4, 5}
    assert_idle(p, d)


def test_a_silent_p_is_waited_for_with_its_own_longer_bounds(make_worker):
    p = make_worker("producer", lease_seconds=6.0, heartbeat_seconds=1.0)
    d = make_worker("consumer", lease_seconds=0.4, heartbeat_seconds=0.1, extra={"write_timeout_seconds": 0.3})
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p)]))
    poll([p, d], lambda s, r: d.receiver.recvs["d-req"].state.value == "waiting")
    assert d.receiver.recvs["d-req"].p_bound == 6.0 + 60.0  # P's lease + write timeout, from its reply


def test_one_announce_naming_a_transfer_twice_is_refused_whole(make_worker):
    p = make_worker("producer")
    item = {"transfer_id": "t", "request_id": "r", "block_ids": [1], "first_block": 0}
    for items, port in (([item, dict(item, request_id="r2")], 9), ([item], True), ([dict(item, block_ids=[1] * 40)], 9)):
        reply, _ = side_channel.request("127.0.0.1", p.side_channel_port, {
            "type": "announce", "engine_id": "d", "boot_id": p.boot_id, "d_boot_id": "b", "host": "127.0.0.1",
            "port": port, "transfers": items})
        assert not reply["ok"] and p.pusher.sends == {}, reply  # (a cache of 32 blocks: 40 ids are refused)


def test_two_p_requests_on_one_transfer_id_free_the_second_at_once(make_worker):
    p = make_worker("producer")
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-1", "t1", [1, 2])]))
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-2", "t1", [3, 4])],
                                      reqs_not_sent=[("p-3", "t1")]))
    sending, _ = poll([p], lambda s, r: "p-2" in s)
    assert "p-1" not in sending and p.pusher.sends["t1"].request_id == "p-1"


def test_the_routers_release_before_d_has_the_request_recomputes_it_at_once(make_worker):
    p, d = make_worker("producer"), make_worker("consumer")
    d.release_held(["t1"])  # P's hop failed at once; D has not admitted the request yet
    d.start_load_kv(PushConnectorMeta(reqs_to_keep_alive=[keep_alive(p)]))
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p)]))
    poll([p, d], lambda s, r: "d-req" in r, timeout=2)
    assert d.get_recompute_request_ids() == {"d-req"} and d.get_block_ids_with_load_errors() == {3, 4, 5}
    assert p.pusher.sends == {}  # never announced
    assert d.get_load_error("d-req") is None
    assert_idle(p, d)


def test_a_flood_of_releases_for_unknown_ids_keeps_the_real_fates(make_worker):
    p, d = make_worker("producer"), make_worker("consumer")
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p)]))
    poll([p, d], lambda s, r: d.receiver.recvs["d-req"].state.value == "waiting")
    d.start_load_kv(PushConnectorMeta(reqs_to_cancel={"d-req"}))
    poll([p, d], lambda s, r: "d-req" in r)
    for start in range(0, 1 << 16, 4096):
        side_channel.request("127.0.0.1", p.side_channel_port, {
            "type": "release", "engine_id": "x", "boot_id": p.boot_id,
            "transfer_ids": [f"junk-{i}" for i in range(start, start + 4096)]})
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2, 3])]))
    poll([p], lambda s, r: "p-req" in s, timeout=1)  # still known released: freed at once, not at lease end


def test_a_write_done_at_once_is_timed_from_its_post_not_from_the_step():
    """A WRITE the transport finishes inside its post call was counted as 0 s (the step's start minus
    itself); it is timed from the post to when it is seen done."""
    from pdserve.config import KVTransferConfig
    from pdserve.kv_transfer.push_lifecycle import Pusher, Send, Target
    clock = iter([10.0, 10.2, 10.5, 10.5]).__next__

    class Transport:
        engine_id, boot_id = "p", "boot"
        counted = []

        def _post_write(self, *args):
            return object(), "DONE", 1, 1024

        def _release(self, handle):
            pass

        def _count_write(self, send, seconds):
            self.counted.append(seconds)
    t = Transport()
    pusher = Pusher(t, KVTransferConfig(kv_connector="nixl-push"), clock=lambda: clock())
    send = pusher.sends["t1"] = Send("t1", 100.0, "p-req", [1, 2], Target("d", "b", ("127.0.0.1", 1), "d-req", (5, 6), 0))
    pusher._peer = lambda target, now: type("Peer", (), {"is_failed": False, "remote": object()})()
    finished = set()
    pusher._start(send, 10.0, finished)
    assert finished == {"p-req"} and t.counted == [pytest.approx(0.2)]


def test_a_restarted_d_is_pushed_to_at_once(make_worker):
    """P kept the first boot's agent loaded (idle peers go after a minute), and NIXL refused the new boot's
    agent of the same name: every push to the restarted D failed for up to a minute (hostile review,
    session 47). Each boot's agent has a name of its own now."""
    from pdserve.config import KVTransferConfig
    from pdserve.kv_transfer.nixl_tp_push import TPNixlPushConnectorWorker
    from tests.kv_transfer.helpers import COMPAT
    p_cache = filled(7)
    p = make_worker("producer", p_cache)
    for boot, transfer_id in enumerate(("t1", "t2")):
        d_cache = torch.zeros(KV_SHAPE)
        d = TPNixlPushConnectorWorker(KVTransferConfig(kv_connector="nixl-push", kv_role="consumer"), "decode-0",
                                      COMPAT, None, KV_SHAPE[4])
        try:
            d.register_kv_caches(d_cache)
            d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, transfer_id, local=[5, 6])]))
            p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec(f"p-{transfer_id}", transfer_id, [2, 3])]))
            poll([p, d], lambda s, r: f"p-{transfer_id}" in s and "d-req" in r)
            assert d.get_load_error("d-req") is None, boot
            assert torch.equal(d_cache[5:7], p_cache[2:4])
        finally:
            d.shutdown()


def test_a_transport_error_on_connect_reaches_the_client_without_the_bindings_names(make_worker, monkeypatch):
    """Before, the client's error read 'a malformed reply (nixlNotAllowedError)': a binding's class name,
    which error bodies never carry (docs/security.md), and no malformed reply at all."""
    from pdserve.kv_transfer.nixl import NixlTransport

    class nixlNotAllowedError(Exception):
        pass

    def refuse(self, remote):
        raise nixlNotAllowedError("NIXL_ERR_NOT_ALLOWED")

    monkeypatch.setattr(NixlTransport, "_connect", refuse)
    p, d = make_worker("producer", filled(8)), make_worker("consumer")
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=[5, 6])]))
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [2, 3])]))
    poll([p, d], lambda s, r: "p-req" in s and "d-req" in r)
    error = d.get_load_error("d-req")
    assert f"could not connect to remote engine {d.engine_id}" in error and "nixl" not in error.lower(), error
