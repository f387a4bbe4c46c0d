"""CudaIpcConnectorWorker: the pull handoff by mapping P's KV cache into D (CUDA IPC; shm on CPU).

Runs on CPU CI: P and D in one process share the tensor directly, P in a child process shares a
CPU cache through POSIX shared memory, and the same tests run on a GPU (CUDA IPC for the child
case) when one is there. A copy has no transport notification, so P learns that D is done from a
"done" message over the side channel: every test that waits for finished_sending tests that too.
"""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from pdserve.config import KVTransferConfig
from pdserve.core.request import Request, RequestStatus
from pdserve.kv_transfer.cuda_ipc import CudaIpcConnectorWorker, export_kv_cache, import_kv_cache
from pdserve.kv_transfer.factory import create_connector
from pdserve.kv_transfer.pull import PullConnectorMeta, RecvSpec, SendSpec
from pdserve.sampling_params import SamplingParams

from tests.core.helpers import assert_no_leaks, fake_token, make_scheduler
from tests.kv_transfer.helpers import (BLOCK_BYTES, COMPAT, KV_SHAPE, NUM_BLOCKS, assert_idle, poll, recv_spec,
                                       worker_factory)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA IPC needs a GPU"))]


@pytest.fixture
def make_worker():
    yield from worker_factory("cuda_ipc")


def test_export_moves_cpu_cache_into_shared_memory_keeping_its_content():
    kv_cache = torch.arange(torch.Size(KV_SHAPE).numel(), dtype=torch.float32).reshape(KV_SHAPE)
    expected = kv_cache.clone()
    ipc = export_kv_cache(kv_cache)
    assert ipc["kind"] == "shm" and ipc["num_bytes"] == NUM_BLOCKS * BLOCK_BYTES
    assert torch.equal(kv_cache, expected)
    mapped = import_kv_cache(ipc, torch.device("cpu"))  # a second mapping of the same file
    assert torch.equal(mapped, kv_cache.view(torch.uint8).view(-1))
    kv_cache[3] = -1.0
    assert torch.equal(mapped.view(NUM_BLOCKS, BLOCK_BYTES)[3], kv_cache[3].view(torch.uint8).view(-1))


def test_many_requests_one_step_are_done_in_one_message(make_worker):
    p_cache = torch.rand(KV_SHAPE)
    p = make_worker("producer", p_cache)
    d_cache = torch.zeros(KV_SHAPE)
    d = make_worker("consumer", d_cache)
    sends = [SendSpec(f"p{i}", [2 * i, 2 * i + 1]) for i in range(8)]
    p.start_load_kv(PullConnectorMeta(reqs_to_send=sends))
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[
        recv_spec(f"d{i}", p, [16 + 2 * i, 17 + 2 * i], [2 * i, 2 * i + 1], f"p{i}") for i in range(8)]))
    sending, recving = poll([p, d], lambda s, r: len(s) == 8 and len(r) == 8)
    assert sorted(sending) == sorted(s.request_id for s in sends)
    assert torch.equal(d_cache[16:32], p_cache[0:16])
    assert d.get_stats()["kv_transfer_descriptors_total"] == 8  # one run per request
    assert_idle(p, d)


def test_done_travels_as_a_datagram_not_through_side_channel_threads(make_worker):
    p = make_worker("producer")
    d = make_worker("consumer")
    side_channel_messages = []
    send_done = d.loader.send_done
    d.loader.send_done = lambda *args: (side_channel_messages.append("done"), send_done(*args))
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [4, 5])]))
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [1, 2], [4, 5])]))
    poll([p, d], lambda s, r: "p-req" in s and "d-req" in r)
    assert "done" not in side_channel_messages
    assert_idle(p, d)


def test_done_falls_back_to_the_side_channel_without_datagrams(make_worker):
    p = CudaIpcConnectorWorker(KVTransferConfig(kv_connector="cuda_ipc", kv_role="producer"), "p-tcp", COMPAT)
    p._notify_name = None  # as where abstract Unix sockets do not exist: D must use the side channel
    p.register_kv_caches(torch.rand(KV_SHAPE))
    d = make_worker("consumer")
    try:
        p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [4, 5])]))
        d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [1, 2], [4, 5])]))
        sending, recving = poll([p, d], lambda s, r: "p-req" in s and "d-req" in r)
        assert sending == ["p-req"] and p.get_stats()["kv_lease_expirations_total"] == 0
        assert_idle(p, d)
    finally:
        p.shutdown()


@pytest.mark.parametrize("option", ["cuda_ipc_map_on", "cuda_ipc_copy"])
def test_bad_option_names_the_field(option):
    with pytest.raises(ValueError, match=option):
        CudaIpcConnectorWorker(KVTransferConfig(kv_connector="cuda_ipc", extra={option: "gpu0"}), "x", COMPAT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [{"cuda_ipc_copy": "torch"}, {"cuda_ipc_map_on": "owner"}])
