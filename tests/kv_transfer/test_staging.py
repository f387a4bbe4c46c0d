"""The staging pool (kv_transfer/staging.py) and the staged transfers that take rounds through it
(nixl_tp.RankReader): ranks of different tensor-parallel sizes over real NIXL (UCX, CPU DRAM)."""
from __future__ import annotations

import time
import uuid

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pdserve.kv_transfer import nixl_tp
from pdserve.kv_transfer.staging import ALIGN, StagingPool

from tests.kv_transfer.helpers import nixl_available

HEADS = 4
NUM_BLOCKS = 12


def rank_shape(tp: int) -> tuple[int, ...]:
    return (NUM_BLOCKS, 2, 2, 4, HEADS // tp, 8)   # [blocks, layers, k/v, slots, heads, dim], fp32


UNIT = 2 * 2 * 4 * HEADS * 8 * 4   # staging bytes of one block for a one-rank D of a two-rank P: 2,048


class FakeAgent:
    def register_memory(self, tensor):
        return object()

    def deregister_memory(self, reg):
        pass


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5), st.integers(1, 9)), max_size=40))
def test_ranges_never_overlap_and_all_come_back(ops):
    """Any sequence of takes and give-backs: ranges inside the buffer, aligned, disjoint; all given back →
    the whole buffer free as one range."""
    pool = StagingPool(FakeAgent(), 10 * ALIGN + 100, torch.device("cpu"))
    held: list[tuple[int, int]] = []
    for i, (give, unit_aligns, want) in enumerate(ops):
        if give and held:
            start, size = held.pop(i % len(held))
            pool.give_back(start, size)
            continue
        unit = unit_aligns * ALIGN - 7   # (not a multiple of the alignment)
        who = object()
        taken = pool.take(who, unit, want)
        if taken is None:
            pool.leave(who)
            continue
        start, units = taken
        assert 1 <= units <= want and start % ALIGN == 0 and start + units * unit <= pool.num_bytes
        for other_start, other_size in held:
            assert start + units * unit <= other_start or other_start + other_size <= start
        held.append((start, units * unit))
    for start, size in held:
        pool.give_back(start, size)
    assert pool._free == [(0, pool.num_bytes)] and pool.bytes_free() == 10 * ALIGN


def test_askers_are_served_in_line():
    pool = StagingPool(FakeAgent(), 4 * ALIGN, torch.device("cpu"))
    first, second, third = object(), object(), object()
    a = pool.take(first, ALIGN, 3)
    assert a == (0, 3)
    assert pool.take(second, 2 * ALIGN, 1) is None   # (one unit of 2 does not fit the one free)
    assert pool.take(third, ALIGN, 1) is None        # it would fit, but the second asked first
    pool.give_back(0, 3 * ALIGN)
    assert pool.take(third, ALIGN, 1) is None        # still the second's turn
    assert pool.take(second, 2 * ALIGN, 1) == (0, 1)
    assert pool.take(third, ALIGN, 1) == (2 * ALIGN, 1)


# ---- staged transfers over NIXL ----------------------------------------------------------------------

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="needs NIXL (nixl or nixl_cu13)")


@pytest.fixture
def readers():
    made = []

    def make(rank: int, tp: int, cache: torch.Tensor, staging_bytes: int = 1 << 20) -> nixl_tp.RankReader:
        reader = nixl_tp.RankReader.create(f"staging-{uuid.uuid4().hex[:8]}", False, rank, tp, HEADS,
                                           staging_bytes=staging_bytes)
        made.append(reader)
        reader.entry = reader.register(cache)
        return reader

    yield make
    for reader in reversed(made):
        reader.deregister()


def filled(seed: int, tp: int) -> torch.Tensor:
    return torch.randn(rank_shape(tp), generator=torch.Generator().manual_seed(seed))


def wait(readers, read_ids: dict, reader, timeout: float = 5.0) -> dict:
    """Polls every reader (both agents progressed, as two engines stepping) until no read is PROC."""
    deadline = time.monotonic() + timeout
    while True:
        for other in readers:
            if other is not reader:
                other.poll()
        states = {i: s for i, s in reader.poll().items() if i in read_ids}
        if "PROC" not in states.values() or time.monotonic() > deadline:
            return states
        time.sleep(0.001)


def counting_posts(monkeypatch) -> list[int]:
    posts = []
    real = nixl_tp.post_transfer

    def post(agent, op, local, remote, name, runs, notif):
        posts.append(sum(n for _, _, n in runs))
        return real(agent, op, local, remote, name, runs, notif)

    monkeypatch.setattr(nixl_tp, "post_transfer", post)
    return posts


