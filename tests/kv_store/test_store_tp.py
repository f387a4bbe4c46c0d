"""The store handoff between tensor-parallel instances of any sizes (kv_transfer/store_tp.py), through the
connector contract against a real `pdserve kv-store` and real NIXL, with the ranks in this process (the
executor's own rank-side calls, worker/tp_executor.RankCalls): each rank stores and loads its KV heads, and
what a D of one size loads equals what a P of another stored, head for head, over shared memory and over
NIXL (where a P of several ranks writes grouped parts that the store regroups at the commit)."""
from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from pdserve.config import KVTransferConfig
from pdserve.core.request import Request
from pdserve.kv_transfer.factory import create_connector
from pdserve.parallel.group import RankCallError
from pdserve.sampling_params import SamplingParams
from pdserve.worker.tp_executor import RankCalls
from tests.kv_store.test_store_handoff import (BLOCK_SIZE, assert_idle, finished_request, step_until, store,  # noqa: F401
                                               wait_for)
from tests.kv_transfer.helpers import nixl_available

if not nixl_available():
    pytest.skip("needs NIXL (nixl or nixl_cu13)", allow_module_level=True)

NUM_BLOCKS, LAYERS, HEADS, DIM = 12, 2, 4, 8
COMPAT = {"model": "store-tp-test", "dtype": "float32", "block_size": BLOCK_SIZE, "kv_shape": "4 heads"}


class InProcessRanks:
    """Ranks 1..T-1 as the executor reaches them (RankCalls.run), but in this process; fail_op: an op that
    fails on rank 1, as a rank's own failure does (RankCallError with the others' results)."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.size = len(caches)
        self.calls = [RankCalls(SimpleNamespace(kv_cache=cache)) for cache in caches[1:]]
        self.fail_op: str | None = None

    def call(self, op, per_rank_args=None):
        results, errors = [], []
        for rank, (calls, args) in enumerate(zip(self.calls, per_rank_args or [()] * (self.size - 1)), start=1):
            kind, value = ("error", "injected") if op == self.fail_op and rank == 1 else calls.run(op, args)
            results.append(value if kind == "ok" else None)
            if kind != "ok":
                errors.append(f"rank {rank}: {value}")
        if errors:
            raise RankCallError(f"{op} failed on tensor parallel {'; '.join(errors)}", results)
        return results


@pytest.fixture
def tp_instance():
    made = []

    def make(server, tp, role="both"):
        """(scheduler half, worker half, the whole model's KV cache as the instance's ranks hold it: a
        function returning it assembled from the ranks' caches, and the ranks' caches)."""
        caches = [torch.zeros(NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, HEADS // tp, DIM) for _ in range(tp)]
        config = KVTransferConfig(kv_connector="store", kv_role=role, engine_id=f"tp{tp}-{uuid.uuid4().hex[:6]}",
                                  kv_store=f"127.0.0.1:{server.port}")
        ranks = InProcessRanks(caches) if tp > 1 else None
        sched, worker = create_connector(config, BLOCK_SIZE, COMPAT, hash_extra="test", ranks=ranks,
                                         num_kv_heads=HEADS)
        worker.register_kv_caches(caches[0])
        made.append(worker)
        wait_for(lambda: (worker.get_finished(), sched.client.is_ready)[1], "the handshake")
        return SimpleNamespace(sched=sched, worker=worker, caches=caches, ranks=ranks,
                               whole=lambda: torch.cat(caches, dim=4))

    yield make
    for worker in made:
        worker.shutdown()


def fill(instance, block_ids, seed):
    """Distinct values in every head of these blocks, written into the ranks' caches."""
    whole = torch.randn(len(block_ids), LAYERS, 2, BLOCK_SIZE, HEADS, DIM, generator=torch.Generator().manual_seed(seed))
    tp = len(instance.caches)
    for r, cache in enumerate(instance.caches):
        cache[block_ids] = whole[..., r * HEADS // tp:(r + 1) * HEADS // tp, :]
    return whole


def store_and_load(server, p, d, prompt, p_blocks, d_blocks, seed):
    whole = fill(p, p_blocks, seed)
    request_id = f"p-{seed}"
    num_stored = server.index.num_stored
    p.sched.request_finished(finished_request(request_id, prompt), p_blocks)
    p.worker.start_load_kv(p.sched.build_connector_meta(None))
    step_until([p.worker], lambda s, r: request_id in s)
    wait_for(lambda: server.index.num_stored > num_stored, "the commit")
    request = Request(f"d-{seed}", prompt + [99], SamplingParams(max_tokens=2))
    d.sched.request_added(request)
    while (result := d.sched.get_num_new_matched_tokens(request, 0))[0] is None:
        d.worker.get_finished()
    assert result == (len(p_blocks) * BLOCK_SIZE, True)
    d.sched.update_state_after_alloc(request, d_blocks, result[0])
    d.worker.start_load_kv(d.sched.build_connector_meta(None))
    step_until([d.worker], lambda s, r: request.request_id in r)
    assert d.worker.get_block_ids_with_load_errors() == set() and d.worker.get_recompute_request_ids() == set()
    return whole


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (4, 1)])
def test_d_of_one_size_loads_head_for_head_what_a_p_of_another_stored(store, tp_instance, p_tp, d_tp):
    """Before, a tensor-parallel instance with the store was refused at start."""
    server = store(capacity=64 * LAYERS * 2 * BLOCK_SIZE * HEADS * DIM * 4)
    p, d = tp_instance(server, p_tp, "producer"), tp_instance(server, d_tp, "consumer")
    prompt = list(range(3 * BLOCK_SIZE + 1))
    whole = store_and_load(server, p, d, prompt, [5, 6, 2], [1, 2, 3], seed=p_tp * 10 + d_tp)
    assert torch.equal(d.whole()[[1, 2, 3]], whole)
    assert torch.count_nonzero(d.whole()[[0, 4]]) == 0   # nothing else written
    # A P of several ranks over NIXL wrote its parts grouped; the store regrouped them in place.
    assert p.worker.get_stats()["kv_transfer_bytes_total"] == 3 * LAYERS * 2 * BLOCK_SIZE * HEADS * DIM * 4
    assert d.worker.get_stats()["kv_store_loaded_blocks_total"] == 3
    assert_idle(server, p.worker, d.worker)


