"""A rank's staging memory for transfers that regroup KV heads (tensor-parallel instances of different sizes,
and a tensor-parallel instance's store transfers over NIXL): one buffer of `staging_bytes` (--kv-transfer-config),
made and registered with the rank's agent once, at the rank's first staged transfer. On a GPU it comes out of
the memory --gpu-memory-utilization leaves beside the KV cache; where that is too little, each staged
transfer fails naming the setting.

Why one bounded buffer rather than one per transfer: a staged transfer holds as many bytes as the KV it moves
(a P of T ranks reading into a D of one holds the prompt's whole KV twice), so buffers per transfer grow with
the load until an allocation fails mid-flight (on a GPU the KV cache has taken the memory already), and each
registration costs a NIXL round of its own. From this buffer a transfer takes a contiguous range for as many of
its blocks as fit (the first free range that holds them all, else the largest), moves them, gives the range
back and goes on with the rest: a transfer larger than the whole buffer moves in rounds, and transfers take
their ranges in the order they were posted (a waiting transfer holds nothing, and the handoff's own deadline
ends it like any other).

On a GPU a range holds a copy into the KV cache queued on the stream after the READ that filled it: it is free
again only once that copy has run (an event per range), so the next READ never lands under it.
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Any

import torch

ALIGN = 256   # bytes: every range starts on this boundary (DMA engines and any dtype's view)


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class StagingPool:
    """Contiguous byte ranges of one registered buffer, handed out in the order asked for."""

    def __init__(self, agent: Any, num_bytes: int, device: torch.device) -> None:
        if num_bytes < ALIGN:
            raise ValueError(f"staging_bytes: must be at least {ALIGN}, got {num_bytes}")
        self.agent, self.num_bytes = agent, num_bytes - num_bytes % ALIGN
        self.buffer = torch.empty(self.num_bytes, dtype=torch.uint8, device=device)
        self._reg = agent.register_memory(self.buffer)
        self._free: list[tuple[int, int]] = [(0, self.num_bytes)]   # (start, size), sorted, never adjacent
        self._unsettled: list[tuple[Any, int, int]] = []   # (event, start, size): free once the event ran
        self._queue: deque[object] = deque()   # who waits for a range, first come first served

    def fits(self, unit_bytes: int) -> bool:
        return self.holds(self.num_bytes, unit_bytes)

    @staticmethod
    def holds(num_bytes: int, unit_bytes: int) -> bool:
        """Whether a pool of num_bytes (as configured) has room for a range of unit_bytes."""
        return _round_up(unit_bytes) <= num_bytes - num_bytes % ALIGN

    def take(self, who: object, unit_bytes: int, max_units: int) -> tuple[int, int] | None:
        """(start, units) for `who`: max_units units of unit_bytes from the first free range that holds them
        all, else as many as the largest free range holds; None while an earlier asker still waits or not one
        unit is free (who then waits in line)."""
        self._settle()
        if self._queue and self._queue[0] is not who:
            if who not in self._queue:
                self._queue.append(who)
            return None
        best = None
        for i, (start, size) in enumerate(self._free):
            units = min(max_units, size // unit_bytes)
            if units and (best is None or units > best[2]):
                best = (i, start, units)
                if units == max_units:
                    break
        if best is None:
            if who not in self._queue:
                self._queue.append(who)
            return None
        if self._queue and self._queue[0] is who:
            self._queue.popleft()
        i, start, units = best
        used = min(_round_up(units * unit_bytes), self._free[i][1])
        rest = self._free[i][1] - used
        if rest:
            self._free[i] = (start + used, rest)
        else:
            del self._free[i]
        return start, units

    def give_back(self, start: int, num_bytes: int, event: Any = None) -> None:
        """The range from take (num_bytes: what was taken, units × unit_bytes); event: a CUDA event after the
        last work queued on the range."""
        size = min(_round_up(num_bytes), self.num_bytes - start)
        if event is not None and not event.query():
            self._unsettled.append((event, start, size))
            return
        self._insert(start, size)

    def leave(self, who: object) -> None:
        """`who` no longer waits (its transfer was let go)."""
        try:
            self._queue.remove(who)
        except ValueError:
            pass

    def view(self, start: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = 1
        for n in shape:
            count *= n
        return self.buffer[start:start + count * dtype.itemsize].view(dtype).view(shape)

    def num_waiting(self) -> int:
        return len(self._queue)

    def bytes_free(self) -> int:
        self._settle()
        return sum(size for _, size in self._free)

    def close(self) -> None:
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None
        self._free, self._unsettled = [], []
        self._queue.clear()

    def _settle(self) -> None:
        if self._unsettled:
            pending = []
            for event, start, size in self._unsettled:
                if event.query():
                    self._insert(start, size)
                else:
                    pending.append((event, start, size))
            self._unsettled = pending

    def _insert(self, start: int, size: int) -> None:
        i = bisect.bisect(self._free, (start, size))
        if i < len(self._free) and start + size == self._free[i][0]:   # merge with the next
            size += self._free.pop(i)[1]
        if i and self._free[i - 1][0] + self._free[i - 1][1] == start:   # and with the one before
            start, size = self._free[i - 1][0], self._free[i - 1][1] + size
            self._free[i - 1] = (start, size)
        else:
            self._free.insert(i, (start, size))
