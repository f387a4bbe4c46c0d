"""The store handoff through the connector contract, against a real `pdserve kv-store` server and real NIXL
(DRAM → DRAM over UCX): P inserts, D looks up and READs; and each way out of a failed load (a lease that
ran out, a store that restarted or is down, an insert that never lands) ends in a recompute, never in
wrong KV. Every test ends with both workers idle."""
from __future__ import annotations

import os
import re
import threading
import time
import uuid

import pytest
import torch

from pdserve.config import KVTransferConfig
from pdserve.core.request import Request, RequestStatus
from pdserve.kv_transfer.factory import create_connector
from pdserve.kv_transfer.store import StoreInsertSpec
from pdserve.kv_transfer.store_client import RPC_TIMEOUT_S
from pdserve.sampling_params import SamplingParams
from tests.kv_transfer.helpers import nixl_available

if not nixl_available():
    pytest.skip("needs NIXL (nixl or nixl_cu13)", allow_module_level=True)

from pdserve.kv_store.server import KVStoreServer  # noqa: E402
from pdserve.kv_transfer import store_shm, store_worker  # noqa: E402
from pdserve.kv_transfer.store_shm import SharedPool  # noqa: E402

BLOCK_SIZE = 4
NUM_BLOCKS = 16
COMPAT = {"model": "store-test", "dtype": "float32", "block_size": BLOCK_SIZE}
KV_SHAPE = (NUM_BLOCKS, 2, 2, BLOCK_SIZE, 1, 8)   # [blocks, layers, kv, slots, heads, dim]: 512-byte blocks
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 8 * 4


@pytest.fixture(params=[True, False], ids=["shared-memory", "nixl"])
def store(request):
    """Every test runs twice: clients on the store's host map its pool and copy, or (--no-shared-memory)
    move KV over NIXL."""
    servers = []

    def make(**kwargs):
        kwargs.setdefault("shared_memory", request.param)
        server = KVStoreServer("127.0.0.1", 0, kwargs.pop("capacity", 64 * BLOCK_BYTES), **kwargs)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def instance():
    made = []

    def make(server, role="both", **extra):
        config = KVTransferConfig(kv_connector="store", kv_role=role, engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
                                  kv_store=f"127.0.0.1:{server.port}", extra=extra)
        sched, worker = create_connector(config, BLOCK_SIZE, COMPAT, hash_extra="test")
        kv = torch.zeros(KV_SHAPE)
        worker.register_kv_caches(kv)
        made.append(worker)
        wait_for(lambda: (worker.get_finished(), sched.client.is_ready)[1], "the handshake")
        return sched, worker, kv

    yield make
    for worker in made:
        worker.shutdown()


def wait_for(cond, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what}")


def step_until(workers, until, timeout=10.0):
    """Step the workers as engines do (start_load_kv is the caller's) until until(sending, recving)."""
    sending, recving = set(), set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w in workers:
            s, r = w.get_finished()
            sending |= s
            recving |= r
        if until(sending, recving):
            return sending, recving
        time.sleep(0.002)
    raise AssertionError(f"timed out; sending={sending} recving={recving}")


def finished_request(request_id, prompt, **params):
    request = Request(request_id, prompt, SamplingParams(max_tokens=1), kv_transfer_params=params or None)
    request.num_computed_tokens = len(prompt)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return request


def insert(p_sched, p_worker, request, block_ids, kv):
    for b in block_ids:
        kv[b].fill_(float(b + 1))
    delay_free, params = p_sched.request_finished(request, block_ids)
    p_worker.start_load_kv(p_sched.build_connector_meta(None))
    return delay_free, params


def store_prompt(server, sched, worker, kv, request_id, prompt, block_ids):
    """An instance finishes a request and its insert lands in the store."""
    num_stored = server.index.num_stored
    insert(sched, worker, finished_request(request_id, prompt), block_ids, kv)
    step_until([worker], lambda s, r: request_id in s)
    wait_for(lambda: server.index.num_stored > num_stored, "the commit")