def test_a_rank_whose_read_fails_to_post_fails_the_load_and_the_request_recomputes(store, tp_instance):
    server = store()
    p, d = tp_instance(server, 1, "producer"), tp_instance(server, 2, "consumer")
    fill(p, [1, 2], seed=1)
    p.sched.request_finished(finished_request("p", list(range(2 * BLOCK_SIZE))), [1, 2])
    p.worker.start_load_kv(p.sched.build_connector_meta(None))
    step_until([p.worker], lambda s, r: "p" in s)
    wait_for(lambda: server.index.num_stored == 2, "the commit")
    d.ranks.fail_op = "kv_store_copy" if d.worker._mapped is not None else "kv_post"
    request = Request("d", list(range(2 * BLOCK_SIZE)) + [7], SamplingParams(max_tokens=2))
    d.sched.request_added(request)
    while (result := d.sched.get_num_new_matched_tokens(request, 0))[0] is None:
        d.worker.get_finished()
    d.sched.update_state_after_alloc(request, [4, 5], result[0])
    d.worker.start_load_kv(d.sched.build_connector_meta(None))
    step_until([d.worker], lambda s, r: "d" in r)
    assert d.worker.get_block_ids_with_load_errors() == {4, 5} and d.worker.get_recompute_request_ids() == {"d"}
    d.ranks.fail_op = None
    assert_idle(server, p.worker, d.worker)


@pytest.mark.parametrize("regroup", [{"parts": 3, "outer": 7}, {"parts": 1, "outer": 1}, {"parts": "2"}, [2, 16],
                                     {"parts": True, "outer": 16}])
