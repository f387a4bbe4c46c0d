"""lifecycle.py through every transition: P's LeaseHolder on a fake clock (no network), D's Loader over a
fake transport against a fake P (a real side channel answered by a real LeaseHolder). Each test ends
with a leak check: no grant, no load, nothing left to report."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer import lifecycle, side_channel
from pdserve.kv_transfer.lifecycle import GrantState, LeaseHolder, Loader, LoadState
from pdserve.kv_transfer.pull import KeepAliveSpec, PullConnectorMeta, RecvSpec
from pdserve.kv_transfer.pull_worker_common import Region, RemoteEngine

REGION = {"base_addr": 0, "num_blocks": 64, "block_bytes": 16, "mem_type": "DRAM", "device_id": 0}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def holder_idle(holder: LeaseHolder) -> None:
    assert holder.num_pending() == 0 and holder.num_blocks_held() == 0


# ---- P: the lease holder ---------------------------------------------------------------------------

@pytest.fixture
def holder():
    clock = Clock()
    h = LeaseHolder(KVTransferConfig(lease_seconds=10, heartbeat_seconds=1), "boot-1", clock)
    h.clock_ = clock
    return h


def claim(holder, request_id, block_ids, claimant="d-1", boot_id="boot-1", engine_id="D"):
    reply = holder.on_claim({"engine_id": engine_id, "boot_id": boot_id,
                             "claims": [{"request_id": request_id, "block_ids": block_ids, "claimant": claimant}]})
    return reply["results"][request_id]


def test_held_claimed_read(holder):
    holder.hold("r", [4, 5, 6])
    assert holder.num_blocks_held() == 3
    assert claim(holder, "r", [5, 6]) == "held"          # a slice of the grant (D's prefix cache had block 4)
    assert holder._grants["r"].state == GrantState.CLAIMED
    assert claim(holder, "r", [5, 6]) == "held"          # the same load asking again
    assert claim(holder, "r", [5, 6], claimant="d-2") == "claimed"  # a replay to another D
    assert holder.step([]) == set()
    assert holder.step(["r"]) == {"r"}                   # the transport's notification: READ
    assert claim(holder, "r", [5, 6], claimant="d-3") == "read"
    holder_idle(holder)


def test_claim_refusals(holder):
    holder.hold("r", [1, 2])
    assert claim(holder, "r", [1, 2], boot_id="boot-0") == "stale_boot"  # params of an earlier boot
    assert claim(holder, "r", [1, 3]) == "mismatch"                      # a block never granted
    assert claim(holder, "never", [1]) == "unknown"
    assert holder._grants["r"].state == GrantState.HELD                   # none of them claimed it
    holder.end(["r"], GrantState.RELEASED)
    assert holder.step([]) == {"r"}
    assert claim(holder, "r", [1, 2]) == "released"
    holder_idle(holder)


def test_lease_expires_and_a_claim_extends_it(holder):
    holder.hold("a", [1])
    holder.hold("b", [2])
    holder.clock_.now += 8
    assert claim(holder, "b", [2]) == "held"             # b's deadline: now + 10
    holder.clock_.now += 3                               # 11 s after hold
    assert holder.step([]) == {"a"} and holder.num_expirations == 1
    assert claim(holder, "a", [1]) == "expired"
    reply = holder.on_heartbeat({"boot_id": "boot-1", "remote_request_ids": ["a", "b", "x"]})
    assert reply["expired"] == ["a"] and reply["unknown"] == ["x"] and reply["num_extended"] == 1
    holder.clock_.now += 9.5                             # the heartbeat moved b's deadline
    assert holder.step([]) == set()
    holder.clock_.now += 1
    assert holder.step([]) == {"b"} and holder.num_expirations == 2
    holder_idle(holder)


def test_heartbeat_of_another_boot_extends_nothing(holder):
    holder.hold("r", [1])
    reply = holder.on_heartbeat({"boot_id": "boot-0", "remote_request_ids": ["r"]})
    assert reply["num_extended"] == 0 and reply["unknown"] == ["r"] and reply["boot_id"] == "boot-1"
    holder.on_end({"boot_id": "boot-0", "remote_request_ids": ["r"]}, GrantState.RELEASED)  # ignored
    assert holder.step([]) == set()
    holder.on_end({"boot_id": "boot-1", "remote_request_ids": ["r"]}, GrantState.RELEASED)
    assert holder.step([]) == {"r"}
    holder_idle(holder)


def test_heartbeat_after_the_read_is_not_a_lost_lease(holder):
    """P saw the READ's notification before D saw its READ done: a heartbeat then must not say the
    lease is gone (D would fail a good READ)."""
    holder.hold("r", [1])
    assert claim(holder, "r", [1]) == "held"
    assert holder.step(["r"]) == {"r"}
    reply = holder.on_heartbeat({"boot_id": "boot-1", "remote_request_ids": ["r"]})
    assert reply["expired"] == [] and reply["unknown"] == []


def test_done_or_release_before_the_grant_arrives(holder):
    holder.end(["r"], GrantState.READ)                   # D read it before P's SendSpec got here
    holder.hold("r", [1])
    assert holder.step([]) == {"r"} and holder.num_expirations == 0
    holder_idle(holder)


def end_from(holder, request_id, state, engine_id, claimant=None):
    message = {"engine_id": engine_id, "boot_id": "boot-1", "remote_request_ids": [request_id]}
    if claimant is not None:
        message["claimants"] = [claimant]
    assert holder.on_end(message, state) == {"ok": True}


def test_a_claimed_grant_ends_only_by_its_claimants_word(holder):
    """Before, any D's release ended a claimed grant: a replay of the same params to a second D, whose
    claim was refused, released the blocks while the first D was still reading them."""
    holder.hold("r", [1, 2])
    assert claim(holder, "r", [1, 2], claimant="d-1", engine_id="D") == "held"
    end_from(holder, "r", GrantState.RELEASED, "D2", "d-9")       # another D
    end_from(holder, "r", GrantState.RELEASED, "D", "d-2")        # the same D, another of its requests
    end_from(holder, "r", GrantState.READ, "D2")                  # another D, naming no claimant
    assert holder.step([]) == set() and holder._grants["r"].state == GrantState.CLAIMED
    end_from(holder, "r", GrantState.READ, "D", "d-1")            # the claimant
    assert holder.step([]) == {"r"} and holder.num_expirations == 0
    holder.hold("s", [3])                                         # unclaimed: a "done" is nobody's ...
    end_from(holder, "s", GrantState.READ, "D2", "d-7")
    assert holder.step([]) == set()
    end_from(holder, "s", GrantState.RELEASED, "D2", "d-7")      # ... anyone's release frees it
    assert holder.step([]) == {"s"}
    end_from(holder, "u", GrantState.READ, "D", "d-8")            # a "done" before the grant: dropped
    holder.hold("u", [5])
    assert holder.step([]) == set() and holder._grants["u"].state == GrantState.HELD
    holder.end(["u"], GrantState.RELEASED)
    assert holder.step([]) == {"u"}
    holder.hold("t", [4])
    assert claim(holder, "t", [4], claimant="d-3", engine_id="D") == "held"
    end_from(holder, "t", GrantState.READ, "D")                   # the claimant's engine, no claimant named
    assert holder.step([]) == {"t"}
    holder_idle(holder)


def test_notices_for_unknown_ids_are_bounded_and_forgotten(holder):
    holder.on_end({"remote_request_ids": [f"x{i}" for i in range(3 * lifecycle.MAX_EARLY)]}, GrantState.RELEASED)
    assert len(holder._early) == lifecycle.MAX_EARLY
    holder.hold("r", [1])
    assert claim(holder, "r", [1]) == "held"
    holder.step(["r"])
    holder.clock_.now += 11                              # one lease later nothing is remembered
    holder.step([])
    assert not holder._early and not holder._ended
    holder_idle(holder)


# ---- D: the loader ----------------------------------------------------------------------------------

class FakeP:
    """A P's side channel: handshakes from a fixed reply, the rest from a real LeaseHolder."""

    def __init__(self, engine_id="P", boot_id="boot-1", handshake=None, lease_seconds=10, claim=None, port=0):
        self.engine_id, self.boot_id = engine_id, boot_id
        self.holder = LeaseHolder(KVTransferConfig(lease_seconds=lease_seconds, heartbeat_seconds=1), boot_id)
        self.messages: list[dict] = []
        self.gate = threading.Event()
        self.gate.set()

        def on(kind, fn):
            def handler(message, blob):
                self.messages.append(message)
                self.gate.wait(10)
                return fn(message), b""
            return handler
        self.server = side_channel.SideChannelServer("127.0.0.1", port, {
            "handshake": on("handshake", handshake or (lambda m: {"ok": True, "engine_id": engine_id,
                                                                  "boot_id": boot_id, "region": REGION})),
            "claim": on("claim", claim or self.holder.on_claim),
            "heartbeat": on("heartbeat", self.holder.on_heartbeat),
            "release": on("release", lambda m: self.holder.on_end(m, GrantState.RELEASED)),
            "done": on("done", lambda m: self.holder.on_end(m, GrantState.READ))})
        self.port = self.server.port

    def types(self):
        return [m["type"] for m in self.messages]

    def spec(self, request_id, local, remote, p_request_id="p-req", boot_id=None):
        return RecvSpec(request_id, local, remote, self.engine_id, p_request_id, "127.0.0.1", self.port,
                        boot_id or self.boot_id)

    def keep(self, request_id, p_request_id="p-req"):
        return KeepAliveSpec(request_id, self.engine_id, p_request_id, "127.0.0.1", self.port, self.boot_id)