@needs_nixl
def test_a_read_bigger_than_the_staging_pool_moves_in_rounds(readers, monkeypatch):
    """A one-rank D reads 5 blocks from a two-rank P through a pool of 2 blocks' staging: 3 rounds of a READ
    per P rank, and every head lands in place. Before, the staging buffer was as big as the transfer."""
    p_caches = [filled(1, 2), filled(2, 2)]
    p = [readers(r, 2, c) for r, c in enumerate(p_caches)]
    d = readers(0, 1, torch.zeros(rank_shape(1)), staging_bytes=2 * UNIT)
    d.connect("P:boot", [x.entry for x in p])
    posts = counting_posts(monkeypatch)
    local, remote = [9, 10, 11, 3, 4], [1, 2, 3, 7, 5]
    read_id, _, descriptors = d.post("P:boot", local, remote)
    assert wait(p, {read_id}, d) == {read_id: "DONE"}
    assert posts == [2, 2, 2, 2, 1, 1]   # (blocks per READ: 2 P ranks a round)
    assert descriptors == 2 * 3          # (one round's: runs 1..3, 7, 5 per P rank)
    want = torch.cat([c[remote] for c in p_caches], dim=4)
    assert torch.equal(d.kv_cache[local], want)
    d.release(read_id)
    assert d.staging.bytes_free() == d.staging.num_bytes


@needs_nixl
def test_reads_take_turns_and_one_let_go_while_waiting_leaves_the_line(readers):
    p_caches = [filled(3, 2), filled(4, 2)]
    p = [readers(r, 2, c) for r, c in enumerate(p_caches)]
    d = readers(0, 1, torch.zeros(rank_shape(1)), staging_bytes=2 * UNIT)
    d.connect("P:boot", [x.entry for x in p])
    first, state, _ = d.post("P:boot", [0, 1], [4, 5])       # takes the whole pool
    assert state in ("PROC", "DONE")
    gone, state, _ = d.post("P:boot", [2], [6])               # waits for a range
    assert state == "PROC"
    last, state, _ = d.post("P:boot", [3, 5, 6], [7, 8, 9])   # waits behind it
    assert state == "PROC"
    assert d.staging.num_waiting() == 2 and d.staging.bytes_free() == 0
    d.release(gone)   # (its deadline): it must leave the line, or every later read waits for it forever
    assert d.staging.num_waiting() == 1
    assert wait(p, {first, last}, d) == {first: "DONE", last: "DONE"}
    want = torch.cat([c[[4, 5, 7, 8, 9]] for c in p_caches], dim=4)
    assert torch.equal(d.kv_cache[[0, 1, 3, 5, 6]], want)
    assert torch.count_nonzero(d.kv_cache[2]) == 0
    for read_id in (first, last):
        d.release(read_id)
    assert d.staging.bytes_free() == d.staging.num_bytes


