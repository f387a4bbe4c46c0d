"""The push handoff between tensor-parallel instances (kv_transfer/nixl_tp_push.py) over real NIXL (UCX,
CPU DRAM), in one process: rank 0's worker halves, and ranks 1..T-1 served by the ranks' own call handlers
(worker/tp_executor.RankCalls) in this process instead of over their pipes."""
from __future__ import annotations

import types
import uuid

import pytest
import torch

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.push import PushConnectorMeta, PushRecvSpec, PushSendSpec
from pdserve.kv_transfer.push_lifecycle import write_notif
from pdserve.parallel.group import RankCallError
from tests.kv_transfer.helpers import COMPAT, nixl_available, poll

if not nixl_available():
    pytest.skip("needs NIXL (nixl or nixl_cu13)", allow_module_level=True)

from pdserve.kv_transfer import nixl_tp_push  # noqa: E402
from pdserve.kv_transfer.nixl_tp_push import TPNixlPushConnectorWorker  # noqa: E402
from pdserve.worker.tp_executor import RankCalls  # noqa: E402

NUM_KV_HEADS = 4
RANK_SHAPE = (16, 2, 2, 4, 2, 8)   # [blocks, layers, kv, slots, heads per rank (of 4, over 2 ranks), dim]
ONE_RANK_SHAPE = (16, 2, 2, 4, 4, 8)


