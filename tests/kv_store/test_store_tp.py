"""The store handoff between tensor-parallel instances of any sizes (kv_transfer/store_tp.py), through the
connector contract against a real `pdserve kv-store` and real NIXL, with the ranks in this process (the
executor's own rank-side calls, worker/tp_executor.RankCalls): each rank stores and loads its KV heads, and
what a D of one size loads equals what a P of another stored, head for head, over shared memory and over
NIXL (where a P of several ranks writes grouped parts that the store regroups at the commit)."""
from __future__ import annotations

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