class FakeTransport:
    notifies_done = True
    _inject_read_failure = None

    def __init__(self) -> None:
        self.engine_id, self.compat_hash = "D", "hash"
        self._region = Region(**REGION)
        self.state, self.can_release, self.check_raises = "PROC", True, False
        self.posted, self.connected, self.disconnected, self.done = [], [], [], []
        self.errors, self.error_blocks = {}, set()

    def _parse_handshake(self, engine_id, reply, blob):
        if not reply.get("ok"):
            raise RuntimeError(f"handshake with remote engine {engine_id} failed: {reply.get('error')}")
        return RemoteEngine(engine_id, Region(**reply["region"]), reply, blob)

    def connect_remote(self, remote):
        self.connected.append(remote.engine_id)

    def _disconnect(self, remote):
        self.disconnected.append(remote.engine_id)

    def _post_read(self, load, remote):
        self.posted.append(load.spec.request_id)
        return object(), "PROC", 1, 16 * len(load.spec.local_block_ids)

    def _check(self, handle):
        if self.check_raises:
            raise RuntimeError("nixlBackendError")
        return self.state

    def _release(self, handle):
        if not self.can_release:
            raise RuntimeError("cannot abort an active transfer")

    def _send_done(self, peer, request_ids, claimants):
        assert len(claimants) == len(request_ids)
        self.done.extend(request_ids)

    def _load_failed(self, load, error, invalid_block_ids):
        self.errors[load.spec.request_id] = error
        self.error_blocks.update(invalid_block_ids)

    def take_load_error(self, request_id):
        return self.errors.pop(request_id, None)

    def take_error_blocks(self):
        error_blocks, self.error_blocks = self.error_blocks, set()
        return error_blocks

    def _count_read(self, load, seconds):
        self.num_bytes = getattr(self, "num_bytes", 0) + load.num_bytes

    def _invalid_blocks(self, load, state):
        return [] if state == "DONE" else list(load.spec.local_block_ids)


