"""Fixed-size KV blocks with reference counts, an LRU free queue and the prefix-cache index.

A block with ref_cnt 0 sits in the free queue. If it still holds a cached prefix (block_hash set),
it can be revived by a prefix hit until it is handed out again; the free queue's order is the
eviction order (least recently freed first).

KV events (opt-in, for the router's prefix index: docs/router.md): a hash is "stored" when cache_block
indexes it and "removed" when _uncache drops it from the index (its block handed out for other content,
evicted, or the cache reset). They queue as run-length batches until the engine takes them; a reader that
falls too far behind gets one snapshot of the index instead of an unbounded queue.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

STORED, REMOVED, SNAPSHOT = "stored", "removed", "snapshot"
# Pending event hashes allowed per block before the queue gives way to a snapshot: a snapshot costs
# O(cached hashes) once, a queue that nobody drains would grow without bound.
MAX_PENDING_EVENTS_PER_BLOCK = 4


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}  # block hash → block
        # KV events: None while off (the default: offline use and tests pay one None check per change).
        self._events: list[tuple[str, list[int]]] | None = None
        self._num_pending_events = 0
        self._events_overflowed = False

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot take {num_blocks} blocks, {self.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            self._uncache(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving them from the free queue if needed."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the queue's tail in the order given."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # same content computed twice: keep the first copy indexed
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self._events is not None:
            self._record_event(STORED, block_hash)

    def evict(self, block_ids: Iterable[int]) -> None:
        """Forget the cached content of these blocks (e.g. a failed KV load wrote garbage)."""
        for block_id in block_ids:
            self._uncache(self.blocks[block_id])

    def _uncache(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self._events is not None:
                    self._record_event(REMOVED, block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._uncache(block)

    # -- KV events ---------------------------------------------------------------------------
    def enable_events(self) -> None:
        if self._events is None:
            self._events = []

    @property
    def events_enabled(self) -> bool:
        return self._events is not None

    def take_events(self) -> list[tuple[str, list[int]]]:
        """The events since the last call, oldest first, as (STORED | REMOVED, hashes) batches; after an
        overflow one (SNAPSHOT, every hash cached now) instead. Empty while events are off."""
        if self._events is None:
            return []
        events = [(SNAPSHOT, list(self.cached))] if self._events_overflowed else self._events
        self._events, self._num_pending_events, self._events_overflowed = [], 0, False
        return events

    def _record_event(self, kind: str, block_hash: int) -> None:
        if self._events_overflowed:
            return  # the snapshot taken at the next drain covers it
        if self._num_pending_events >= MAX_PENDING_EVENTS_PER_BLOCK * self.num_blocks:
            self._events_overflowed = True
            self._events = []
            return
        self._num_pending_events += 1
        events = self._events
        if events and events[-1][0] == kind:
            events[-1][1].append(block_hash)
        else:
            events.append((kind, [block_hash]))
