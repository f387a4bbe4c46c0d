"""The tensor-parallel worker half's fan-out (kv_transfer/nixl_tp.py) against fake ranks: what one rank
did is undone when another fails."""
from __future__ import annotations

from types import SimpleNamespace

from pdserve.kv_transfer.nixl_tp import TPNixlConnectorWorker, _TPHandle
from pdserve.parallel.group import RankCallError


class FakeRanks:
    """Ranks 1 and 2: rank 1's post fails, rank 2's succeeds (read id 7)."""
    size = 3

    def __init__(self) -> None:
        self.calls = []

    def call(self, op, per_rank_args=None):
        self.calls.append((op, per_rank_args))
        if op == "kv_post":
            raise RankCallError("kv_post failed on tensor parallel rank 1: boom", [None, (7, "PROC", 1)])
        return [None, None]


class FakeLocal:
    def __init__(self) -> None:
        self.released = []

    def post(self, key, local_ids, remote_ids, op="READ", notif=""):
        return 3, "PROC", 1

    def release(self, read_id):
        self.released.append(read_id)

    def state_of(self, read_id):
        return "DONE"


def bare_worker(ranks) -> TPNixlConnectorWorker:
    """The worker half's fan-out alone (no agent, no side channel)."""
    worker = TPNixlConnectorWorker.__new__(TPNixlConnectorWorker)
    worker.ranks, worker.tp_size, worker.local = ranks, ranks.size, FakeLocal()
    return worker


def test_a_post_that_fails_on_one_rank_fails_the_load_with_the_others_reads_to_let_go():
    """Before, rank 2's READ stayed in flight (and its handle for good) while D gave the blocks back. Now
    the load ends through the lifecycle's ERR path, whose release lets go of every rank's READ."""
    ranks = FakeRanks()
    worker = bare_worker(ranks)
    load = SimpleNamespace(spec=SimpleNamespace(request_id="r", remote_request_id="p-r", local_block_ids=[1, 2],
                                                remote_block_ids=[5, 6]))
    remote = SimpleNamespace(conn=("agent", "P:boot", 3))
    handle, state = worker._post(load, remote, [(1, 5, 2)])
    assert state == "ERR" and handle.read_ids == [3, None, 7]
    worker._release(handle)   # what the lifecycle does with an ERR
    assert worker.local.released == [3]
    assert ("kv_release", [(None,), (7,)]) in ranks.calls


def test_a_released_handle_is_not_released_twice():
    ranks = FakeRanks()
    worker = bare_worker(ranks)
    handle = _TPHandle([3, 4, 5], 3)
    worker._release(handle)
    worker._release(handle)
    assert worker.local.released == [3] and [c for c in ranks.calls if c[0] == "kv_release"] == [
        ("kv_release", [(4,), (5,)])]


def test_a_remote_of_a_tensor_parallel_size_this_one_cannot_pair_with_is_refused_at_the_handshake_naming_both():
    worker = bare_worker(FakeRanks())   # three ranks here
    worker.local = SimpleNamespace(num_kv_heads=12)
    region = SimpleNamespace(block_bytes=1)
    two_ranks = {"tp_ranks": [{"agent_name": "p-rank1"}]}
    try:
        worker._check_remote_region(region, two_ranks, "prefill-engine-7")
    except RuntimeError as e:
        assert "prefill-engine-7" in str(e) and "3 (here) and 2 (remote)" in str(e)
    else:
        raise AssertionError("a 3-rank D paired with a 2-rank P")
    six_ranks = {"tp_ranks": [{}] * 5}   # 6 is a multiple of 3: each D rank reads two P ranks
    worker._check_remote_region(region, six_ranks, "prefill-engine-8")


def test_rank_0_tells_the_ranks_whether_p_holds_grants_and_once_that_it_no_longer_does(monkeypatch):
    """A P's ranks 1..T-1 progress their agents from a thread while rank 0 holds grants: each step's poll
    says so, and one more poll says when the grants are gone (before, nothing told them, and the ranks'
    agents progressed only once per P step)."""
    from pdserve.kv_transfer.nixl import NixlConnectorWorker
    monkeypatch.setattr(NixlConnectorWorker, "get_finished", lambda self: (set(), set()))
    ranks = FakeRanks()
    worker = bare_worker(ranks)
    pending = {"held": 1}
    worker._progress, worker._region, worker._ranks_holding = object(), object(), False
    worker.holder = SimpleNamespace(num_pending=lambda: pending["held"])
    worker.loader = SimpleNamespace(num_pending=lambda: 0)
    worker.get_finished()
    pending["held"] = 0
    worker.get_finished()
    worker.get_finished()
    assert [c for c in ranks.calls if c[0] == "kv_poll"] == [("kv_poll", [(True,), (True,)]),
                                                             ("kv_poll", [(False,), (False,)])]


def test_the_ranks_hear_of_p_s_first_grant_before_the_step_it_came_with(monkeypatch):
    """Grants begin in start_load_kv, before the step goes to the ranks: they are told then, not after
    that step (a READ arriving during it would have waited it out on ranks 1..T-1)."""
    from pdserve.kv_transfer.pull_worker_common import PullConnectorWorker as Common
    monkeypatch.setattr(Common, "start_load_kv", lambda self, meta: None)
    ranks = FakeRanks()
    worker = bare_worker(ranks)
    worker._progress, worker._region, worker._ranks_holding = object(), object(), False
    worker.holder = SimpleNamespace(num_pending=lambda: 1)
    worker.start_load_kv(None)
    worker.start_load_kv(None)   # told once
    assert [c for c in ranks.calls if c[0] == "kv_poll"] == [("kv_poll", [(True,), (True,)])]


def test_a_transfer_missing_a_ranks_part_is_never_done():
    """A rank whose post failed has no id, and counted as done: a push quarantined after such a failure
    (another rank's WRITE could not be aborted) was then reported written once the others were done, and D
    waited a minute for the missing rank's notification (review, session 47)."""
    worker = bare_worker(FakeRanks())
    load = SimpleNamespace(spec=SimpleNamespace(request_id="r", local_block_ids=[1, 2], remote_block_ids=[5, 6]))
    handle, state = worker._post(load, SimpleNamespace(conn=("agent", "P:boot", 3)), [(1, 5, 2)])
    worker._rank_states = [{}, {7: "DONE"}]   # rank 2's READ done, rank 0's done, rank 1's never posted
    assert state == "ERR" and worker._check(handle) == "ERR"
    fine = _TPHandle([3, 4, 5], 3)
    worker._rank_states = [{4: "DONE"}, {5: "DONE"}]
    assert worker._check(fine) == "DONE"
    worker._release(fine)
    assert worker._check(fine) == "ERR"   # let go: never done afterwards
