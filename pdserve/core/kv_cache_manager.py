"""The scheduler's facade over the block pool: which blocks a request holds, prefix hits,
allocation that answers None when it cannot."""
from __future__ import annotations

from pdserve.core.block_pool import BlockPool, KVCacheBlock
from pdserve.core.request import Request
from pdserve.hashing import hash_prompt_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_extra: str = "") -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_extra = hash_extra  # model identity: KV from other weights must never hit
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Per request, kept beside req_to_blocks so a step costs O(new blocks), not O(all blocks):
        # the block ids (copied out each step as the block table) and how many blocks are indexed.
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # in tokens, like vLLM
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _update_block_hashes(self, request: Request) -> list[int]:
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            request.block_hashes = hash_prompt_blocks(
                request.all_token_ids, self.block_size, self.hash_extra, request.block_hashes)
        return request.block_hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, in whole blocks, leaving at least one token
        to compute (the last one must run to produce logits)."""
        if not self.enable_caching:
            return [], 0
        hashes = self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a request that retries after a failed allocation
        looks up again; only the lookup that was used counts)."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0) -> list[int] | None:
        """Make room for num_new_tokens beyond the request's computed tokens and its new prefix
        hits. Returns the ids of newly allocated blocks, or None when there is not enough room
        (nothing is changed then)."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = cdiv(num_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        if num_required <= 0 and not new_computed_blocks:  # most decode steps: the last block has room
            return []
        # Prefix hits sitting in the free queue stop being free once touched.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_required, 0) > self.pool.num_free_blocks - num_revived:
            return None
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_required, 0))
        if request.request_id not in self.req_to_blocks:
            self.req_to_blocks[request.request_id] = blocks
            self.req_to_block_ids[request.request_id] = []
        block_ids = self.req_to_block_ids[request.request_id]
        for added in (new_computed_blocks, new_blocks):
            blocks.extend(added)
            block_ids.extend(b.block_id for b in added)
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's full blocks whose KV is now written."""
        if not self.enable_caching:
            return
        hashes = self._update_block_hashes(request)
        blocks = self.req_to_blocks.get(request.request_id, [])
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(hashes), len(blocks))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], hashes[i])
        if end > start:
            self.num_cached_blocks[request.request_id] = end

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (callers may keep it across steps)."""
        return list(self.req_to_block_ids.get(request_id, ()))

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def free(self, request: Request) -> None:
        # Reverse order: a prompt's tail blocks are the least likely to be shared, evict them first.
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.pool.evict(block_ids)
        self.num_cached_blocks.clear()  # rare (a failed load): every request re-indexes from its first block

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self.num_cached_blocks.clear()  # running requests index their blocks again