def lookup(sched, worker, request, num_computed=0, timeout=10.0):
    """request_added, then get_num_new_matched_tokens until it knows (the scheduler asks every step)."""
    sched.request_added(request)
    deadline = time.monotonic() + timeout
    while True:
        num, is_async = sched.get_num_new_matched_tokens(request, num_computed)
        if num is not None:
            return num, is_async
        assert time.monotonic() < deadline, "the lookup never answered"
        worker.get_finished()
        time.sleep(0.002)


def assert_idle(server, *workers):
    for w in workers:
        w._advance_handshake()   # (a check of the mapped pool may be due: an engine steps for it)
        assert w.num_pending_requests() == 0
        assert w.num_blocks_held() == 0
    wait_for(lambda: not server.index.leases and not server.index.inserts, "the store's leases to go")
    with server._lock:   # the server's threads change the index under it: read it whole, not mid-update
        server.index.check()


def test_p_inserts_and_d_loads_through_the_contract(store, instance):
    server = store()
    p_sched, p_worker, p_kv = instance(server, "producer")
    d_sched, d_worker, d_kv = instance(server, "consumer")
    prompt = list(range(13))                                  # 3 full blocks and a partial one
    p_req = finished_request("p-req", prompt, do_remote_decode=True)
    delay_free, params = insert(p_sched, p_worker, p_req, [3, 4, 9, 10], p_kv)
    assert delay_free and params["do_remote_prefill"] and params["num_remote_tokens"] == 12
    # D gets P's answer before P's insert has landed: its lookup waits for the 3 blocks.
    d_req = Request("d-req", prompt, SamplingParams(max_tokens=4), kv_transfer_params=params)
    sending = set()
    d_sched.request_added(d_req)
    while (result := d_sched.get_num_new_matched_tokens(d_req, 0))[0] is None:
        sending |= p_worker.get_finished()[0]
        d_worker.get_finished()
        time.sleep(0.002)
    assert result == (12, True)
    d_blocks = [0, 1, 2, 7]
    d_sched.update_state_after_alloc(d_req, d_blocks, 12)
    d_worker.start_load_kv(d_sched.build_connector_meta(None))
    sending, _ = step_until([p_worker, d_worker], lambda s, r: "d-req" in r and ("p-req" in s or "p-req" in sending))
    assert d_worker.get_block_ids_with_load_errors() == set() and d_worker.get_recompute_request_ids() == set()
    for local, remote in zip(d_blocks[:3], [3, 4, 9]):
        assert torch.equal(d_kv[local], p_kv[remote])
    assert torch.count_nonzero(d_kv[7]) == 0                 # the partial block is D's to compute
    assert d_worker.get_stats()["kv_transfer_descriptors_total"] == 1   # d 0,1,2 ← slots 0,1,2: one run
    assert_idle(server, p_worker, d_worker)


def test_a_second_insert_of_a_stored_prefix_writes_only_the_new_blocks(store, instance):
    server = store()
    sched, worker, kv = instance(server)
    store_prompt(server, sched, worker, kv, "a", list(range(8)), [1, 2])
    store_prompt(server, sched, worker, kv, "b", list(range(16)), [5, 6, 7, 8])
    assert worker.get_stats()["kv_store_inserted_blocks_total"] == 4
    assert_idle(server, worker)


def test_any_instance_loads_what_another_stored(store, instance):
    """Multi-turn reuse: a plain request (no kv_transfer_params) on a second instance finds the first's
    prompt, past its own local prefix-cache hit of one block."""
    server = store()
    a_sched, a_worker, a_kv = instance(server)
    b_sched, b_worker, b_kv = instance(server)
    store_prompt(server, a_sched, a_worker, a_kv, "turn-1", list(range(12)), [4, 5, 6])
    turn2 = Request("turn-2", list(range(12)) + [50, 51, 52, 53, 54], SamplingParams(max_tokens=2))
    assert lookup(b_sched, b_worker, turn2, num_computed=4) == (8, True)
    turn2.num_computed_tokens = 4
    b_sched.update_state_after_alloc(turn2, [0, 8, 9, 10, 11], 8)
    b_worker.start_load_kv(b_sched.build_connector_meta(None))
    step_until([b_worker], lambda s, r: "turn-2" in r)
    assert torch.equal(b_kv[8], a_kv[5]) and torch.equal(b_kv[9], a_kv[6])
    assert b_worker.get_block_ids_with_load_errors() == set()
    assert_idle(server, a_worker, b_worker)