class InProcessRanks:
    """Ranks 1..T-1 as RankCalls in this process: the executor's call() contract (results in rank order,
    RankCallError naming the ranks that failed)."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.size = 1 + len(caches)
        self.servers = [RankCalls(types.SimpleNamespace(kv_cache=cache)) for cache in caches]
        self.fail_post = False

    def call(self, op, per_rank_args=None):
        results, errors = [], []
        for rank, (server, args) in enumerate(zip(self.servers, per_rank_args or [()] * len(self.servers)), 1):
            kind, value = ("error", "injected") if op == "kv_post" and self.fail_post else server.run(op, args)
            if kind == "error":
                errors.append(f"rank {rank}: {value}")
            results.append(value if kind != "error" else None)
        if errors:
            raise RankCallError(f"{op} failed on tensor parallel {'; '.join(errors)}", results)
        return results


@pytest.fixture
def make_tp():
    made = []

    def make(role: str, caches: list[torch.Tensor], **config_fields):
        config = KVTransferConfig(kv_connector="nixl-push", kv_role=role, **config_fields)
        ranks = InProcessRanks(caches[1:])
        worker = TPNixlPushConnectorWorker(config, f"{role}-{uuid.uuid4().hex[:8]}", COMPAT, ranks, NUM_KV_HEADS)
        worker.register_kv_caches(caches[0])
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.shutdown()


def filled(seed: int) -> torch.Tensor:
    return torch.randn(RANK_SHAPE, generator=torch.Generator().manual_seed(seed))


def recv_spec(p, transfer_id="t1", local=(3, 4, 5), first=0, request_id="d-req"):
    return PushRecvSpec(request_id, transfer_id, list(local), first, p.engine_id, "127.0.0.1",
                        p.side_channel_port, p.boot_id)


def assert_idle(*workers):
    for worker in workers:
        assert worker.num_pending_requests() == 0 and worker.get_stats()["num_blocks_held_for_transfer"] == 0
        assert worker._notified == {}
        assert worker.local._reads == {} and all(s.transport._reads == {} for s in worker.ranks.servers)


def test_every_p_rank_writes_its_heads_into_the_d_rank_holding_them(make_tp):
    p_caches, d_caches = [filled(0), filled(1)], [torch.zeros(RANK_SHAPE), torch.zeros(RANK_SHAPE)]
    p, d = make_tp("producer", p_caches), make_tp("consumer", d_caches)
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=[7, 8, 12], first=1)]))
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [10, 11, 12, 13], (4242,))]))
    tokens = {}
    poll([p, d], lambda s, r: tokens.update(d.get_first_token_ids()) or ("p-req" in s and "d-req" in r))
    assert tokens == {"d-req": [4242]}   # P's first token, in every rank's notification
    for rank in (0, 1):
        assert torch.equal(d_caches[rank][[7, 8, 12]], p_caches[rank][[11, 12, 13]]), rank
    assert torch.count_nonzero(d_caches[1][[0, 1, 2, 9, 10]]) == 0
    assert d.get_load_error("d-req") is None and not d.get_block_ids_with_load_errors()
    stats = p.get_stats()
    assert stats["kv_transfer_bytes_total"] == 2 * 3 * p_caches[0][0].numel() * 4   # both ranks' heads
    assert stats["kv_transfer_descriptors_total"] == 2 * 2                          # [11,12]→[7,8], 13→12
    assert_idle(p, d)


def n(transfer_id, rank, tp_size=2):
    return write_notif(transfer_id, (), rank, tp_size)


def test_d_waits_for_every_ranks_notification(make_tp, monkeypatch):
    """Rank 0's notification alone does not end the receive: rank 1's data may not have landed yet."""
    from pdserve.kv_transfer.nixl import NixlTransport
    d = make_tp("consumer", [torch.zeros(RANK_SHAPE), torch.zeros(RANK_SHAPE)])
    rank0 = [[], [], [n("t1", 0)], []]
    monkeypatch.setattr(NixlTransport, "_take_notifs", lambda self: rank0.pop(0))
    d._rank_notifs = [[n("t1", 1), n("t2", 1)]]
    assert d._take_notifs() == []                       # rank 1's only, so far
    d._rank_notifs = [[n("t1", 1)]]
    assert d._take_notifs() == []                       # a repeat from the same rank counts once
    assert [notif.transfer_id for notif in d._take_notifs()] == ["t1"]   # rank 0's: every rank's is in
    assert set(d._notified) == {"t2"}
    d._notified["t2"].first_at -= nixl_tp_push.NOTIF_TTL_S + 1   # one whose other notification never comes ...
    assert d._take_notifs() == [] and d._notified == {}   # ... is dropped after NOTIF_TTL_S


def test_a_write_that_fails_on_one_rank_fails_the_push_and_frees_both_sides(make_tp):
    p_caches = [filled(2), filled(3)]
    p, d = make_tp("producer", p_caches), make_tp("consumer", [torch.zeros(RANK_SHAPE), torch.zeros(RANK_SHAPE)])
    p.ranks.fail_post = True
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=[4, 5])]))
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2])]))
    poll([p, d], lambda s, r: "p-req" in s and "d-req" in r, timeout=10)
    assert d.get_load_error("d-req") is not None and d.get_block_ids_with_load_errors() == {4, 5}
    assert all(e.pairs == {(0, 0)} for e in d._notified.values())   # rank 0's, if it came: never done
    d._notified.clear()   # (its count waits out NOTIF_TTL_S, not this test)
    assert_idle(p, d)


def test_sizes_of_which_neither_divides_the_other_are_refused_naming_both(make_tp):
    p = make_tp("producer", [filled(4), filled(5)])
    with pytest.raises(RuntimeError, match="tensor parallel sizes 2 \\(here\\) and 3 \\(remote\\): one must divide"):
        p._check_remote_region(p._region, {"tp_ranks": [{}, {}]}, "d-three")
    p._check_remote_region(p._region, {"tp_ranks": []}, "d-one")   # 2 and 1: pushed between sizes


D_BLOCKS, P_BLOCKS = [7, 8, 12], [11, 12, 13]   # two runs on D: (7, 8) and 12


def push_between(make_tp, p_caches, d_caches, **p_config):
    p, d = make_tp("producer", p_caches, **p_config), make_tp("consumer", d_caches)
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=D_BLOCKS, first=1)]))
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [10] + P_BLOCKS, (31,))]))
    tokens = {}
    poll([p, d], lambda s, r: tokens.update(d.get_first_token_ids()) or ("p-req" in s and "d-req" in r))
    assert tokens == {"d-req": [31]} and d.get_load_error("d-req") is None
    return p, d


def test_a_p_of_two_ranks_pushes_into_a_d_of_one(make_tp):
    """Each P rank writes its heads whole into its half of each run of D's blocks (one descriptor per run);
    D puts every head back in its place once both ranks' WRITEs are in."""
    p_caches, d_cache = [filled(6), filled(7)], torch.zeros(ONE_RANK_SHAPE)
    p, d = push_between(make_tp, p_caches, [d_cache])
    for rank in (0, 1):
        assert torch.equal(d_cache[D_BLOCKS][..., 2 * rank:2 * rank + 2, :], p_caches[rank][P_BLOCKS]), rank
    untouched = [b for b in range(16) if b not in D_BLOCKS]
    assert torch.count_nonzero(d_cache[untouched]) == 0
    stats = p.get_stats()
    assert stats["kv_transfer_descriptors_total"] == 2 * 2   # per rank: [11, 12] -> run (7, 8), 13 -> 12
    assert stats["kv_transfer_bytes_total"] == 3 * d_cache[0].numel() * 4
    assert_idle(p, d)