@pytest.fixture
def d():
    clock = Clock()
    transport = FakeTransport()
    loader = Loader(transport, KVTransferConfig(lease_seconds=4, heartbeat_seconds=1), clock)
    loader.clock_, loader.t_ = clock, transport
    fakes: list[FakeP] = []
    loader.fake_p = lambda **kw: fakes.append(FakeP(**kw)) or fakes[-1]
    yield loader
    loader.shutdown()
    for fake in fakes:
        fake.gate.set()
        fake.server.close()


def step_until(loader, until, timeout=3.0):
    finished: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        finished |= loader.step()
        if until(finished):
            return finished
        time.sleep(0.002)
    raise AssertionError(f"timed out; finished={finished}, loads={ {r: l.state for r, l in loader.loads.items()} }")


def loader_idle(loader):
    assert not loader.loads and loader.num_pending() == 0 and not loader.t.errors and not loader.t.error_blocks


def state(loader, request_id):
    return loader.loads[request_id].state


def test_handshake_claim_read_done(d):
    p = d.fake_p()
    p.holder.hold("p-req", [7, 8])
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-req", [1, 2], [7, 8])]))
    assert state(d, "d-req") == LoadState.HANDSHAKING
    step_until(d, lambda f: "d-req" in d.t_.posted)
    assert state(d, "d-req") == LoadState.READING and p.types() == ["handshake", "claim"]
    assert p.holder._grants["p-req"].state == GrantState.CLAIMED
    d.t_.state = "DONE"
    assert step_until(d, lambda f: "d-req" in f) == {"d-req"}
    assert d.t_.done == ["p-req"] and d.t_.num_bytes == 32 and d.t_.take_load_error("d-req") is None
    p.holder.end(d.t_.done, GrantState.READ)  # (the fake transport's notice)
    assert p.holder.step([]) == {"p-req"}
    # a second load from the same P boot: no handshake, straight to CLAIMING
    p.holder.hold("p-2", [9])
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-2", [3], [9], "p-2")]))
    assert state(d, "d-2") == LoadState.CLAIMING
    step_until(d, lambda f: "d-2" in f)
    assert p.types().count("handshake") == 1
    loader_idle(d)


