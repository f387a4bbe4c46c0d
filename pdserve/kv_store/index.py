"""The KV store's index: which slot of the pool holds which block, who may use it, and what to evict.

Pure Python (no torch, no sockets): the service (kv_store/server.py) calls it under one lock.

A block is keyed by its chained prefix-cache hash (pdserve/hashing.py; the hash already covers the model
identity and every token before the block), so a prompt's blocks form a chain and only the longest run
present from the chain's start is useful to a reader. An entry's life:

  1. begin_insert(insert_id, hashes): P asks to store a prompt's blocks (the id is P's, so that P can abort an
     insert whose answer it never got). Hashes already present (stored, or being written by another
     insert) are skipped; each missing one gets a free slot, or the slot of the least recently used
     unpinned entry, which is evicted (never one of this chain's own blocks). A chain enters the LRU order
     tail first, so that its head, which every longer prompt of the chain needs, is evicted last. PENDING entries are invisible to lookups, and their
     slots are P's to WRITE into until the insert's deadline (one write timeout plus a margin: after it no
     WRITE of P's can still land, so the slots may be reused).
  2. commit(insert_id): P's WRITE is done; its entries become STORED and join the LRU order.
     abort(insert_id): the WRITE failed or was never posted: its slots are free again.
  3. lookup(lease_id, hashes): the longest run of STORED entries from the chain's start, pinned under a lease: a
     pinned entry is never evicted, so a reader's READ sees the bytes the lookup promised.
  4. release(lease_id, drop): the reader is done (drop: free the entries now, seed 002's drop_select,
     unless another lease pins them). A lease past its deadline unpins by itself (expire()); the reader
     then must not use what it read (it reads before its own copy of the deadline, or recomputes).
     An abort or a release that arrives before its insert or lookup (a stalled store serving its backlog
     in any order) leaves a tombstone: the late insert or lookup is refused.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable


MAX_REFUSED = 1 << 12
REFUSED_TTL_S = 60.0
MAX_TOMBSTONES = 1 << 14
MAX_SLOTS = 1 << 24


class EntryState(Enum):
    PENDING = "pending"   # slot allocated, P's WRITE not confirmed
    STORED = "stored"


@dataclass
class Entry:
    slot: int
    state: EntryState
    num_pins: int = 0


@dataclass
class Insert:
    hashes: list[int]     # the entries this insert created (PENDING until commit)
    deadline: float


@dataclass
class Lease:
    hashes: list[int]
    deadline: float


@dataclass
class IndexStats:
    num_inserted_blocks: int = 0
    num_evicted_blocks: int = 0
    num_lookups: int = 0
    num_hit_blocks: int = 0
    num_expired_leases: int = 0
    num_expired_inserts: int = 0
    num_full_refusals: int = 0   # inserts cut short: every slot pinned or pending


@dataclass
class StoreIndex:
    num_slots: int
    clock: Callable[[], float] = time.monotonic
    entries: dict[int, Entry] = field(default_factory=dict)
    lru: OrderedDict = field(default_factory=OrderedDict)      # hash → None, STORED and unpinned, oldest first
    free_slots: list[int] = field(default_factory=list)
    inserts: dict[str, Insert] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    stats: IndexStats = field(default_factory=IndexStats)
    # Blocks an insert wanted and could not place, or placed and aborted: a reader waiting for them stops
    # waiting (hash → when; bounded, and forgotten after REFUSED_TTL_S or once the block is stored).
    refused: OrderedDict = field(default_factory=OrderedDict)
    tombstones: OrderedDict = field(default_factory=OrderedDict)   # aborted/released ids not seen yet → when
    num_untouched: int = 0   # slots [num_slots - num_untouched, num_slots) never handed out (no list of them)

    def __post_init__(self) -> None:
        if not 0 < self.num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots: must be in [1, {MAX_SLOTS}], got {self.num_slots}")
        self.num_untouched = self.num_slots

    # ---- P ----------------------------------------------------------------------------------------

    def begin_insert(self, insert_id: str, hashes: list[int], ttl: float) -> list[tuple[int, int]] | None:
        """[(index into hashes, slot)] to WRITE; None: the id is in use or was aborted already. Stops at the
        first block it cannot place: a later block of the chain without this one would never be found."""
        if insert_id in self.inserts or self.tombstones.pop(insert_id, None) is not None:
            return None
        placed, created = [], []
        own = set(hashes)
        for block_hash in reversed(hashes):   # a re-insert is a use: the head becomes the most recent
            if block_hash in self.lru:
                self.lru.move_to_end(block_hash)
        for i, block_hash in enumerate(hashes):
            if block_hash in self.entries:
                continue
            slot = self._take_slot(own)
            if slot is None:
                self.stats.num_full_refusals += 1
                self._refuse(hashes[i:i + 1])
                break
            self.entries[block_hash] = Entry(slot, EntryState.PENDING)
            placed.append((i, slot))
            created.append(block_hash)
        if created:
            self.inserts[insert_id] = Insert(created, self.clock() + ttl)
        return placed

    def insert_slots(self, insert_id: str) -> list[int] | None:
        """The slots a pending insert was given, in the order it was given them (None: unknown)."""
        insert = self.inserts.get(insert_id)
        return None if insert is None else [self.entries[h].slot for h in insert.hashes]

    def commit(self, insert_id: str) -> int:
        """Blocks made visible (0: the insert is unknown, e.g. it expired and its slots were reused)."""
        insert = self.inserts.pop(insert_id, None)
        if insert is None:
            return 0
        for block_hash in reversed(insert.hashes):   # tail first: the head is the most recent
            self.entries[block_hash].state = EntryState.STORED
            self.lru[block_hash] = None
        self.stats.num_inserted_blocks += len(insert.hashes)
        return len(insert.hashes)

    def abort(self, insert_id: str) -> int:
        insert = self.inserts.pop(insert_id, None)
        if insert is None:
            self._tombstone(insert_id)
            return 0
        for block_hash in insert.hashes:
            self.free_slots.append(self.entries.pop(block_hash).slot)
        self._refuse(insert.hashes[:1])
        return len(insert.hashes)

    # ---- readers ----------------------------------------------------------------------------------

    def is_refused(self, block_hash: int) -> bool:
        """An insert of this block failed lately and no insert of it is under way: do not wait for it."""
        return block_hash in self.refused and block_hash not in self.entries

    def _refuse(self, hashes: list[int]) -> None:
        now = self.clock()
        for block_hash in hashes:
            self.refused[block_hash] = now
            self.refused.move_to_end(block_hash)
        while self.refused and (len(self.refused) > MAX_REFUSED or next(iter(self.refused.values())) + REFUSED_TTL_S < now):
            self.refused.popitem(last=False)

    def longest_run(self, hashes: list[int]) -> tuple[int, int]:
        """(stored blocks from the chain's start, pending blocks right after them)."""
        num_stored = 0
        while num_stored < len(hashes):
            entry = self.entries.get(hashes[num_stored])
            if entry is None or entry.state != EntryState.STORED:
                break
            num_stored += 1
        num_pending = 0
        while num_stored + num_pending < len(hashes):
            entry = self.entries.get(hashes[num_stored + num_pending])
            if entry is None or entry.state != EntryState.PENDING:
                break
            num_pending += 1
        return num_stored, num_pending

    def lookup(self, lease_id: str, hashes: list[int], ttl: float) -> list[int] | None:
        """Slots of the longest stored run, pinned under lease_id until release or ttl ([] and no lease when
        nothing is found); None: the id is in use or was released already."""
        if lease_id in self.leases or self.tombstones.pop(lease_id, None) is not None:
            return None
        self.stats.num_lookups += 1
        num_stored, _ = self.longest_run(hashes)
        if num_stored == 0:
            return []
        run = hashes[:num_stored]
        for block_hash in run:
            entry = self.entries[block_hash]
            if entry.num_pins == 0:
                self.lru.pop(block_hash, None)
            entry.num_pins += 1
        self.leases[lease_id] = Lease(run, self.clock() + ttl)
        self.stats.num_hit_blocks += num_stored
        return [self.entries[h].slot for h in run]

    def release(self, lease_id: str, drop: bool = False) -> bool:
        """False: the lease is unknown or expired (what was read under it may have been overwritten)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            self._tombstone(lease_id)
            return False
        self._unpin(lease.hashes, drop)
        return lease.deadline >= self.clock()

    # ---- time -------------------------------------------------------------------------------------

    def expire(self) -> None:
        now = self.clock()
        for lease_id in [k for k, lease in self.leases.items() if lease.deadline < now]:
            self._unpin(self.leases.pop(lease_id).hashes, drop=False)
            self.stats.num_expired_leases += 1
        for insert_id in [k for k, insert in self.inserts.items() if insert.deadline < now]:
            self.abort(insert_id)
            self.stats.num_expired_inserts += 1

    # ---- inside -----------------------------------------------------------------------------------

    def _tombstone(self, request_id: str) -> None:
        now = self.clock()
        self.tombstones[request_id] = now
        while self.tombstones and (len(self.tombstones) > MAX_TOMBSTONES
                                   or next(iter(self.tombstones.values())) + REFUSED_TTL_S < now):
            self.tombstones.popitem(last=False)

    def _unpin(self, hashes: list[int], drop: bool) -> None:
        for block_hash in reversed(hashes):   # tail first, as commit
            entry = self.entries[block_hash]
            entry.num_pins -= 1
            if entry.num_pins:
                continue
            if drop:
                self.free_slots.append(self.entries.pop(block_hash).slot)
            else:
                self.lru[block_hash] = None   # the most recently used

    def _take_slot(self, protected: set[int]) -> int | None:
        """A free slot, else the least recently used unpinned entry's that is not in `protected` (the
        inserting chain's own blocks). An evicted block is marked refused: no reader waits for it."""
        if self.free_slots:
            return self.free_slots.pop()
        if self.num_untouched:
            self.num_untouched -= 1
            return self.num_slots - 1 - self.num_untouched
        victim = next((h for h in self.lru if h not in protected), None)
        if victim is None:
            return None
        del self.lru[victim]
        self.stats.num_evicted_blocks += 1
        self._refuse([victim])
        return self.entries.pop(victim).slot

    @property
    def num_stored(self) -> int:
        return sum(1 for e in self.entries.values() if e.state == EntryState.STORED)

    def check(self) -> None:
        """Invariants (tests): every slot is free or held by exactly one entry; the LRU holds exactly the
        stored unpinned entries; pins match the live leases."""
        slots = [e.slot for e in self.entries.values()] + self.free_slots
        assert sorted(slots) == list(range(self.num_slots - self.num_untouched)), "a slot lost or shared"
        assert set(self.lru) == {h for h, e in self.entries.items()
                                 if e.state == EntryState.STORED and e.num_pins == 0}
        pins: dict[int, int] = {}
        for lease in self.leases.values():
            for h in lease.hashes:
                pins[h] = pins.get(h, 0) + 1
        assert all(e.num_pins == pins.get(h, 0) for h, e in self.entries.items()), "pins and leases disagree"
        pending = {h for insert in self.inserts.values() for h in insert.hashes}
        assert pending == {h for h, e in self.entries.items() if e.state == EntryState.PENDING}
