"""The router's global prefix index: prefix-cache block hash → the instances that hold that block.

Two kinds of entries (docs/router.md, "The router's view"):
- confirmed: fed by the instances' KV events (`GET /v1/load`'s `kv_events`); kept until a `removed` event,
  a reset snapshot that lacks the hash, or `forget`;
- predicted: the router's own guess when it sends a prompt to an instance (that instance will cache the
  prompt's blocks), so the next request with the same prefix finds it before the instance's events arrive.
  A prediction lives PREDICTION_TTL_S unless a `stored` event turns it into a confirmed entry; a `removed`
  event or a reset drops it.

The index is a hint (the instance's own prefix cache decides), so every doubt resolves to forgetting:
a lost event, a malformed batch or a gap in sequence numbers never leaves a block reported that the
instance might not hold past its next reset. Pure and single-threaded: the caller passes `now`.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

PREDICTION_TTL_S = 30.0
STORED, REMOVED = "stored", "removed"


class PrefixIndex:
    def __init__(self, prediction_ttl_s: float = PREDICTION_TTL_S) -> None:
        self.prediction_ttl_s = prediction_ttl_s
        # Both directions for each kind: match walks by hash, reset and forget walk by instance.
        # Confirmed holders are a bit mask of instance ids: a set per distinct cached block would cost ~200
        # bytes more each (millions of them at hundreds of instances), and match becomes one integer AND
        # per block instead of a loop over the instances still matching. The per-instance sets remain the
        # main cost, ~100 bytes per (instance, cached block): they make a reset O(that instance's blocks).
        self._ids: dict[str, int] = {}                   # instance → its bit
        self._names: list[str | None] = []               # bit → instance (None: free)
        self._free_bits: list[int] = []                  # of instances removed: a cluster that replaces
                                                         # instances for weeks keeps its masks short
        self._holders: dict[int, int] = {}               # hash → mask of instances with a confirmed entry
        self._confirmed: dict[str, set[int]] = {}        # instance → its confirmed hashes
        self._predicted: dict[int, dict[str, float]] = {}  # hash → instance → expiry
        self._predicted_of: dict[str, set[int]] = {}     # instance → hashes it has a prediction for
        # One entry per live prediction, roughly in expiry order, for purge. An entry's time may be older
        # than its prediction's expiry (a prediction renewed since): purge then re-queues it. So memory is
        # bounded by the distinct (instance, hash) predictions of the last two TTLs, however often renewed.
        self._expiries: deque[tuple[float, str, int]] = deque()
        self._last_seq: dict[str, int] = {}              # absent: not in sync (never, or after a gap)

    # --- events -------------------------------------------------------------------------------------------

    def last_seq(self, name: str) -> int | None:
        """The sequence number the instance's events are applied up to, for the next poll's `events_after`;
        None: poll without it, so that the instance answers with a reset snapshot."""
        return self._last_seq.get(name)

    def apply_report(self, name: str, kv_events: Mapping, now: float) -> int | None:
        """Apply one `kv_events` object of the instance's load report; returns `last_seq(name)` after it.

        A reset drops everything known of the instance (predictions too) and loads its snapshot, then the
        batches that come with it. Batches at or below the last applied sequence number are replays and
        skipped. A gap (a batch past last + 1) means events were lost: the index keeps what it has as a hint
        but leaves sync, so the next poll asks for a reset. A reset older than what was applied since (a
        reordered answer) is ignored. A malformed object applies nothing and leaves the instance out of sync
        (no exception: a poller must not die of one instance's answer; `Instance.update` already refuses
        such a report, through `parse_kv_events`).
        """
        try:
            reset, snapshot, batches, reported_last = parse_kv_events(kv_events)
        except ValueError:
            self._last_seq.pop(name, None)
            return None
        last = self._last_seq.get(name)
        if reset:
            if last is not None and reported_last is not None and reported_last < last:
                return last    # an older answer overtaken by one already applied
            self._drop_instance(name)   # predictions included: no _store bookkeeping needed below
            self._confirmed[name] = mine = set(snapshot)
            holders, bit = self._holders, self._bit(name)
            for block_hash in mine:
                holders[block_hash] = holders.get(block_hash, 0) | bit
            last = batches[0][0] - 1 if batches else (reported_last if reported_last is not None else 0)
            # The snapshot is the state at the answer's last_seq or at the first batch's start: applying the
            # batches on top gives the state at their end either way (each hash ends as its last event says).
        elif last is None:
            return None        # not in sync: these batches continue a state we do not have
        for seq, kind, hashes in batches:
            if seq <= last:
                continue
            if seq > last + 1:
                self._last_seq.pop(name, None)
                return None
            if kind == STORED:
                for block_hash in hashes:
                    self._store(name, block_hash)
            else:
                for block_hash in hashes:
                    self._remove(name, block_hash)
            last = seq
        if reset and reported_last is not None and reported_last > last:
            # A snapshot at last_seq with batches that stop short of it: whether it is the state at the
            # last batch applied or later is unknown (the next poll asks for another reset). Plain batches
            # that stop short need no such care: the next poll asks for those after the last one applied.
            self._last_seq.pop(name, None)
            return None
        self._last_seq[name] = last
        return last

    def forget(self, name: str) -> None:
        """The instance was removed or restarted: its cache and its sequence numbers are gone."""
        self._drop_instance(name)
        self._last_seq.pop(name, None)

    def release(self, name: str) -> None:
        """The instance left the cluster for good: forget it and give its bit to the next one (no mask holds
        it once its entries are dropped)."""
        self.forget(name)
        if (bit := self._ids.pop(name, None)) is not None:
            self._names[bit] = None
            self._free_bits.append(bit)

    # --- predictions --------------------------------------------------------------------------------------

    def predict(self, name: str, hashes: Iterable[int], now: float) -> None:
        """The router sent a prompt with these block hashes to the instance: it will hold them shortly."""
        expiry = now + self.prediction_ttl_s
        confirmed = self._confirmed.get(name, ())
        mine = self._predicted_of.setdefault(name, set())
        self._bit(name)   # match turns predictions into bits too
        for block_hash in hashes:
            if block_hash in confirmed:
                continue
            holders = self._predicted.setdefault(block_hash, {})
            if name not in holders:
                mine.add(block_hash)
                self._expiries.append((expiry, name, block_hash))
            holders[name] = expiry
        self.purge(now)

    def purge(self, now: float) -> int:
        """Drop expired predictions; amortised O(1) per prediction made. Returns how many it dropped."""
        num_dropped = 0
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            _, name, block_hash = expiries.popleft()
            holders = self._predicted.get(block_hash)
            expiry = holders.get(name) if holders is not None else None
            if expiry is None:
                continue       # confirmed, removed or reset since: its entry was already dropped
            if expiry > now:
                expiries.append((expiry, name, block_hash))   # renewed: look again at its new expiry
                continue
            self._unpredict(name, block_hash)
            num_dropped += 1
        return num_dropped

    # --- queries ------------------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], names: Iterable[str] | None = None, now: float = 0.0) -> dict[str, int]:
        """Per instance (of `names`, default all), how many leading blocks of `hashes` it holds, confirmed or
        predicted (unexpired); instances that hold none are left out. Walks the hashes once with the mask of
        instances still matching, and stops when it is empty: O(blocks matched), each a few integer ops."""
        counts: dict[str, int] = {}
        if not hashes:
            return counts
        if names is None:
            wanted = (1 << len(self._names)) - 1
        else:
            wanted = 0
            for name in names:
                if name in self._ids:   # else it never held anything
                    wanted |= 1 << self._ids[name]
        holders, predicted = self._holders, self._predicted
        alive = wanted & (holders.get(hashes[0], 0) | self._predicted_mask(hashes[0], now))
        num_blocks = len(hashes)
        for i in range(1, num_blocks):
            if not alive:
                break
            block_hash = hashes[i]
            held = holders.get(block_hash, 0)
            if alive & ~held and block_hash in predicted:
                held |= self._predicted_mask(block_hash, now)
            gone = alive & ~held
            if gone:
                self._count(gone, i, counts)
                alive &= held
        self._count(alive, num_blocks, counts)
        return counts

    def holds(self, name: str, block_hash: int, now: float) -> bool:
        if block_hash in self._confirmed.get(name, ()):
            return True
        return self._predicted.get(block_hash, {}).get(name, 0.0) > now

    def confirmed(self, name: str) -> frozenset[int]:
        """The hashes the instance's events say it holds (a copy: for tests and /cluster, not the hot path)."""
        return frozenset(self._confirmed.get(name, ()))

    def num_confirmed(self, name: str) -> int:
        return len(self._confirmed.get(name, ()))

    def num_predicted(self, name: str) -> int:
        """Predictions held for the instance, expired ones not yet purged included."""
        return len(self._predicted_of.get(name, ()))

    # --- internals ----------------------------------------------------------------------------------------

    def _bit(self, name: str) -> int:
        if name not in self._ids:
            if self._free_bits:
                self._ids[name] = self._free_bits.pop()
                self._names[self._ids[name]] = name
            else:
                self._ids[name] = len(self._names)
                self._names.append(name)
        return 1 << self._ids[name]

    def _count(self, mask: int, num_blocks: int, counts: dict[str, int]) -> None:
        while mask:
            low = mask & -mask
            counts[self._names[low.bit_length() - 1]] = num_blocks
            mask ^= low

    def _predicted_mask(self, block_hash: int, now: float) -> int:
        mask = 0
        for name, expiry in self._predicted.get(block_hash, {}).items():
            if expiry > now:
                mask |= 1 << self._ids[name]
        return mask

    def _store(self, name: str, block_hash: int) -> None:
        self._confirmed.setdefault(name, set()).add(block_hash)
        self._holders[block_hash] = self._holders.get(block_hash, 0) | self._bit(name)
        self._unpredict(name, block_hash)   # confirmed now: no expiry any more

    def _remove(self, name: str, block_hash: int) -> None:
        mine = self._confirmed.get(name)
        if mine is not None:
            mine.discard(block_hash)
        self._clear(name, block_hash)
        self._unpredict(name, block_hash)

    def _clear(self, name: str, block_hash: int) -> None:
        mask = self._holders.get(block_hash)
        if mask is not None and name in self._ids:
            mask &= ~(1 << self._ids[name])
            if mask:
                self._holders[block_hash] = mask
            else:
                del self._holders[block_hash]

    def _unpredict(self, name: str, block_hash: int) -> None:
        holders = self._predicted.get(block_hash)
        if holders is None or holders.pop(name, None) is None:
            return
        if not holders:
            del self._predicted[block_hash]
        mine = self._predicted_of.get(name)
        if mine is not None:
            mine.discard(block_hash)
        # Its _expiries entry stays: purge skips entries whose prediction is gone.

    def _drop_instance(self, name: str) -> None:
        for block_hash in self._confirmed.pop(name, ()):
            self._clear(name, block_hash)
        for block_hash in list(self._predicted_of.get(name, ())):
            self._unpredict(name, block_hash)
        self._predicted_of.pop(name, None)