def test_a_lease_that_ran_out_before_the_read_recomputes(store, instance):
    """The store may give a lapsed lease's slots to another insert: the reader must not READ them."""
    server = store(lease_s=2.5)
    sched, worker, kv = instance(server)
    store_prompt(server, sched, worker, kv, "a", list(range(8)), [1, 2])
    request = Request("r", list(range(8)) + [9], SamplingParams(max_tokens=2))
    assert lookup(sched, worker, request) == (8, True)
    time.sleep(1.6)          # past the client's read deadline (lease 2.5 s minus a 1 s margin)
    sched.update_state_after_alloc(request, [6, 7, 8], 8)
    worker.start_load_kv(sched.build_connector_meta(None))
    step_until([worker], lambda s, r: "r" in r)
    assert worker.get_block_ids_with_load_errors() == {6, 7}
    assert worker.get_recompute_request_ids() == {"r"}
    assert torch.count_nonzero(kv[6]) == 0
    assert_idle(server, worker)


def test_a_restarted_store_is_a_miss_and_the_client_connects_again(store, instance):
    server = store()
    sched, worker, kv = instance(server)
    store_prompt(server, sched, worker, kv, "a", list(range(8)), [1, 2])
    port = server.port
    server.close()
    restarted = KVStoreServer("127.0.0.1", port, 64 * BLOCK_BYTES, shared_memory=server.shared_memory)
    try:
        request = Request("r", list(range(8)) + [9], SamplingParams(max_tokens=2))
        assert lookup(sched, worker, request) == (0, False)          # the old boot's lookup is refused
        wait_for(lambda: (worker.get_finished(), sched.client.boot_id == restarted.boot_id)[1],
                 "a handshake with the new boot", timeout=15)
        insert(sched, worker, finished_request("b", list(range(8))), [1, 2], kv)
        step_until([worker], lambda s, r: "b" in s)
        wait_for(lambda: restarted.index.num_stored == 2, "the commit to the new boot")
        assert torch.equal(restarted._buffer[:2 * BLOCK_BYTES].view(torch.float32).view(2, *KV_SHAPE[1:]),
                           kv[1:3])   # written into the new boot's pool, not the old one's
        assert worker.get_stats()["kv_store_shared_memory"] == int(server.shared_memory)
        assert len(pool_inodes()) == int(server.shared_memory)   # the old boot's pool let go
        assert_idle(restarted, worker)
    finally:
        restarted.close()


def test_a_store_that_is_down_costs_nothing_but_the_hit(store, instance):
    server = store()
    sched, worker, kv = instance(server)
    server.close()
    request = finished_request("a", list(range(8)))
    delay_free, _ = insert(sched, worker, request, [1, 2], kv)
    sending, _ = step_until([worker], lambda s, r: "a" in s)    # P's blocks go free, nothing stored
    plain = Request("r", list(range(9)), SamplingParams(max_tokens=2))
    assert lookup(sched, worker, plain) == (0, False)
    assert (worker._loads, worker._inserts, worker.num_blocks_held()) == ({}, {}, 0)   # (an idle engine still
                                                                                   # steps to try the store again)


def test_d_waits_for_an_insert_that_never_comes_only_until_its_deadline(store, instance):
    """P answered the router but its insert never reached the store (P died): D computes the prompt itself
    after store_wait_seconds, and holds no block meanwhile (the request waits before allocation)."""
    server = store()
    d_sched, d_worker, _ = instance(server, "consumer", store_wait_seconds=1.0)
    params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "p-req",
              "remote_host": "127.0.0.1", "remote_port": server.port, "num_remote_tokens": 12}
    request = Request("d-req", list(range(13)), SamplingParams(max_tokens=2), kv_transfer_params=params)
    start = time.monotonic()
    assert lookup(d_sched, d_worker, request) == (0, False)
    assert 0.9 < time.monotonic() - start < 5.0
    assert_idle(server, d_worker)


def test_a_request_that_ends_before_its_load_releases_the_lease(store, instance):
    server = store()
    sched, worker, kv = instance(server)
    store_prompt(server, sched, worker, kv, "a", list(range(8)), [1, 2])
    request = Request("r", list(range(9)), SamplingParams(max_tokens=2))
    assert lookup(sched, worker, request) == (8, True)
    assert len(server.index.leases) == 1
    request.status = RequestStatus.FINISHED_ABORTED
    sched.request_finished(request, [])
    assert_idle(server, worker)