def test_other_copy_paths_are_byte_exact(make_worker, device, options):
    p_cache = torch.rand(KV_SHAPE, device=device)
    p = make_worker("producer", p_cache)
    d_cache = torch.zeros(KV_SHAPE, device=device)
    d = make_worker("consumer", d_cache, extra=options)
    local, remote = [3, 4, 5, 9, 0], [10, 11, 12, 2, 7]
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", remote)]))
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, local, remote)]))
    poll([p, d], lambda s, r: "p-req" in s and "d-req" in r)
    assert torch.equal(d_cache[local], p_cache[remote])
    assert_idle(p, d)


def test_cancel_unknown_and_posted_requests_report_once(make_worker):
    p = make_worker("producer")
    d = make_worker("consumer")
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-warm", [0]), SendSpec("p-req", [3, 4])]))
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("warm", p, [0], [0], "p-warm")]))
    poll([p, d], lambda s, r: "warm" in r)  # handshake done: the next load claims at once
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [1, 2], [3, 4])]))
    assert d.loader.loads["d-req"].state.value == "claiming"  # (a DRAM copy, once posted, is done at once)
    d.start_load_kv(PullConnectorMeta(reqs_to_cancel={"d-req", "never-seen"}))
    sending, recving = poll([p, d], lambda s, r: {"d-req", "never-seen"} <= set(r) and "p-req" in s)
    deadline = time.monotonic() + 0.2  # long enough for a duplicate report to show up
    _, later = poll([p, d], lambda s, r: time.monotonic() > deadline)
    assert sorted(recving + later) == ["d-req", "never-seen"] and "p-req" in sending  # released
    assert d.get_stats()["kv_transfer_bytes_total"] == BLOCK_BYTES  # only "warm" was read
    assert_idle(p, d)


def test_compat_mismatch_fails_request_and_releases_p(make_worker):
    p = make_worker("producer")
    d = make_worker("consumer", compat={**COMPAT, "block_size": 8})
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [5, 6])]))
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [1, 2], [5, 6])]))
    sending, recving = poll([p, d], lambda s, r: "d-req" in r and "p-req" in s)
    assert recving == ["d-req"] and sending == ["p-req"]
    assert d.get_block_ids_with_load_errors() == {1, 2}
    assert d.get_load_error("d-req") == (
        f"KV layout mismatch with remote engine {p.engine_id}: block_size local=8 remote=4")
    assert_idle(p, d)


def test_reading_from_a_consumer_fails_request_naming_it(make_worker, monkeypatch):
    not_p = make_worker("consumer")
    monkeypatch.setattr("os.getpid", lambda: -1)  # as if not_p lived in another process
    d = make_worker("consumer")
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", not_p, [1], [2])]))
    poll([d], lambda s, r: "d-req" in r)
    assert d.get_load_error("d-req") == (f"remote engine {not_p.engine_id} exports no KV cache (not a producer)")
    assert d.get_block_ids_with_load_errors() == {1}


def test_out_of_range_block_fails_request(make_worker):
    p = make_worker("producer")
    d = make_worker("consumer")
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [5, NUM_BLOCKS])]))
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec("d-req", p, [1, 2], [5, NUM_BLOCKS])]))
    _, recving = poll([p, d], lambda s, r: "d-req" in r and "p-req" in s)
    assert d.get_block_ids_with_load_errors() == {1, 2}
    assert "remote block id out of range" in d.get_load_error("d-req")
    assert_idle(p, d)


# ---- P in another process: the real IPC path -----------------------------------------------------

def _producer_process(device: str, conn) -> None:
    """Child: a P worker holding blocks 10..13 of an arange cache until D says done."""
    kv_cache = torch.arange(torch.Size(KV_SHAPE).numel(), dtype=torch.float32, device=device).reshape(KV_SHAPE)
    config = KVTransferConfig(kv_connector="cuda_ipc", kv_role="producer")
    p = CudaIpcConnectorWorker(config, "p-child", COMPAT)
    p.register_kv_caches(kv_cache)
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [10, 11, 12, 13])]))
    conn.send((p.side_channel_port, p.boot_id))
    deadline = time.monotonic() + 20
    sending: set[str] = set()
    while "p-req" not in sending and time.monotonic() < deadline:
        sending |= p.get_finished()[0]
        time.sleep(0.001)
    conn.send(sorted(sending))
    conn.recv()  # D has unmapped our cache: safe to free it
    p.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_read_from_another_process(make_worker, device):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer_process, args=(device, child), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "producer did not start"
        port, boot_id = parent.recv()
        d_cache = torch.zeros(KV_SHAPE, device=device)
        d = make_worker("consumer", d_cache)
        spec = RecvSpec("d-req", [0, 1, 5, 6], [10, 11, 12, 13], "p-child", "p-req", "127.0.0.1", port, boot_id)
        d.start_load_kv(PullConnectorMeta(reqs_to_recv=[spec]))
        poll([d], lambda s, r: "d-req" in r, timeout=20)
        assert d.get_load_error("d-req") is None
        expected = torch.arange(torch.Size(KV_SHAPE).numel(), dtype=torch.float32).reshape(KV_SHAPE)
        assert torch.equal(d_cache[[0, 1, 5, 6]].cpu(), expected[10:14])
        assert d.get_stats()["kv_transfer_descriptors_total"] == 2
        assert parent.poll(20) and parent.recv() == ["p-req"]  # P's lease ended by D's done
        d.shutdown()
        assert_idle(d)
        parent.send("bye")
        # not proc.join(): torch's shm manager, a grandchild, holds the child's sentinel pipe open
        deadline = time.monotonic() + 20
        while proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


