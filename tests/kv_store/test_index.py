"""The store's index: slots, the LRU order, pending inserts and leases (pure Python, milliseconds)."""
from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kv_store.index import StoreIndex


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def begin(index: StoreIndex, hashes: list[int], ttl: float = 10) -> tuple[str, list[tuple[int, int]]]:
    insert_id = uuid.uuid4().hex
    return insert_id, index.begin_insert(insert_id, hashes, ttl)


def look(index: StoreIndex, hashes: list[int], ttl: float = 5) -> tuple[str | None, list[int]]:
    lease_id = uuid.uuid4().hex
    slots = index.lookup(lease_id, hashes, ttl)
    return (lease_id if slots else None), slots


def stored(index: StoreIndex, hashes: list[int]) -> list[tuple[int, int]]:
    insert_id, placed = begin(index, hashes)
    index.commit(insert_id)
    return placed


def test_insert_is_invisible_until_committed_then_found_as_a_run():
    index = StoreIndex(8)
    insert_id, placed = begin(index, [11, 12, 13], ttl=10)
    assert [i for i, _ in placed] == [0, 1, 2]
    assert look(index, [11, 12, 13], ttl=5) == (None, [])
    assert index.longest_run([11, 12, 13]) == (0, 3)
    assert index.commit(insert_id) == 3
    lease_id, slots = look(index, [11, 12, 13, 14], ttl=5)
    assert slots == [slot for _, slot in placed]
    assert index.release(lease_id)
    index.check()


def test_a_hole_in_the_chain_ends_the_run():
    index = StoreIndex(8)
    stored(index, [1, 2])
    stored(index, [4])           # a block whose parent (3) is missing
    assert index.longest_run([1, 2, 3, 4]) == (2, 0)
    index.check()


def test_present_blocks_are_skipped_by_a_second_insert():
    index = StoreIndex(8)
    stored(index, [1, 2])
    _, placed = begin(index, [1, 2, 3], ttl=10)
    assert [i for i, _ in placed] == [2]
    index.check()


def test_lru_evicts_the_oldest_unpinned_and_never_a_pinned_one():
    index = StoreIndex(3)
    stored(index, [1])
    stored(index, [2])
    stored(index, [3])
    lease_id, _ = look(index, [1], ttl=5)      # 1 pinned: 2 is the oldest evictable
    _, placed = begin(index, [4], ttl=10)
    assert placed and 2 not in index.entries and 1 in index.entries
    index.release(lease_id)                     # 1 is now the most recently used
    index.commit(next(iter(index.inserts)))
    stored(index, [5])
    assert 3 not in index.entries and 1 in index.entries
    index.check()


def test_full_of_pins_and_pending_inserts_cuts_an_insert_short():
    index = StoreIndex(2)
    stored(index, [1])
    lease_id, _ = look(index, [1], ttl=5)
    begin(index, [7], ttl=10)             # pending: not evictable
    _, placed = begin(index, [8, 9], ttl=10)
    assert placed == [] and index.stats.num_full_refusals == 1
    index.release(lease_id)
    index.check()


def test_expired_lease_unpins_and_a_late_release_says_it_is_stale():
    clock = Clock()
    index = StoreIndex(2, clock=clock)
    stored(index, [1, 2])
    lease_id, _ = look(index, [1, 2], ttl=5)
    clock.now = 6
    index.expire()
    assert index.stats.num_expired_leases == 1
    _, placed = begin(index, [3, 4], ttl=10)   # the slots the reader was promised are reused
    assert len(placed) == 2
    assert index.release(lease_id) is False
    index.check()


def test_release_after_its_deadline_before_the_reaper_ran_is_stale():
    clock = Clock()
    index = StoreIndex(2, clock=clock)
    stored(index, [1])
    lease_id, _ = look(index, [1], ttl=5)
    clock.now = 5.5
    assert index.release(lease_id) is False
    index.check()


def test_insert_past_its_ttl_frees_its_slots_and_cannot_commit():
    clock = Clock()
    index = StoreIndex(2, clock=clock)
    insert_id, _ = begin(index, [1, 2], ttl=10)
    clock.now = 11
    index.expire()
    assert index.commit(insert_id) == 0 and len(index.free_slots) == 2
    index.check()