def test_a_client_of_another_layout_is_refused_naming_both(store, instance):
    server = store()
    instance(server)
    from pdserve.kv_transfer import side_channel
    reply, _ = side_channel.request("127.0.0.1", server.port, {
        "type": "handshake", "compat_hash": "other", "compat": {**COMPAT, "dtype": "bfloat16"},
        "block_bytes": BLOCK_BYTES})
    assert not reply["ok"] and "dtype store=float32 client=bfloat16" in reply["error"]


def test_d_stops_waiting_at_once_when_p_could_not_store_the_prompt(store, instance):
    """A full store (every slot pinned) cuts P's insert short: D's lookup answers with what is there at
    once instead of waiting store_wait_seconds for blocks that will not come."""
    server = store(capacity=2 * BLOCK_BYTES)
    p_sched, p_worker, p_kv = instance(server, "producer")
    d_sched, d_worker, _ = instance(server, "consumer", store_wait_seconds=8.0)
    store_prompt(server, p_sched, p_worker, p_kv, "a", [90] * 8, [1, 2])
    holder = Request("holder", [90] * 9, SamplingParams(max_tokens=2))
    assert lookup(d_sched, d_worker, holder) == (8, True)             # pins both slots
    _, params = insert(p_sched, p_worker, finished_request("p-req", list(range(12)), do_remote_decode=True),
                       [4, 5, 6], p_kv)
    step_until([p_worker], lambda s, r: "p-req" in s)
    request = Request("d-req", list(range(13)), SamplingParams(max_tokens=2), kv_transfer_params=params)
    start = time.monotonic()
    assert lookup(d_sched, d_worker, request) == (0, False)
    assert time.monotonic() - start < 2.0
    holder.status = RequestStatus.FINISHED_ABORTED
    d_sched.request_finished(holder, [])
    assert_idle(server, p_worker, d_worker)


def test_a_lookup_queued_past_its_lease_is_looked_up_again(store, instance):
    """The bug: a request that queued longer than the lease (2,000 at once) allocated blocks for a lapsed
    lease, parked, failed its READ at once and recomputed; it now asks the store again."""
    server = store(lease_s=2.5)
    sched, worker, kv = instance(server)
    store_prompt(server, sched, worker, kv, "a", list(range(8)), [1, 2])
    request = Request("r", list(range(8)) + [9], SamplingParams(max_tokens=2))
    assert lookup(sched, worker, request) == (8, True)
    time.sleep(1.6)          # past the client's read deadline (lease 2.5 s minus a 1 s margin)
    deadline = time.monotonic() + 5
    while (answer := sched.get_num_new_matched_tokens(request, 0)) == (None, False):
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert answer == (8, True)
    sched.update_state_after_alloc(request, [6, 7, 8], 8)
    worker.start_load_kv(sched.build_connector_meta(None))
    step_until([worker], lambda s, r: "r" in r)
    assert worker.get_block_ids_with_load_errors() == set() and torch.equal(kv[6], kv[1])
    assert_idle(server, worker)


def test_a_store_that_stops_answering_costs_one_timeout_not_one_per_request(store, instance):
    """The bug: with a store that accepts and never answers, each lookup held a worker for the whole RPC
    timeout and each request waited for its own: 40 requests had p50 19.9 s. Now a request gives up on its
    lookup after a grace period, and after one timeout the client rests before it asks again."""
    import socket
    server = store()
    sched, worker, kv = instance(server)
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    try:
        sched.client.address = ("127.0.0.1", hung.getsockname()[1])
        first = Request("a", list(range(9)), SamplingParams(max_tokens=2))
        start = time.monotonic()
        assert lookup(sched, worker, first) == (0, False)
        assert time.monotonic() - start < 4.0
        wait_for(lambda: not sched.client.is_usable, "the client to rest after the timeout")
        second = Request("b", list(range(9)), SamplingParams(max_tokens=2))
        start = time.monotonic()
        assert lookup(sched, worker, second) == (0, False)
        assert time.monotonic() - start < 0.5          # no lookup at all while resting
        # An insert already on its way when the store hung: P's blocks come back after one exchange's
        # timeout, not never (the insert is then aborted at the store by name, in the background).
        worker._start_insert(StoreInsertSpec("p-req", [11, 12], [1, 2]))
        assert worker.num_blocks_held() == 2
        step_until([worker], lambda s, r: "p-req" in s, timeout=RPC_TIMEOUT_S + 3)
        assert worker.num_blocks_held() == 0 and worker.num_pending_requests() == 0
    finally:
        hung.close()
        sched.client.address = ("127.0.0.1", server.port)