def test_a_done_lost_on_the_way_is_sent_once_more(d):
    """Before, a "done" whose exchange failed left P holding the blocks a whole lease (and counting an
    expiry for a READ that had ended)."""
    p = d.fake_p()
    p.holder.hold("p-req", [7])
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-req", [1], [7])]))
    step_until(d, lambda f: "d-req" in d.t_.posted)
    d.t_.state = "DONE"
    step_until(d, lambda f: "d-req" in f)
    peer = next(iter(d.peers.values()))
    handle, calls = p.server._server.handlers["done"], []

    def lost_once(message, blob):
        calls.append(message)
        if len(calls) == 1:
            raise ConnectionResetError("lost")
        return handle(message, blob)
    p.server._server.handlers["done"] = lost_once
    d.send_done(peer, ["p-req"], ["d-req"])
    step_until(d, lambda f: len(calls) == 2 and p.holder._grants["p-req"].state == GrantState.READ)
    assert p.holder.step([]) == {"p-req"} and p.holder.num_expirations == 0
    time.sleep(0.05)
    d.step()
    assert len(calls) == 2   # once more, not for ever
    loader_idle(d)


def test_handshake_without_answer_fails_at_its_deadline(d):
    with socket.socket() as black_hole:  # accepts connections (the backlog), never answers
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen(16)
        spec = RecvSpec("d-req", [1], [1], "P", "p-req", "127.0.0.1", black_hole.getsockname()[1], "boot-1")
        d.apply(PullConnectorMeta(reqs_to_recv=[spec]))
        d.step()
        finished = step_until(d, lambda f: "d-req" in f, timeout=d.timeout + 2)  # the exchange's own deadline
    assert finished == {"d-req"} and d.t_.take_error_blocks() == {1}
    assert "handshake" in d.t_.take_load_error("d-req")
    d.clock_.now += 1.1
    d.step()
    assert not d.peers  # a P that never answered leaves no connection behind
    loader_idle(d)


def test_claim_unknown_is_asked_again_until_the_claim_deadline(d, monkeypatch):
    monkeypatch.setattr(lifecycle, "CLAIM_RETRY_S", 0.0)  # (the fake clock stands still)
    p = d.fake_p()
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-req", [1], [7])]))
    step_until(d, lambda f: p.types().count("claim") >= 3)  # "unknown": the grant may be on its way
    assert state(d, "d-req") == LoadState.CLAIMING
    d.clock_.now += d.timeout + 0.1                       # longer than one exchange: P answers, so ask on
    step_until(d, lambda f: p.types().count("claim") >= 5)
    assert state(d, "d-req") == LoadState.CLAIMING
    d.clock_.now += d.claim_timeout
    assert step_until(d, lambda f: "d-req" in f) == {"d-req"}
    assert "claim" in d.t_.take_load_error("d-req") and d.t_.take_error_blocks() == {1}
    step_until(d, lambda f: "release" in p.types())  # P may free it, had it come after all
    loader_idle(d)