def test_a_commit_with_a_regroup_that_does_not_cut_the_block_is_refused_and_commits_nothing(store, tp_instance,
                                                                                           regroup):
    server = store()
    tp_instance(server, 2)   # (fixes the store's layout)
    with server._lock:
        assert server.index.begin_insert("i", [11, 12], 60.0) == [(0, 0), (1, 1)]
    with pytest.raises(ValueError, match="regroup"):
        server._on_end_insert({"type": "commit", "boot_id": server.boot_id, "insert_id": "i", "regroup": regroup}, b"")
    assert server.index.num_stored == 0 and "i" in server.index.inserts


def stored_prompt_for(server, p, prompt, blocks):
    fill(p, blocks, seed=1)
    p.sched.request_finished(finished_request("p", prompt), blocks)
    p.worker.start_load_kv(p.sched.build_connector_meta(None))
    step_until([p.worker], lambda s, r: "p" in s)
    wait_for(lambda: server.index.num_stored == len(blocks), "the commit")


def start_load(d, prompt, blocks):
    request = Request("d", prompt + [7], SamplingParams(max_tokens=2))
    d.sched.request_added(request)
    while (result := d.sched.get_num_new_matched_tokens(request, 0))[0] is None:
        d.worker.get_finished()
    d.sched.update_state_after_alloc(request, blocks, result[0])
    d.worker.start_load_kv(d.sched.build_connector_meta(None))


@pytest.mark.parametrize("store", [False], indirect=True, ids=["nixl"])
def test_a_read_no_rank_can_let_go_keeps_its_blocks_until_it_can(store, tp_instance, monkeypatch):
    """Before, a READ past its deadline that NIXL could not abort was kept one step, then its blocks went back
    to the pool while rank 0's READ could still land in them (the handle said ERR once a release was tried;
    hostile review). Now they stay until every part is let go."""
    server = store()
    p, d = tp_instance(server, 1, "producer"), tp_instance(server, 2, "consumer")
    prompt = list(range(2 * BLOCK_SIZE))
    stored_prompt_for(server, p, prompt, [1, 2])
    start_load(d, prompt, [4, 5])
    release = d.worker.local.release
    monkeypatch.setattr(d.worker.local, "state_of", lambda read_id: "PROC")   # a READ that hangs ...
    monkeypatch.setattr(d.worker.local, "release", lambda read_id: (_ for _ in ()).throw(RuntimeError("busy")))
    load = d.worker._loads["d"]
    load.spec = dataclasses.replace(load.spec, read_deadline=time.monotonic() - 1)   # ... past its deadline
    for _ in range(3):
        assert d.worker.get_finished() == (set(), set())
        assert "d" in d.worker._loads and d.worker.num_blocks_held() == 2
    monkeypatch.setattr(d.worker.local, "release", release)   # NIXL lets it go now
    assert d.worker.get_finished() == (set(), {"d"})
    assert d.worker.get_block_ids_with_load_errors() == {4, 5}
    monkeypatch.undo()
    assert_idle(server, p.worker, d.worker)


@pytest.mark.parametrize("store", [False], indirect=True, ids=["nixl"])
def test_a_read_that_failed_to_post_on_one_rank_ends_once_the_others_parts_have(store, tp_instance, monkeypatch):
    server = store()
    p, d = tp_instance(server, 1, "producer"), tp_instance(server, 2, "consumer")
    prompt = list(range(2 * BLOCK_SIZE))
    stored_prompt_for(server, p, prompt, [1, 2])
    state_of = d.worker.local.state_of
    monkeypatch.setattr(d.worker.local, "state_of", lambda read_id: "PROC")   # rank 0's part still moving
    d.ranks.fail_op = "kv_post"
    start_load(d, prompt, [4, 5])
    d.ranks.fail_op = None
    for _ in range(3):
        assert d.worker.get_finished() == (set(), set()) and "d" in d.worker._loads
    monkeypatch.setattr(d.worker.local, "state_of", state_of)
    _, recving = step_until([d.worker], lambda s, r: "d" in r)
    assert d.worker.get_block_ids_with_load_errors() == {4, 5} and d.worker.get_recompute_request_ids() == {"d"}
    assert_idle(server, p.worker, d.worker)