def test_malformed_store_messages_are_answered_with_an_error_and_hold_nothing(store, instance):
    from pdserve.kv_transfer import side_channel
    server = store()
    sched, _, _ = instance(server)
    boot = server.boot_id
    bad = [{"type": "lookup", "boot_id": boot, "lease_id": "x", "hashes": [1], "min_blocks": 1,
            "wait_s": float("nan")},     # used to spin a server thread forever
           {"type": "lookup", "boot_id": boot, "lease_id": "y", "hashes": [1], "wait_s": float("inf")},
           {"type": "lookup", "boot_id": boot, "hashes": [1]},                     # no lease id
           {"type": "insert", "boot_id": boot, "insert_id": 7, "hashes": [1]},
           {"type": "insert", "boot_id": boot, "insert_id": "i", "hashes": [True]},
           {"type": ["lookup"]}]
    for message in bad:
        start = time.monotonic()
        reply, _ = side_channel.request("127.0.0.1", server.port, message)
        assert not reply["ok"] and reply["error"], message
        assert time.monotonic() - start < 1.0, message
    assert not server.index.leases and not server.index.inserts


def test_a_pool_device_this_process_cannot_use_is_refused_naming_it():
    import pdserve.kv_store.server as server_module
    if server_module.torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    for device, words in (("cuda", "sees 0 GPU(s)"), ("cuda:3", "sees 0 GPU(s)"), ("disk", "cpu, cuda or cuda:N")):
        with pytest.raises(ValueError, match=re.escape(words)):
            KVStoreServer("127.0.0.1", 0, 64 * BLOCK_BYTES, pool_device=device)


def test_a_first_handshake_with_absurd_block_bytes_is_refused():
    """The bug: the first client fixes the layout, and block_bytes 1 on a 1 GiB pool made a billion-slot
    index (40 GB). Such a pool is refused and the layout stays open for a real client."""
    from pdserve.kv_transfer import side_channel
    server = KVStoreServer("127.0.0.1", 0, 1 << 30)
    try:
        reply, _ = side_channel.request("127.0.0.1", server.port, {
            "type": "handshake", "compat_hash": "x", "block_bytes": 1})
        assert not reply["ok"] and "holds 1073741824 blocks" in reply["error"]
        reply, _ = side_channel.request("127.0.0.1", server.port, {
            "type": "handshake", "compat_hash": "y", "block_bytes": BLOCK_BYTES})
        assert reply["ok"]
    finally:
        server.close()


# ---- the pool in shared memory (kv_transfer/store_shm.py) ---------------------------------------------


def load_stored_prompt(server, instance):
    """One instance stores a prompt of 2 blocks, another loads it; (the loader's stats, its KV, the storer's)."""
    a_sched, a_worker, a_kv = instance(server)
    b_sched, b_worker, b_kv = instance(server)
    store_prompt(server, a_sched, a_worker, a_kv, "a", list(range(8)), [1, 2])
    request = Request("r", list(range(8)) + [9], SamplingParams(max_tokens=2))
    assert lookup(b_sched, b_worker, request) == (8, True)
    b_sched.update_state_after_alloc(request, [5, 6, 7], 8)
    b_worker.start_load_kv(b_sched.build_connector_meta(None))
    step_until([b_worker], lambda s, r: "r" in r)
    assert b_worker.get_block_ids_with_load_errors() == set()
    assert torch.equal(b_kv[5:7], a_kv[1:3])
    assert_idle(server, a_worker, b_worker)
    return b_worker.get_stats(), a_worker.get_stats()