def test_a_slow_d_step_does_not_fail_a_claim(d):
    """D's steps under load take seconds (the 10,000-request CPU soak): a load that entered CLAIMING at
    one step's start is claimed at its end, and P's reply is applied a step later. Neither is P's
    silence; only the claim's own exchange, or claim_timeout, may fail it."""
    p = d.fake_p()
    p.holder.hold("p-1", [7])
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-1", [1], [7], "p-1")]))
    step_until(d, lambda f: "d-1" in d.t_.posted)      # connected to P
    d.t_.state = "DONE"
    step_until(d, lambda f: "d-1" in f)
    d.t_.state = "PROC"
    p.holder.hold("p-2", [8])
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-2", [2], [8], "p-2")]))
    assert state(d, "d-2") == LoadState.CLAIMING
    d.clock_.now += d.timeout + 0.5                      # the step that began with the RecvSpec took this long
    d.step()
    assert state(d, "d-2") == LoadState.CLAIMING and "claim" in p.types()  # sent, not failed
    d.clock_.now += 1                                    # and the next one, while the reply came back
    step_until(d, lambda f: "d-2" in d.t_.posted or "d-2" in f)
    assert d.t_.take_load_error("d-2") is None
    d.t_.state = "DONE"
    assert step_until(d, lambda f: "d-2" in f) == {"d-2"}
    loader_idle(d)


@pytest.mark.parametrize("result, words", [("expired", "lease on this request's KV expired"),
                                           ("stale_boot", "restarted"), ("mismatch", "differ"),
                                           ("claimed", "another load already claimed")])
def test_claim_refused(d, result, words):
    p = d.fake_p(claim=lambda m: {"ok": True, "results": {"p-req": result}})
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-req", [1, 2], [7, 8])]))
    assert step_until(d, lambda f: "d-req" in f) == {"d-req"}
    assert words in d.t_.take_load_error("d-req") and d.t_.take_error_blocks() == {1, 2} and not d.t_.posted
    loader_idle(d)


def test_malformed_claim_reply_fails_the_load(d, caplog):
    p = d.fake_p(claim=lambda m: {"ok": True, "results": "nonsense"})
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-req", [1], [7])]))
    assert step_until(d, lambda f: "d-req" in f) == {"d-req"}
    assert "malformed reply" in d.t_.take_load_error("d-req") and d.t_.take_error_blocks() == {1}
    assert f"claim reply from 127.0.0.1:{p.port}" in caplog.text  # the peer goes to the log
    loader_idle(d)


def test_handshake_naming_another_boot_fails_at_once(d):
    p = d.fake_p(boot_id="boot-2")  # P restarted: the params name boot-1
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-req", [1], [7], boot_id="boot-1")]))
    assert step_until(d, lambda f: "d-req" in f, timeout=1) == {"d-req"}
    assert "restarted" in d.t_.take_load_error("d-req") and not d.t_.connected and d.t_.take_error_blocks() == {1}
    loader_idle(d)


def test_new_boot_of_an_engine_replaces_the_old_connection(d):
    old = d.fake_p(boot_id="boot-1")
    old.holder.hold("p-req", [7])
    d.apply(PullConnectorMeta(reqs_to_recv=[old.spec("a", [1], [7])]))
    d.t_.state = "DONE"
    step_until(d, lambda f: "a" in f)
    new = d.fake_p(boot_id="boot-2")  # the same engine id, restarted (on another port here)
    new.holder.hold("p-req", [7])
    d.apply(PullConnectorMeta(reqs_to_recv=[new.spec("b", [1], [7])]))
    step_until(d, lambda f: "b" in f)
    assert d.t_.connected == ["P", "P"] and d.t_.disconnected == ["P"]
    assert list(d.peers) == [("P", "boot-2")]
    loader_idle(d)


