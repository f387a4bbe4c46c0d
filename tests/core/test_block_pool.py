import pytest

from pdserve.core.block_pool import BlockPool
from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.core.request import Request
from pdserve.sampling_params import SamplingParams


def test_lru_eviction_order_and_revival():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 111)
    pool.cache_block(b, 222)
    pool.free_blocks([b, a])  # b freed first: evicted first
    assert list(pool.free_queue) == [2, 3, 1, 0]
    assert pool.get_cached_block(222) is b
    pool.touch([a])  # revive a cached free block
    assert a.ref_cnt == 1 and 0 not in pool.free_queue
    new = pool.get_new_blocks(3)
    assert [blk.block_id for blk in new] == [2, 3, 1]
    assert pool.get_cached_block(222) is None  # b was reused: its hash is gone
    assert pool.get_cached_block(111) is a
    pool.free_blocks(new + [a])
    assert pool.num_free_blocks == 4


def test_double_free_raises():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError):
        pool.free_blocks([a])


def test_allocate_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = Request("r", list(range(20)), SamplingParams())
    assert kv.allocate_slots(r, 20) is None
    assert kv.num_free_blocks == 3 and not kv.req_to_blocks and not kv.req_to_block_ids
    assert kv.allocate_slots(r, 12) == [0, 1, 2]
    kv.free(r)
    assert kv.num_free_blocks == 3


def test_prefix_hits_respect_model_identity_and_leave_one_token():
    kv = KVCacheManager(num_blocks=8, block_size=4, hash_extra="model-A")
    r1 = Request("r1", list(range(8)), SamplingParams())
    kv.allocate_slots(r1, 8)
    kv.cache_blocks(r1, 8)
    kv.free(r1)
    r2 = Request("r2", list(range(8)), SamplingParams())
    blocks, n = kv.get_computed_blocks(r2)
    assert n == 4 and len(blocks) == 1  # full 8-token prompt: only the first block may hit
    other = KVCacheManager(num_blocks=8, block_size=4, hash_extra="model-B")
    assert r1.block_hashes != other._update_block_hashes(Request("x", list(range(8)), SamplingParams()))
    # Revived hit + new blocks must account for the hit leaving the free queue.
    assert kv.allocate_slots(r2, 4, blocks, 4) is not None
    kv.free(r2)
    assert kv.num_free_blocks == 8


def test_evict_blocks_forgets_content():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    r = Request("r", [1, 2, 3, 4, 5], SamplingParams())
    kv.allocate_slots(r, 5)
    kv.cache_blocks(r, 4)
    ids = kv.get_block_ids("r")
    kv.evict_blocks({ids[0]})
    kv.free(r)
    blocks, n = kv.get_computed_blocks(Request("s", [1, 2, 3, 4, 5], SamplingParams()))
    assert n == 0


def test_indexing_a_step_costs_the_new_blocks_not_all_of_them():
    """cache_blocks ran over every full block of a request on every step: O(context) per decode."""
    kv = KVCacheManager(num_blocks=80, block_size=4)
    calls = []
    cache_block = kv.pool.cache_block
    kv.pool.cache_block = lambda block, block_hash: calls.append(block.block_id) or cache_block(block, block_hash)
    r = Request("r", list(range(256)), SamplingParams())
    kv.allocate_slots(r, 256)
    r.num_computed_tokens = 256
    kv.cache_blocks(r, 256)
    assert len(calls) == 64
    for token in range(7):  # decodes: one new full block after the 4th token
        r.append_output_token_id(1000 + token)
        kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        kv.cache_blocks(r, r.num_computed_tokens)
    assert len(calls) == 65 and calls[-1] == kv.get_block_ids("r")[64]
    ids = kv.get_block_ids("r")
    ids.append(-1)  # a copy: the caller may keep or change it
    assert kv.get_block_ids("r")[-1] != -1

    # A failed load uncaches blocks: indexing starts over so rewritten blocks are indexed again.
    first = kv.req_to_blocks["r"][0]
    kv.evict_blocks({first.block_id})
    assert first.block_hash is None
    kv.cache_blocks(r, r.num_computed_tokens)
    assert first.block_hash is not None
    kv.free(r)
    assert not kv.req_to_blocks and not kv.req_to_block_ids and not kv.num_cached_blocks