def test_a_client_on_the_stores_host_maps_the_pool_and_copies(store, instance):
    server = store()
    loader, storer = load_stored_prompt(server, instance)
    assert loader["kv_store_shared_memory"] == storer["kv_store_shared_memory"] == int(server.shared_memory)
    assert loader["kv_store_loaded_blocks_total"] == 2 and storer["kv_store_inserted_blocks_total"] == 2


def pool_inodes() -> set[str]:
    """The inodes of the store pools this process maps (the tests' stores run in it too)."""
    with open("/proc/self/maps") as f:
        return {line.split()[4] for line in f if "memfd:pdserve-kv-store" in line}


@pytest.mark.parametrize("offer", ["a regular file", "a link that does not resolve", "another store's pool",
                                   "another host"])
def test_a_pool_the_client_cannot_map_leaves_it_on_nixl(store, instance, monkeypatch, tmp_path, offer):
    """What the store offers is checked before anything opens it: a path that is not a /proc/<pid>/fd/<fd>
    link to the store's memory file, a link that does not resolve, a pool whose header names another
    store (a reused pid or fd), another host's boot id."""
    server = store()
    if not server.shared_memory:
        pytest.skip("about a pool in shared memory")
    describe = SharedPool.describe
    others = []

    def offered(pool):
        description = describe(pool)
        if offer == "another host":
            return {**description, "host": "another-boot-id"}
        if offer == "a link that does not resolve":
            return {**description, "path": f"/proc/{os.getpid()}/fd/999999"}
        if offer == "a regular file":
            impostor = tmp_path / "impostor"
            impostor.write_bytes(b"\0" * description["bytes"])
            return {**description, "path": str(impostor)}
        other = SharedPool(description["bytes"] - 4096, "another-store-boot")
        others.append(other)
        return {**description, "path": describe(other)["path"]}

    monkeypatch.setattr(SharedPool, "describe", offered)
    try:
        loader, storer = load_stored_prompt(server, instance)
    finally:
        for other in others:
            other.close()
    assert loader["kv_store_shared_memory"] == storer["kv_store_shared_memory"] == 0


def test_no_one_can_resize_the_pool_under_its_mappings(store, instance):
    """A file that shrank under a mapping makes every access past its end a SIGBUS: the pool is sealed."""
    server = store()
    if not server.shared_memory:
        pytest.skip("about a pool in shared memory")
    instance(server)
    fd = os.open(server._shared.describe()["path"], os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1 << 30)
    finally:
        os.close(fd)


def test_an_idle_client_notices_a_dead_store(store, instance, monkeypatch):
    """An idle client hears no stale_boot: before, it kept the dead store's pool mapped (and pinned, on a
    GPU) until some exchange failed, and a store started again doubled the host's memory; over NIXL it
    reported itself connected (kv_store_connected 1) to a dead store until a request came."""
    monkeypatch.setattr(store_worker, "PING_S", 0.5)
    server = store()
    sched, worker, kv = instance(server)
    assert worker.get_stats()["kv_store_shared_memory"] == int(server.shared_memory)
    assert bool(pool_inodes()) == server.shared_memory
    handshook_at, deadline = sched.client.last_answer_at, time.monotonic() + 1.2
    while time.monotonic() < deadline:   # alive: the store answers, and the client stays connected
        worker.get_finished()
        time.sleep(0.01)
    assert sched.client.is_ready
    assert (sched.client.last_answer_at > handshook_at) != server.shared_memory   # (pinged only over NIXL)
    server.close()
    wait_for(lambda: (idle_engine_step(worker), worker.get_stats()["kv_store_connected"]
                      + worker.get_stats()["kv_store_shared_memory"] == 0)[1], "the client to forget the store",
             timeout=5)
    assert not pool_inodes()
    restarted = KVStoreServer("127.0.0.1", server.port, 64 * BLOCK_BYTES, shared_memory=server.shared_memory)
    try:   # ... and an idle engine connects again, without a request to make it step
        wait_for(lambda: (idle_engine_step(worker), sched.client.boot_id == restarted.boot_id)[1],
                 "a handshake with the new boot", timeout=10)
        assert worker.get_stats()["kv_store_shared_memory"] == int(server.shared_memory)
    finally:
        restarted.close()