def parse_kv_events(kv_events: Mapping) -> tuple[bool, list[int], list[tuple[int, str, list[int]]], int | None]:
    """(reset, snapshot, batches in seq order, reported last_seq) of a `kv_events` object, or ValueError
    naming what is wrong."""
    if not isinstance(kv_events, Mapping):
        raise ValueError("kv_events: not an object")
    reset = kv_events.get("reset", False)
    if not isinstance(reset, bool):
        raise ValueError("kv_events.reset: not a boolean")
    reported_last = kv_events.get("last_seq")
    if reported_last is not None and not _is_int(reported_last):
        raise ValueError("kv_events.last_seq: not an integer")
    snapshot = kv_events.get("snapshot")
    if snapshot is None:
        snapshot = []   # a reset without a snapshot: nothing cached, the safe reading
    elif not isinstance(snapshot, list) or not all(type(h) is int for h in snapshot):   # bools are not hashes
        raise ValueError("kv_events.snapshot: not a list of hashes")
    raw_batches = kv_events.get("batches") or []
    if not isinstance(raw_batches, list):
        raise ValueError("kv_events.batches: not a list")
    batches = []
    for batch in raw_batches:
        if (not isinstance(batch, (list, tuple)) or len(batch) != 3 or not _is_int(batch[0])
                or batch[1] not in (STORED, REMOVED) or not isinstance(batch[2], list)
                or not all(type(h) is int for h in batch[2])):
            raise ValueError(f"kv_events.batches: malformed batch {str(batch)[:80]}")
        batches.append((batch[0], batch[1], batch[2]))
    # The instance sends them in order; sorting costs nothing then and makes a shuffled answer harmless.
    batches.sort(key=lambda b: b[0])
    return reset, snapshot, batches, reported_last


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