def test_drop_select_frees_once_no_other_reader_holds_it():
    index = StoreIndex(4)
    stored(index, [1, 2])
    first, _ = look(index, [1, 2], ttl=5)
    second, _ = look(index, [1], ttl=5)
    assert index.release(first, drop=True)
    assert 2 not in index.entries and 1 in index.entries   # 1 is still pinned by the second reader
    assert index.release(second, drop=True)
    assert not index.entries and len(index.free_slots) + index.num_untouched == 4
    index.check()


def test_abort_frees_the_pending_slots():
    index = StoreIndex(4)
    insert_id, _ = begin(index, [1, 2], ttl=10)
    assert index.abort(insert_id) == 2 and not index.entries
    index.check()


def test_num_slots_must_be_positive():
    with pytest.raises(ValueError, match="num_slots"):
        StoreIndex(0)


operations = st.lists(st.tuples(st.sampled_from(["insert", "commit", "abort", "lookup", "release", "drop",
                                                 "tick"]),
                                st.lists(st.integers(0, 12), min_size=1, max_size=5)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(operations)
def test_no_sequence_of_operations_loses_or_shares_a_slot(ops):
    clock = Clock()
    index = StoreIndex(5, clock=clock)
    inserts, leases = [], []
    for op, hashes in ops:
        if op == "insert":
            insert_id, _ = begin(index, hashes, ttl=3)
            inserts.append(insert_id)
        elif op in ("commit", "abort") and inserts:
            getattr(index, op)(inserts.pop(hashes[0] % len(inserts)))
        elif op == "lookup":
            lease_id, slots = look(index, hashes, ttl=2)
            num_stored, _ = index.longest_run(hashes)
            assert len(slots) == num_stored
            if lease_id:
                leases.append(lease_id)
        elif op in ("release", "drop") and leases:
            index.release(leases.pop(hashes[0] % len(leases)), drop=op == "drop")
        elif op == "tick":
            clock.now += hashes[0] / 4
            index.expire()
        index.check()


def test_a_block_an_insert_could_not_place_or_aborted_is_refused_until_stored():
    index = StoreIndex(1)
    stored(index, [1])
    lease_id, _ = look(index, [1], ttl=5)
    begin(index, [1, 2], ttl=10)            # 2 finds no slot: 1 is pinned
    assert index.is_refused(2)
    index.release(lease_id)
    begin(index, [1, 2], ttl=10)                  # 1 is not evicted for its own chain's next block
    assert index.is_refused(2) and 1 in index.entries
    insert_id, _ = begin(index, [2], ttl=10)      # another chain's insert evicts 1 for it
    assert not index.is_refused(2)                # under way again
    assert index.is_refused(1)                    # evicted: no reader waits for it
    index.abort(insert_id)
    assert index.is_refused(2)
    index.check()


def test_a_chain_is_evicted_from_its_tail_and_never_for_its_own_blocks():
    # The bugs: blocks entered the LRU head first, so one eviction took a chain's head and left its tail
    # unreachable in slots; and an insert could evict the stored blocks of its own chain (the run then
    # fell to 0 and D waited its whole store_wait_seconds).
    index = StoreIndex(4)
    stored(index, [1, 2, 3])
    stored(index, [7])
    _, placed = begin(index, [8, 9])              # two evictions: 3 (the tail) and 2, never 1 before them
    assert len(placed) == 2 and 1 in index.entries and 3 not in index.entries
    assert index.longest_run([1, 2, 3]) == (1, 0)
    index = StoreIndex(3)
    stored(index, [1, 2])
    _, placed = begin(index, [1, 2, 3, 4])        # one free slot; 1 and 2 are this chain's
    assert [i for i, _ in placed] == [2] and index.longest_run([1, 2]) == (2, 0)
    index.check()


def test_an_abort_or_release_that_overtakes_its_insert_or_lookup_refuses_it():
    index = StoreIndex(4)
    stored(index, [1])
    assert index.abort("late-insert") == 0 and index.release("late-lease") is False
    assert index.begin_insert("late-insert", [5], ttl=10) is None
    assert index.lookup("late-lease", [1], ttl=5) is None
    assert not index.leases and not index.inserts
    index.check()