@needs_nixl
@pytest.mark.parametrize("tp", [1, 2])
def test_a_pool_that_cannot_hold_a_block_of_the_whole_model_is_refused_at_start(readers, tp):
    """Hostile review (session 50): it was found at the first staged transfer, and every request then failed
    with a 502 while the instance reported itself healthy."""
    with pytest.raises(ValueError, match=r"staging_bytes \(1024\) must hold a block of the model's whole KV "
                                         r"\(2048 bytes\)"):
        readers(0, tp, torch.zeros(rank_shape(tp)), staging_bytes=UNIT // 2)


@needs_nixl
def test_a_write_in_rounds_notifies_each_remote_rank_once_with_its_last_round(readers, monkeypatch):
    """Push from a one-rank P into a two-rank D: P stages each D rank's heads; the notification that tells D
    the blocks are complete goes with the last round only."""
    p_cache = filled(5, 1)
    d = [readers(r, 2, torch.zeros(rank_shape(2))) for r in range(2)]
    p = readers(0, 1, p_cache, staging_bytes=2 * UNIT)
    p.connect("D:boot", [x.entry for x in d])
    posts = counting_posts(monkeypatch)
    local, remote = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    write_id, _, _ = p.post("D:boot", local, remote, "WRITE", "done-t1")
    notifs: list[list[str]] = [[], []]
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        for rank, reader in enumerate(d):
            notifs[rank] += reader.poll_writes()[1]
        if p.poll()[write_id] != "PROC" and all(notifs):
            break
        time.sleep(0.001)
    assert p.poll()[write_id] == "DONE"
    assert posts == [2, 2, 2, 2, 1, 1]
    assert notifs == [["done-t1"], ["done-t1"]]
    for rank, reader in enumerate(d):
        assert torch.equal(reader.kv_cache[remote], p_cache[local][..., rank * 2:(rank + 1) * 2, :])
    p.release(write_id)


def test_staging_bytes_takes_a_size_with_a_unit_and_refuses_less_than_one_range():
    from pdserve.config import KVTransferConfig
    assert KVTransferConfig.from_json('{"staging_bytes": "256MiB"}').staging_bytes == 256 << 20
    assert KVTransferConfig.from_json('{"staging_bytes": 4096}').staging_bytes == 4096
    for bad in ('"x"', "10", "true", "1.5"):
        with pytest.raises(ValueError, match="staging_bytes"):
            KVTransferConfig.from_json('{"staging_bytes": %s}' % bad)


class FakeEvent:
    """A CUDA event's query(): not run yet, until told."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_range_whose_copy_has_not_run_is_not_handed_out_again():
    pool = StagingPool(FakeAgent(), 2 * ALIGN, torch.device("cpu"))
    first = pool.take(object(), 2 * ALIGN, 1)
    event = FakeEvent()
    pool.give_back(first[0], 2 * ALIGN, event)
    waiter = object()
    assert pool.take(waiter, ALIGN, 1) is None and pool.bytes_free() == 0
    event.done = True
    assert pool.take(waiter, ALIGN, 2) == (0, 2)


@needs_nixl
def test_a_round_that_fails_to_post_or_to_finish_fails_its_transfer_only_and_frees_its_range(readers, monkeypatch):
    """Code review (session 50): a failure after a round's READs were done (the copy, NIXL's release) escaped
    poll(), failing every transfer's step on that rank; a post's failure must not leave the range taken."""
    p = [readers(r, 2, filled(10 + r, 2)) for r in range(2)]
    d = readers(0, 1, torch.zeros(rank_shape(1)), staging_bytes=2 * UNIT)
    d.connect("P:boot", [x.entry for x in p])
    real_post, real_finish = d._post_round, d._finish_round
    calls = {"post": 0}

    def post_failing_second_round(read):
        calls["post"] += 1
        if calls["post"] == 2:
            raise RuntimeError("injected post failure")
        real_post(read)
    monkeypatch.setattr(d, "_post_round", post_failing_second_round)
    failed_post, _, _ = d.post("P:boot", [0, 1, 2], [1, 2, 3])   # rounds of 2, then 1: the second fails
    assert wait(p, {failed_post}, d) == {failed_post: "ERR"}
    assert d.staging.bytes_free() == d.staging.num_bytes

    monkeypatch.setattr(d, "_post_round", real_post)

    def finish_failing_for_block_4(read):   # (installed throughout: the round may end at post or at a poll)
        if read.local_block_ids == [4]:
            raise RuntimeError("injected copy failure")
        real_finish(read)
    monkeypatch.setattr(d, "_finish_round", finish_failing_for_block_4)
    failed_finish, _, _ = d.post("P:boot", [4], [5])
    fine, _, _ = d.post("P:boot", [6, 7], [8, 9])
    states = wait(p, {failed_finish, fine}, d)   # (poll never raises)
    assert states == {failed_finish: "ERR", fine: "DONE"}
    for read_id in (failed_post, failed_finish, fine):
        d.release(read_id)
    assert d.staging.bytes_free() == d.staging.num_bytes and d._reads == {}


@needs_nixl
def test_a_transfer_let_go_mid_rounds_gives_its_range_back(readers):
    p = [readers(r, 2, filled(20 + r, 2)) for r in range(2)]
    d = readers(0, 1, torch.zeros(rank_shape(1)), staging_bytes=2 * UNIT)
    d.connect("P:boot", [x.entry for x in p])
    read_id, _, _ = d.post("P:boot", [0, 1, 2, 3, 4], [1, 2, 3, 4, 5])
    assert d.staging.bytes_free() == 0   # its first round holds the pool
    d.release(read_id)
    assert d.staging.bytes_free() == d.staging.num_bytes and d._reads == {}
    other, _, _ = d.post("P:boot", [6], [7])
    assert wait(p, {other}, d) == {other: "DONE"}
    d.release(other)


@needs_nixl
def test_a_transfer_let_go_whose_round_cannot_be_aborted_posts_no_more_rounds(readers, monkeypatch):
    """Hostile review (session 50): release() raised (NIXL could not abort the active round), the read stayed
    in quarantine as it must, but the next polls finished that round and posted the rest, copying into blocks
    it had given up (a WRITE even notified D)."""
    p = [readers(r, 2, filled(30 + r, 2)) for r in range(2)]
    d = readers(0, 1, torch.zeros(rank_shape(1)), staging_bytes=2 * UNIT)
    d.connect("P:boot", [x.entry for x in p])
    stuck = {"on": True}

    class Unabortable:
        def __init__(self, handle):
            self.handle = handle

        def release(self):
            if stuck["on"]:
                raise RuntimeError("cannot abort an active transfer (injected)")
            self.handle.release()

    real_post, real_state = nixl_tp.post_transfer, nixl_tp.transfer_state
    posts = []
    monkeypatch.setattr(nixl_tp, "post_transfer", lambda *a: posts.append(a[5]) or (
        Unabortable(real_post(*a)[0]), "PROC"))
    monkeypatch.setattr(nixl_tp, "transfer_state",
                        lambda agent, x: "PROC" if stuck["on"] else real_state(agent, x.handle))
    read_id, _, _ = d.post("P:boot", [10, 11, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])
    assert len(posts) == 2   # the first round: a READ per P rank
    with pytest.raises(RuntimeError, match="cannot abort"):
        d.release(read_id)
    assert d.poll()[read_id] == "PROC"   # its round still moves into the blocks
    stuck["on"] = False                   # the round ends on its own
    states = wait(p, {read_id}, d)
    assert states == {read_id: "ERR"} and len(posts) == 2
    assert torch.count_nonzero(d.kv_cache[[10, 11, 3, 4, 5, 6]]) == 0   # nothing copied in after the let-go
    d.release(read_id)
    assert d.staging.bytes_free() == d.staging.num_bytes and d._reads == {}