def test_a_p_of_one_rank_pushes_into_a_d_of_two(make_tp):
    """P stages each D rank's heads of the blocks and writes them into that rank's blocks as they stand."""
    p_cache = torch.randn(ONE_RANK_SHAPE, generator=torch.Generator().manual_seed(8))
    d_caches = [torch.zeros(RANK_SHAPE), torch.zeros(RANK_SHAPE)]
    p, d = push_between(make_tp, [p_cache], d_caches)
    for rank in (0, 1):
        assert torch.equal(d_caches[rank][D_BLOCKS], p_cache[P_BLOCKS][..., 2 * rank:2 * rank + 2, :]), rank
        assert torch.count_nonzero(d_caches[rank][[b for b in range(16) if b not in D_BLOCKS]]) == 0
    stats = p.get_stats()
    assert stats["kv_transfer_descriptors_total"] == 2 * 2   # per D rank: the two runs
    assert stats["kv_transfer_bytes_total"] == 3 * p_cache[0].numel() * 4
    assert p.local._reads == {}   # the staging went with the WRITE
    assert_idle(p, d)


def test_a_regroup_that_fails_fails_the_load_and_frees_both_sides(make_tp, monkeypatch):
    p_caches, d_cache = [filled(9), filled(10)], torch.zeros(ONE_RANK_SHAPE)
    p, d = make_tp("producer", p_caches), make_tp("consumer", [d_cache])

    def broken(block_ids, k):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(d.local, "regroup", broken)
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=[4, 5])]))
    p.start_load_kv(PushConnectorMeta(reqs_to_send=[PushSendSpec("p-req", "t1", [1, 2], (3,))]))
    tokens = {}
    poll([p, d], lambda s, r: tokens.update(d.get_first_token_ids()) or ("p-req" in s and "d-req" in r))
    assert d.get_load_error("d-req") is not None and d.get_block_ids_with_load_errors() == {4, 5}
    assert tokens == {"d-req": [3]}   # (P's token came ahead of the KV, as a pull D's does: then the error)
    assert_idle(p, d)


def test_ranks_notifications_survive_a_step_whose_own_poll_failed(make_tp, monkeypatch):
    """Rank 0's agent raised while taking its notifications: what ranks 1..T-1 had brought in that step was
    overwritten by the next poll, and the push could never count as done (review, session 47)."""
    from pdserve.kv_transfer.nixl import NixlTransport
    d = make_tp("consumer", [torch.zeros(RANK_SHAPE), torch.zeros(RANK_SHAPE)])
    calls = []

    def rank0(self):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("NIXL binding error")
        return [n("t1", 0)] if len(calls) == 2 else []
    monkeypatch.setattr(NixlTransport, "_take_notifs", rank0)
    monkeypatch.setattr(d.receiver, "num_pending", lambda: 1)   # (a push under way: the ranks are polled)
    d.ranks.servers[0].transport.poll_writes = lambda: ({}, [n("t1", 1)] if not calls else [])
    with pytest.raises(RuntimeError):
        d.get_finished()
    d.get_finished()   # the ranks bring nothing new; rank 0's "t1" comes: every rank's is in
    assert d._notified == {}