def test_the_store_regroups_outside_its_lock_and_the_insert_stays_its_own_meanwhile(store, tp_instance, monkeypatch):
    """Before, the regroup ran under the store's lock: a 2 GiB insert stalled every client 0.4 s (hostile
    review). Now other messages are answered meanwhile, and the insert can neither expire nor be aborted."""
    from pdserve.kv_store import server as server_module
    server = store(capacity=16 * LAYERS * 2 * BLOCK_SIZE * HEADS * DIM * 4)
    tp_instance(server, 2)
    with server._lock:
        server.index.begin_insert("i", [11, 12], 60.0)
    entered, go = threading.Event(), threading.Event()
    real = server_module.regroup_run

    def slow_regroup(*args):
        entered.set()
        assert go.wait(10)
        real(*args)
    monkeypatch.setattr(server_module, "regroup_run", slow_regroup)
    commit = {"type": "commit", "boot_id": server.boot_id, "insert_id": "i", "regroup": {"parts": 2, "outer": 16}}
    thread = threading.Thread(target=lambda: server._on_end_insert(commit, b""))
    thread.start()
    assert entered.wait(10)
    assert server._on_ping({"boot_id": server.boot_id}, b"")[0] == {"ok": True}   # the lock is free
    abort = {"type": "abort", "boot_id": server.boot_id, "insert_id": "i"}
    assert server._on_end_insert(abort, b"")[0]["ok"] is False
    server.index.clock = lambda: time.monotonic() + 3600
    with server._lock:
        server.index.expire()
    assert "i" in server.index.inserts
    go.set()
    thread.join(10)
    assert server.index.num_stored == 2 and not server._committing


@pytest.mark.parametrize("store", [True], indirect=True, ids=["shared-memory"])
def test_a_rank_that_cannot_map_the_pool_leaves_every_rank_on_nixl(store, tp_instance, monkeypatch):
    """All or none: rank 0 mapped the pool, rank 1 could not (its call failed), so rank 0 lets its mapping go
    and the whole instance moves KV over NIXL, and still loads what another instance stored."""
    from pdserve.kv_transfer import store_tp
    server = store()
    p = tp_instance(server, 1, "producer")
    real_init = store_tp.TPStoreConnectorWorker.__init__

    def failing_attach(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.ranks.fail_op = "kv_store_attach"
    monkeypatch.setattr(store_tp.TPStoreConnectorWorker, "__init__", failing_attach)
    d = tp_instance(server, 2, "consumer")
    assert d.worker._mapped is None and d.worker._key is not None and not d.worker._ranks_mapped
    assert all(calls.transport.store_pool is None for calls in d.ranks.calls)
    d.ranks.fail_op = None
    prompt = list(range(2 * BLOCK_SIZE))
    stored_prompt_for(server, p, prompt, [1, 2])
    start_load(d, prompt, [4, 5])
    step_until([d.worker], lambda s, r: "d" in r)
    assert d.worker.get_block_ids_with_load_errors() == set()
    assert torch.equal(d.whole()[[4, 5]], p.whole()[[1, 2]])
    assert_idle(server, p.worker, d.worker)


def test_a_regroup_that_fails_gives_the_insert_back_to_its_deadline(store, tp_instance, monkeypatch):
    """The way out of the regroup: the insert is neither committed nor held for good (it expires at its
    deadline as any), and a later commit of it is not refused as 'being committed'."""
    from pdserve.kv_store import server as server_module
    server = store(capacity=16 * LAYERS * 2 * BLOCK_SIZE * HEADS * DIM * 4)
    tp_instance(server, 2)
    with server._lock:
        server.index.begin_insert("i", [11, 12], 60.0)
    deadline = server.index.inserts["i"].deadline
    monkeypatch.setattr(server_module, "regroup_run", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    commit = {"type": "commit", "boot_id": server.boot_id, "insert_id": "i", "regroup": {"parts": 2, "outer": 16}}
    with pytest.raises(RuntimeError):
        server._on_end_insert(commit, b"")
    assert server.index.inserts["i"].deadline == deadline and not server._committing and server.index.num_stored == 0
    monkeypatch.undo()
    assert server._on_end_insert(commit, b"")[0] == {"ok": True, "num_blocks": 2}