# ---- the whole lifecycle: P and D schedulers over the connector, with a tensor KV cache -------------

class TensorRunner:
    """The runner's part in a handoff: writes each computed position's fake KV into its block slot and
    drives the connector's worker half like the real runner (start_load_kv → compute → get_finished)."""

    def __init__(self, scheduler, worker, num_blocks, block_size):
        self.scheduler, self.worker, self.block_size = scheduler, worker, block_size
        self.kv_cache = torch.zeros(num_blocks, 1, 2, block_size, 1, 1)  # [blocks, layers, k/v, slots, heads, dim]
        worker.register_kv_caches(self.kv_cache)

    def execute(self, out):
        from pdserve.core.batch import KVConnectorOutput, ModelRunnerOutput
        if out.connector_meta is not None:
            self.worker.start_load_kv(out.connector_meta)
        sampled = {}
        for item in out.scheduled:
            for pos in range(item.num_computed_tokens, item.num_computed_tokens + len(item.token_ids)):
                block = item.block_ids[pos // self.block_size]
                self.kv_cache[block, 0, :, pos % self.block_size] = float(pos + 1)
            if item.do_sample:
                sampled[item.request_id] = fake_token(item.num_computed_tokens + len(item.token_ids) - 1)
        sending, recving = self.worker.get_finished()
        return ModelRunnerOutput(sampled, KVConnectorOutput(sending, recving,
                                                            self.worker.get_block_ids_with_load_errors()))

    def step(self):
        out = self.scheduler.schedule()
        return self.scheduler.update_from_output(out, self.execute(out))


def test_pd_lifecycle_over_cuda_ipc_moves_p_kv_into_d_blocks():
    block_size, prompt = 4, list(range(100, 113))  # 13 tokens: 4 blocks
    instances = []
    for role in ("producer", "consumer"):
        config = KVTransferConfig(kv_connector="cuda_ipc", kv_role=role, engine_id=f"{role}-lifecycle")
        conn_s, conn_w = create_connector(config, block_size, COMPAT)
        scheduler = make_scheduler(num_blocks=16, block_size=block_size, connector=conn_s)
        instances.append(TensorRunner(scheduler, conn_w, 16, block_size))
    p, d = instances
    try:
        p.scheduler.add_request(Request("req", prompt, SamplingParams(max_tokens=1),
                                        kv_transfer_params={"do_remote_decode": True}))
        params = None
        while params is None:
            params = next((u.kv_transfer_params for u in p.step() if u.finished), None)
        p_blocks = list(params["remote_block_ids"])
        p_kv = p.kv_cache[p_blocks].clone()
        d.scheduler.add_request(Request("req", prompt, SamplingParams(max_tokens=5), kv_transfer_params=params))
        tokens, d_blocks, deadline = [], None, time.monotonic() + 10
        while (p.scheduler.has_unfinished() or d.scheduler.has_unfinished()) and time.monotonic() < deadline:
            if d_blocks is None and d.scheduler.kv.get_block_ids("req"):
                d_blocks = d.scheduler.kv.get_block_ids("req")[:len(p_blocks)]
            for u in d.step():
                tokens += u.new_token_ids
                assert u.request.status != RequestStatus.FINISHED_ERROR, u.request.error
            p.step()
            time.sleep(0.001)
        assert tokens == [fake_token(len(prompt) - 1 + i) for i in range(5)]
        # every prompt slot holds P's KV (D then wrote its decoded positions after them)
        def prompt_kv(kv):  # [blocks, layers, k/v, slots, ...] → [positions, layers, k/v, ...]
            return kv.transpose(1, 3).flatten(0, 1)[:len(prompt)]
        assert torch.equal(prompt_kv(d.kv_cache[d_blocks]), prompt_kv(p_kv))
        assert prompt_kv(p_kv)[:, 0, 0].flatten().tolist() == [float(pos + 1) for pos in range(len(prompt))]
        assert d.worker.get_stats()["kv_transfer_bytes_total"] == len(p_blocks) * p.kv_cache[0].numel() * 4
        assert p.worker.get_stats()["kv_lease_expirations_total"] == 0
        assert_no_leaks(p.scheduler)
        assert_no_leaks(d.scheduler)
        assert_idle(p.worker, d.worker)
    finally:
        p.worker.shutdown()
        d.worker.shutdown()
