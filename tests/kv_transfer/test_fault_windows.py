"""The fault matrix's windows of a few milliseconds, which processes and signals cannot hit on purpose
(tests/e2e/test_fault_matrix.py has the rest): P killed while D reads, P killed after D read but
before P acted on D's "done", a "done" that never arrives. Real NIXL workers; P runs in a
child process (so it can be SIGKILLed) that steps only when told, D in this process, stepped by the
test. Each ends within two leases and in a leak check."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pdserve.kv_transfer.pull import PullConnectorMeta, SendSpec

from tests.kv_transfer.helpers import BLOCK_BYTES, COMPAT, KV_SHAPE, assert_idle, nixl_available, poll, recv_spec

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs NIXL")

LEASE = 2.0
BOUND = 2 * LEASE

# P in a child process: a NIXL producer holding p-req's blocks 1 and 2 (filled with 1.0 + block id); it
# prints (after '@@ ') its side channel and boot, then steps (get_finished) once per "step" line and prints what it
# reported; on "progress" it progresses its agent only (a first READ from a new peer waits for that: the
# connection's setup); on "state" it prints p-req's grant state (D's "done" lands there from the side
# channel's thread; only a step acts on it). Without either its agent is never progressed.
CHILD_P = f"""
import json, sys, torch
from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.nixl import NixlConnectorWorker
from pdserve.kv_transfer.pull import PullConnectorMeta, SendSpec
p = NixlConnectorWorker(KVTransferConfig(kv_connector="nixl", kv_role="producer", lease_seconds={LEASE},
                                         heartbeat_seconds=0.5), "child-p", {COMPAT!r})
p._progress.stop()   # no thread progresses its agent either: only "progress" and "step" do
cache = torch.zeros({KV_SHAPE!r})
for b in range(cache.shape[0]):
    cache[b] = 1.0 + b
p.register_kv_caches(cache)
p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
print("@@", json.dumps({{"port": p.side_channel_port, "boot_id": p.boot_id}}), flush=True)
for line in sys.stdin:
    if line.strip() == "progress":
        p.agent.get_new_notifs()
        print("@@ 0", flush=True)
    elif line.strip() == "state":
        grant = p.holder._grants.get("p-req")
        print("@@", json.dumps(grant.state.value if grant else None), flush=True)
    else:
        sending, _ = p.get_finished()
        print("@@", json.dumps(sorted(sending)), flush=True)