def test_read_past_its_deadline_is_aborted(d):
    p = d.fake_p()
    p.holder.hold("p-req", [7])
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-req", [1], [7])]))
    step_until(d, lambda f: d.t_.posted)
    d.clock_.now += d.read_timeout + 0.1
    assert step_until(d, lambda f: "d-req" in f) == {"d-req"}
    assert "did not finish within" in d.t_.take_load_error("d-req") and d.t_.take_error_blocks() == {1}
    step_until(d, lambda f: "release" in p.types())
    assert p.holder.step([]) == {"p-req"} and d.num_quarantined == 0
    loader_idle(d)


def test_read_is_aborted_when_p_stops_confirming_the_lease(d):
    """P answers no heartbeat for a lease period while the READ runs (P died, or froze): the READ's
    blocks may be freed under it; it ends long before read_timeout_seconds."""
    p = d.fake_p()
    p.holder.hold("p-req", [7])
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-req", [1], [7])]))
    step_until(d, lambda f: d.t_.posted)
    p.gate.clear()  # heartbeats go unanswered
    d.clock_.now += 4.1
    assert step_until(d, lambda f: "d-req" in f) == {"d-req"}
    assert "stopped confirming its lease" in d.t_.take_load_error("d-req") and d.t_.take_error_blocks() == {1}
    p.gate.set()
    loader_idle(d)


def test_read_that_cannot_be_aborted_is_quarantined_until_the_transport_lets_go(d):
    p = d.fake_p()
    p.holder.hold("p-req", [7, 8])
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-req", [1, 2], [7, 8])]))
    step_until(d, lambda f: d.t_.posted)
    d.t_.can_release = False
    d.clock_.now += d.read_timeout + 0.1
    for _ in range(20):  # failed (P released, counted) but its blocks stay with the request
        assert d.step() == set()
    assert state(d, "d-req") == LoadState.QUARANTINED and d.num_quarantined == 1 and d.num_failures == 1
    d.t_.state = "ERR"  # the transport gives up on it, but until it lets the handle go ...
    for _ in range(5):
        assert d.step() == set()
    d.t_.can_release = True  # ... something may still write: now nothing can
    assert step_until(d, lambda f: "d-req" in f) == {"d-req"}
    assert d.t_.take_error_blocks() == {1, 2} and "did not finish" in d.t_.take_load_error("d-req")
    loader_idle(d)


def test_a_read_that_errs_with_a_part_still_active_keeps_its_blocks_until_that_ends(d):
    """A tensor-parallel READ is ERR as soon as one rank's errs, while another rank's may still be
    writing. Before, its blocks went back to D's pool at once (and to another request, under the write)."""
    p = d.fake_p()
    p.holder.hold("p-req", [7, 8])
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-req", [1, 2], [7, 8])]))
    step_until(d, lambda f: d.t_.posted)
    d.t_.state, d.t_.can_release = "ERR", False
    for _ in range(20):  # failed (P released, counted) but its blocks stay with the request
        assert d.step() == set()
    assert state(d, "d-req") == LoadState.QUARANTINED and d.num_quarantined == 1 and d.num_failures == 1
    assert not d.t_.take_error_blocks()
    d.t_.can_release = True   # the last part ended
    assert step_until(d, lambda f: "d-req" in f) == {"d-req"}
    assert d.t_.take_error_blocks() == {1, 2} and "transfer error" in d.t_.take_load_error("d-req")
    assert d.num_failures == 1
    loader_idle(d)


def test_transfer_status_raising_is_an_error_state(d):
    p = d.fake_p()
    p.holder.hold("p-req", [7])
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-req", [1], [7])]))
    step_until(d, lambda f: d.t_.posted)
    d.t_.check_raises = True
    assert step_until(d, lambda f: "d-req" in f) == {"d-req"}
    assert "transfer error" in d.t_.take_load_error("d-req") and d.t_.take_error_blocks() == {1}
    d.clock_.now += 1.1
    d.step()
    assert not d.peers  # a peer whose READ failed is dropped; the next load handshakes again
    loader_idle(d)