def idle_engine_step(worker) -> None:
    """What an idle engine does: it steps (and so polls the connector) only while the connector says it
    has pending work (engine_core.has_work)."""
    if worker.num_pending_requests() > 0:
        worker.get_finished()


def test_an_idle_client_finds_a_restarted_store(store, instance, monkeypatch):
    monkeypatch.setattr(store_worker, "PING_S", 0.3)
    server = store()
    sched, worker, kv = instance(server)
    port, old_boot = server.port, sched.client.boot_id
    server.close()
    restarted = KVStoreServer("127.0.0.1", port, 64 * BLOCK_BYTES, shared_memory=server.shared_memory)
    try:
        wait_for(lambda: (idle_engine_step(worker), sched.client.boot_id == restarted.boot_id)[1],
                 "a handshake with the new boot", timeout=10)
        assert old_boot != restarted.boot_id and worker.get_stats()["kv_store_connected"] == 1
    finally:
        restarted.close()


def test_a_ping_in_flight_does_not_make_an_idle_engine_spin(store, instance, monkeypatch):
    import socket
    monkeypatch.setattr(store_worker, "PING_S", 0.2)
    server = store()
    if server.shared_memory:
        pytest.skip("about pings (over NIXL)")
    sched, worker, kv = instance(server)
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    try:
        sched.client.address = ("127.0.0.1", hung.getsockname()[1])
        wait_for(lambda: (worker.get_finished(), worker._ping is not None)[1], "a ping", timeout=3)
        assert worker.num_pending_requests() == 0   # on its way: nothing to step for until it ends
        wait_for(lambda: (idle_engine_step(worker), not sched.client.is_ready)[1], "the unanswered ping to end",
                 timeout=RPC_TIMEOUT_S + 3)
        # ... nor the handshake that follows, with a store that does not answer it either
        wait_for(lambda: (idle_engine_step(worker), worker._handshake is not None)[1], "a handshake", timeout=5)
        assert worker.num_pending_requests() == 0
    finally:
        hung.close()
        sched.client.address = ("127.0.0.1", server.port)


def test_a_store_with_other_ucx_tcp_segments_is_refused_naming_both_unless_mapped(store, instance, monkeypatch):
    """UCX fails every transfer between agents of different TCP segment sizes: a client that would move
    KV over NIXL refuses such a store at the handshake; one that maps the pool does not need UCX."""
    import pdserve.kv_store.server as server_module
    monkeypatch.setattr(server_module, "ucx_tcp_segments", lambda: "64k/64k")
    server = store()
    config = KVTransferConfig(kv_connector="store", kv_role="both", engine_id="segments",
                              kv_store=f"127.0.0.1:{server.port}")
    sched, worker = create_connector(config, BLOCK_SIZE, COMPAT, hash_extra="test")
    try:
        worker.register_kv_caches(torch.zeros(KV_SHAPE))
        wait_for(lambda: (worker.get_finished(), worker._handshake is None)[1], "the handshake's end")
        assert sched.client.is_ready == server.shared_memory
        assert (worker._store is not None) == server.shared_memory
    finally:
        worker.shutdown()


def test_a_pool_mapped_while_the_instance_shuts_down_is_let_go(store, monkeypatch):
    """The handshake maps the pool on the store client's thread: a mapping that ends after shutdown began
    has no one to take it, and was left mapped (and pinned, on a GPU)."""
    server = store()
    if not server.shared_memory:
        pytest.skip("about a pool in shared memory")
    import pdserve.kv_transfer.store_worker as store_worker
    may_map, mapping, made = threading.Event(), threading.Event(), []

    def slow_attach(*args):
        mapping.set()
        may_map.wait(10)
        made.append(store_shm.attach(*args))
        return made[-1]
    monkeypatch.setattr(store_worker, "attach", slow_attach)
    config = KVTransferConfig(kv_connector="store", kv_role="both", engine_id="closing",
                              kv_store=f"127.0.0.1:{server.port}")
    sched, worker = create_connector(config, BLOCK_SIZE, COMPAT, hash_extra="test")
    worker.register_kv_caches(torch.zeros(KV_SHAPE))
    assert mapping.wait(10)            # the handshake answered; the pool is being mapped
    worker.shutdown()
    may_map.set()
    wait_for(lambda: made and made[0] is not None and made[0]._map.closed, "the late mapping to be let go")