"""


class ChildP:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD_P], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=dict(os.environ, **(env or {})))
        hello = self._answer()
        self.engine_id, self.side_channel_port, self.boot_id = "child-p", hello["port"], hello["boot_id"]

    def step(self, command: str = "step"):
        self.proc.stdin.write(f"{command}\n")
        self.proc.stdin.flush()
        return self._answer()

    def _answer(self):
        while not (line := self.proc.stdout.readline()).startswith("@@ "):  # (NIXL logs to stdout too)
            if not line:
                raise RuntimeError("the child P exited")
        return json.loads(line[3:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def wait_state(p: ChildP, state: str) -> str:
    deadline = time.monotonic() + 2
    while (now := p.step("state")) != state and time.monotonic() < deadline:
        time.sleep(0.005)
    return now

# UCX over TCP alone: a READ it can only emulate, which moves only as P's agent progresses (between P's
# steps); through shared memory or RDMA a READ is one-sided and done before P could die under it.
EMULATED = {"UCX_TLS": "tcp,self"}


def make_d(**config):
    """D, in this process (after the test set the environment its UCX context reads)."""
    from pdserve.config import KVTransferConfig
    from pdserve.kv_transfer.nixl import NixlConnectorWorker
    d = NixlConnectorWorker(KVTransferConfig(kv_connector="nixl", kv_role="consumer", lease_seconds=LEASE,
                                             heartbeat_seconds=0.5, **config), "d-windows", COMPAT)
    d.register_kv_caches(torch.zeros(KV_SHAPE))
    return d


def test_p_killed_while_d_reads(monkeypatch):
    """An emulated READ needs P's agent to progress; P never steps, so D's READ stays in flight until P
    dies (SIGKILL): D fails that load at once (the transfer's error), frees its blocks, and keeps
    nothing."""
    p = ChildP(env=EMULATED)
    for key, value in EMULATED.items():
        monkeypatch.setenv(key, value)
    d = make_d()
    try:
        d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [5, 6], [1, 2])]))
        poll([d], lambda s, r: d.loader.loads["d-req"].state.value == "reading" or r)
        for _ in range(100):  # 0.2 s of D's steps: the READ is really in flight
            assert not any(d.get_finished())
            time.sleep(0.002)
        assert d.loader.loads["d-req"].state.value == "reading"
        p.kill()
        start = time.monotonic()
        _, recving = poll([d], lambda s, r: "d-req" in r, timeout=BOUND)
        elapsed = time.monotonic() - start
        assert elapsed < BOUND
        error = d.get_load_error("d-req") or ""
        assert "KV load from remote engine child-p failed" in error and "transfer error" in error, error
        assert d.get_block_ids_with_load_errors() == {5, 6}
        assert d.get_stats()["kv_transfer_quarantined_total"] == 0
        poll([d], lambda s, r: not d.loader.peers, timeout=3)  # the dead P's connection goes
        assert_idle(d)
    finally:
        p.kill()
        d.shutdown()


def test_p_killed_after_d_read_before_it_acted_on_the_done():
    """D READs (P's agent progresses, for the connection's setup, but P never steps), tells P "done", and
    P dies (SIGKILL) before a step acts on it. D answers with the right KV and keeps nothing."""
    p = ChildP()
    d = make_d()
    try:
        d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [5, 6], [1, 2])]))
        poll([d], lambda s, r: p.step("progress") is None or "d-req" in r, timeout=BOUND)
        assert d.get_load_error("d-req") is None and not d.get_block_ids_with_load_errors()
        assert torch.equal(d._kv_cache[5], torch.full(KV_SHAPE[1:], 2.0))  # P's block 1
        assert torch.equal(d._kv_cache[6], torch.full(KV_SHAPE[1:], 3.0))
        assert d.get_stats()["kv_transfer_bytes_total"] == 2 * BLOCK_BYTES
        assert wait_state(p, "read") == "read"
        p.kill()
        for _ in range(50):
            assert d.get_finished() == (set(), set())
            time.sleep(0.01)
        assert_idle(d)
    finally:
        p.kill()
        d.shutdown()


def test_a_done_that_never_arrives_costs_p_one_lease():
    """D's READ is done but P never hears D's "done" (here: D's message is lost): P frees the blocks
    when the lease the claim extended runs out, counted as an expiry; D is idle at once."""
    from pdserve.config import KVTransferConfig
    from pdserve.kv_transfer.nixl import NixlConnectorWorker
    p = NixlConnectorWorker(KVTransferConfig(kv_connector="nixl", kv_role="producer", lease_seconds=LEASE,
                                             heartbeat_seconds=0.5), "p-windows", COMPAT)
    p.register_kv_caches(torch.zeros(KV_SHAPE))
    d = make_d()
    try:
        d._send_done = lambda *args: None   # lost on the way
        p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [1, 2])]))
        d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [5, 6], [1, 2])]))
        start = time.monotonic()
        poll([p, d], lambda s, r: "d-req" in r)
        assert d.get_load_error("d-req") is None
        assert_idle(d)
        assert p.num_pending_requests() == 1
        sending, _ = poll([p, d], lambda s, r: "p-req" in s, timeout=BOUND)
        assert LEASE * 0.9 < time.monotonic() - start < BOUND
        assert p.get_stats()["kv_lease_expirations_total"] == 1
        assert_idle(p, d)
    finally:
        d.shutdown()
        p.shutdown()