def test_cancel_in_each_state(d):
    p = d.fake_p()
    p.gate.clear()  # P answers nothing for now
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("hs", [1], [7], "p1")]))
    assert state(d, "hs") == LoadState.HANDSHAKING
    d.apply(PullConnectorMeta(reqs_to_cancel={"hs", "never-seen"}))
    assert d.step() == {"hs", "never-seen"}
    p.gate.set()
    step_until(d, lambda f: d.peers and next(iter(d.peers.values())).remote is not None)
    p.holder.hold("p2", [8])
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("cl", [2], [8], "p2")]))
    assert state(d, "cl") == LoadState.CLAIMING
    d.apply(PullConnectorMeta(reqs_to_cancel={"cl"}))
    assert d.step() == {"cl"}
    p.holder.hold("p3", [9])
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("rd", [3], [9], "p3")]))
    step_until(d, lambda f: "rd" in d.t_.posted)
    d.apply(PullConnectorMeta(reqs_to_cancel={"rd"}))
    for _ in range(5):  # in flight: it may still write into its blocks
        assert d.step() == set()
    d.t_.state = "DONE"
    assert step_until(d, lambda f: "rd" in f) == {"rd"}
    step_until(d, lambda f: p.types().count("release") >= 2)
    assert p.holder.step([]) == {"p2"}  # the claimed-then-cancelled grant was released
    assert not d.t_.take_error_blocks()
    loader_idle(d)


def test_keep_alive_heartbeats_then_release(d):
    p = d.fake_p()
    p.holder.hold("p-req", [7])
    d.apply(PullConnectorMeta(reqs_to_keep_alive=[p.keep("d-req")]))
    assert state(d, "d-req") == LoadState.QUEUED and d.num_pending() == 0  # not the scheduler's wait
    d.clock_.now += 1.1
    step_until(d, lambda f: "heartbeat" in p.types())
    d.apply(PullConnectorMeta(reqs_to_release=[p.keep("d-req")]))
    step_until(d, lambda f: "release" in p.types())
    loader_idle(d)


def test_keep_alive_and_release_in_one_step_leave_nothing(d):
    """Bug 6: a request aborted (or covered by D's prefix cache) before D's first step."""
    p = d.fake_p()
    d.apply(PullConnectorMeta(reqs_to_keep_alive=[p.keep("d-req")], reqs_to_release=[p.keep("d-req")]))
    loader_idle(d)
    d.clock_.now += 5
    step_until(d, lambda f: "release" in p.types())
    assert "heartbeat" not in p.types()


def test_late_heartbeat_reply_after_release_leaves_nothing(d):
    """Bug 7: P's "expired" lands after the request was released: nothing may be added then."""
    p = d.fake_p()
    d.apply(PullConnectorMeta(reqs_to_keep_alive=[p.keep("d-req")]))
    p.gate.clear()
    d.clock_.now += 1.1
    d.step()                                   # the heartbeat goes out; P holds the reply
    d.apply(PullConnectorMeta(reqs_to_release=[p.keep("d-req")]))
    p.gate.set()
    step_until(d, lambda f: all(c.num_pending == 0 for c in d.clients.values()))
    loader_idle(d)


def test_one_heartbeat_in_flight_per_peer(d):
    p = d.fake_p()
    d.apply(PullConnectorMeta(reqs_to_keep_alive=[p.keep("d-req")]))
    p.gate.clear()
    for _ in range(5):
        d.clock_.now += 1.1
        d.step()
        time.sleep(0.01)
    assert p.types() == ["heartbeat"]          # the rest were skipped, not queued
    p.gate.set()
    d.apply(PullConnectorMeta(reqs_to_release=[p.keep("d-req")]))
    step_until(d, lambda f: "release" in p.types())
    loader_idle(d)


def test_idle_connections_are_dropped(d, monkeypatch):
    monkeypatch.setattr(lifecycle, "PEER_IDLE_S", 5.0)
    p = d.fake_p()
    p.holder.hold("p-req", [7])
    d.apply(PullConnectorMeta(reqs_to_recv=[p.spec("d-req", [1], [7])]))
    d.t_.state = "DONE"
    step_until(d, lambda f: "d-req" in f)
    step_until(d, lambda f: all(c.num_pending == 0 for c in d.clients.values()))
    d.clock_.now += 6
    d.step()
    assert not d.peers and not d.clients and d.t_.disconnected == ["P"]
    loader_idle(d)