@pytest.mark.parametrize("p_size,d_size", [(4, 2), (2, 4), (4, 1), (1, 4), (4, 4)])
def test_every_head_lands_in_its_place_between_these_sizes(make_tp, p_size, d_size):
    """Ranks 1..T-1 on both sides (their kv_regroup, and P ranks past the first group) and the head offsets."""
    shape = lambda size: (16, 2, 2, 4, NUM_KV_HEADS // size, 8)  # noqa: E731
    p_caches = [torch.randn(shape(p_size), generator=torch.Generator().manual_seed(20 + r)) for r in range(p_size)]
    d_caches = [torch.zeros(shape(d_size)) for _ in range(d_size)]
    p, d = push_between(make_tp, p_caches, d_caches)
    whole_p = torch.cat([c[P_BLOCKS] for c in p_caches], dim=4)   # every head, in order
    whole_d = torch.cat([c[D_BLOCKS] for c in d_caches], dim=4)
    assert torch.equal(whole_d, whole_p)
    assert_idle(p, d)


@pytest.mark.parametrize("p_size", [1, 2])
def test_a_push_into_more_ranks_moves_in_rounds_through_a_small_staging_pool(make_tp, monkeypatch, p_size):
    """P's ranks stage each D rank's heads; with room for one block of the whole model's KV on P's ranks (set in
    P's config, rank 0's and ranks 1..T-1's), the three blocks go in rounds of 1 (a P of one rank) or 2 (a P
    rank of two, whose blocks hold half the heads), the notification with the last."""
    shape = lambda size: (16, 2, 2, 4, NUM_KV_HEADS // size, 8)  # noqa: E731
    whole_block = 2 * 2 * 4 * NUM_KV_HEADS * 8 * 4   # the least staging_bytes an instance starts with
    rounds = []
    from pdserve.kv_transfer import nixl_tp
    real = nixl_tp.post_transfer
    monkeypatch.setattr(nixl_tp, "post_transfer", lambda *a: rounds.append(sum(n for _, _, n in a[5])) or real(*a))
    p_caches = [torch.randn(shape(p_size), generator=torch.Generator().manual_seed(40 + r)) for r in range(p_size)]
    d_caches = [torch.zeros(shape(4)) for _ in range(4)]
    p, d = push_between(make_tp, p_caches, d_caches, staging_bytes=whole_block)
    assert [server.transport.staging_bytes for server in p.ranks.servers] == [whole_block] * (p_size - 1)
    per_p_rank = [1] * 3 * 4 if p_size == 1 else [2, 2, 1, 1]   # blocks per WRITE: one per D rank it covers
    assert sorted(rounds) == sorted(per_p_rank * p_size)
    whole_p = torch.cat([c[P_BLOCKS] for c in p_caches], dim=4)
    whole_d = torch.cat([c[D_BLOCKS] for c in d_caches], dim=4)
    assert torch.equal(whole_d, whole_p)
    assert_idle(p, d)
    stats = p.get_stats()   # (on /metrics: the pool's occupancy, nothing held once the push is done)
    assert (stats["kv_staging_bytes_in_use"], stats["kv_staging_transfers_waiting"]) == (0, 0)


def test_a_staging_pool_too_small_is_refused_by_rank_0_before_the_ranks_register(make_tp):
    """Ranks 1..T-1 refused it first, and the user read a RankCallError with a traceback (code review)."""
    with pytest.raises(ValueError, match=r"staging_bytes \(1024\) must hold a block of the model's whole KV"):
        make_tp("producer", [filled(50), filled(51)], staging_bytes=1024)


def test_grouped_layout_and_regroup_undo_each_other_over_runs_and_cuts():
    """Three P ranks' parts written where grouped_layout puts them, then D's regroup: every head in its place,
    over short runs and one longer than MAX_GROUP_BLOCKS (cut, so that D's buffer stays bounded)."""
    from pdserve.kv_transfer import nixl_tp, tp_layout
    k, heads, num_blocks = 3, 6, 2 * tp_layout.MAX_GROUP_BLOCKS + 20
    cache = torch.zeros((num_blocks, 2, 2, 4, heads, 8))
    want = torch.randn(cache.shape)
    block_ids = [3, 4, 5, 9] + list(range(12, 12 + tp_layout.MAX_GROUP_BLOCKS + 5))
    fine = cache.view(-1).view(num_blocks * k, 2, 2, 4, heads // k, 8)   # D's cache in blocks of P's size
    for part in range(k):
        fine[tp_layout.grouped_layout(block_ids, k, part)] = want[block_ids][..., part * 2:(part + 1) * 2, :]
    reader = nixl_tp.RankReader.__new__(nixl_tp.RankReader)
    reader.kv_cache = cache
    reader.regroup(block_ids, k)
    assert torch.equal(cache[block_ids], want[block_ids])
    assert torch.count_nonzero(cache[[b for b in range(num_blocks) if b not in block_ids]]) == 0
    assert tp_layout.runs_of([1, 2, 3, 4, 5, 9], max_len=2) == [(1, 2), (3, 2), (5, 1), (9, 1)]
    assert len(tp_layout.runs_of(block_ids)) == 4   # (3..5), (9), and the long run cut in two


def test_a_notification_whose_sizes_cannot_pair_does_not_end_the_receive(make_tp):
    """It was passed on, and the Receiver ended the receive on it alone, while other ranks' WRITEs could
    still land in the blocks (code review, session 48)."""
    p = make_tp("producer", [filled(11), filled(12)])
    d = make_tp("consumer", [torch.zeros(RANK_SHAPE), torch.zeros(RANK_SHAPE)])
    d.start_load_kv(PushConnectorMeta(reqs_to_recv=[recv_spec(p, local=[4, 5])]))
    d.local.agent.get_new_notifs = lambda: {"p": [write_notif("t1", (7,), 0, 3).encode()]}
    assert d.get_finished() == (set(), set()) and d.get_first_token_ids() == {}
    assert d._notified == {} and "d-req" in d.receiver.recvs
