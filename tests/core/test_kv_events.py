"""KV events (docs/router.md): the block pool reports every hash its prefix-cache index gains ("stored")
and loses ("removed"), in order, only when asked to, and gives way to a snapshot when nobody drains it."""
from __future__ import annotations

from pdserve.core.block_pool import MAX_PENDING_EVENTS_PER_BLOCK, REMOVED, SNAPSHOT, STORED, BlockPool
from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.core.request import Request
from pdserve.sampling_params import SamplingParams

from tests.core.helpers import FakeRunner, assert_no_leaks, make_scheduler, run_to_completion


def events_pool(num_blocks: int = 4) -> BlockPool:
    pool = BlockPool(num_blocks)
    pool.enable_events()
    return pool


def replay(events, cached: set[int]) -> set[int]:
    """What a reader of the events believes is cached."""
    for kind, hashes in events:
        if kind == SNAPSHOT:
            cached = set(hashes)
        elif kind == STORED:
            cached |= set(hashes)
        else:
            assert kind == REMOVED
            cached -= set(hashes)
    return cached


def test_events_are_off_by_default():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, 111)
    pool.evict([a.block_id])
    assert not pool.events_enabled and pool.take_events() == []
    assert not KVCacheManager(4, 4).pool.events_enabled


def test_cache_block_stores_each_indexed_hash_once_in_one_batch():
    pool = events_pool()
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, 111)
    pool.cache_block(b, 222)
    pool.cache_block(c, 111)   # the same content computed twice: not indexed, no event
    pool.cache_block(a, 333)   # already holds a hash: not indexed, no event
    assert pool.take_events() == [(STORED, [111, 222])]
    assert pool.take_events() == []   # taken events are gone


def test_reuse_removes_only_the_blocks_handed_out_holding_an_indexed_hash():
    pool = events_pool()
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, 111)
    pool.cache_block(b, 222)
    pool.cache_block(c, 111)   # c holds no indexed hash
    pool.free_blocks([c, b, a])
    pool.take_events()
    pool.touch([a])            # a prefix hit revives a: it keeps its entry
    pool.get_new_blocks(3)     # hands out the never-used block, then c, then b
    assert pool.take_events() == [(REMOVED, [222])]
    assert set(pool.cached) == {111}


def test_evict_and_reset_remove_and_order_is_kept():
    pool = events_pool()
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 111)
    pool.evict([a.block_id, a.block_id])   # the second time a holds nothing: no second event
    pool.cache_block(a, 111)
    pool.cache_block(b, 222)
    pool.reset_prefix_cache()
    assert pool.take_events() == [(STORED, [111]), (REMOVED, [111]), (STORED, [111, 222]),
                                  (REMOVED, [111, 222])]
    assert pool.cached == {}


def test_an_undrained_queue_becomes_one_snapshot_of_the_index():
    pool = events_pool(num_blocks=2)
    bound = MAX_PENDING_EVENTS_PER_BLOCK * pool.num_blocks
    block_hash = 0
    for _ in range(bound):      # each round stores one hash and removes one from the round before
        (block,) = pool.get_new_blocks(1)
        block_hash += 1
        pool.cache_block(block, block_hash)
        pool.free_blocks([block])
    assert 0 < len(pool.cached) <= pool.num_blocks
    assert pool.take_events() == [(SNAPSHOT, list(pool.cached))]
    # The queue starts over after the snapshot.
    removed = next(iter(pool.free_queue.values())).block_hash   # the next block handed out holds it
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 10_000)
    assert pool.take_events() == [(REMOVED, [removed]), (STORED, [10_000])]


def test_queue_within_its_bound_is_not_replaced():
    pool = events_pool(num_blocks=2)
    bound = MAX_PENDING_EVENTS_PER_BLOCK * pool.num_blocks
    blocks = pool.get_new_blocks(2)
    for i in range(bound // 2):   # stored + removed: exactly `bound` events
        pool.cache_block(blocks[0], i)
        pool.evict([blocks[0].block_id])
    events = pool.take_events()
    assert SNAPSHOT not in [kind for kind, _ in events]
    assert sum(len(hashes) for _, hashes in events) == bound


def test_events_replayed_match_the_index_through_a_scheduler_run():
    """Shared prefixes, preemption and reuse in a small cache: a reader that applies every batch, drained
    each step, believes exactly what the pool has indexed."""
    s = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=32)
    s.kv.pool.enable_events()
    for i in range(12):
        prefix = list(range(100, 116)) if i % 2 else list(range(200, 212))
        s.add_request(Request(f"r{i}", prefix + [i] * (1 + i % 5), SamplingParams(max_tokens=6)))
    believed: set[int] = set()
    runner = FakeRunner(24)
    for _ in range(1000):
        if not s.has_unfinished():
            break
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
        believed = replay(s.kv.pool.take_events(), believed)
        assert believed == set(s.kv.pool.cached)
    assert_no_leaks(s)
    assert believed   # something stayed cached, so the check compared something


def test_kv_cache_manager_caching_off_records_nothing():
    kv = KVCacheManager(8, 4, enable_caching=False)
    kv.pool.enable_events()
    r = Request("r", list(range(12)), SamplingParams())
    kv.allocate_slots(r, 12)
    kv.cache_blocks(r, 12)
    kv.free(r)
    assert kv.pool.take_events() == []


def test_run_to_completion_with_events_on_keeps_outputs():
    """Recording changes nothing the scheduler does."""
    def outputs(with_events: bool):
        s = make_scheduler(num_blocks=16)
        if with_events:
            s.kv.pool.enable_events()
        for i in range(6):
            s.add_request(Request(f"r{i}", list(range(10 + i)), SamplingParams(max_tokens=4)))
        return run_to_completion(s, FakeRunner(16))[0]

    assert outputs(True) == outputs(False)
