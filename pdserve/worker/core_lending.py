"""Cores lent between the engines of one CPU host: an idle instance's cores run a busy one's steps.

Why: `pdserve up` on a CPU machine gives its instances disjoint cores, because OpenMP threads that
outnumber the cores spin on descheduled peers (1P1D with both engines on both cores lost a third of its
throughput, docs/benchmarks.md). But a disjoint split leaves a core idle whenever its instance is, which
on a small machine is most of the time for one of them: 1P1D on a core each decoded a single stream at
1.6x colocated TPOT and prefilled at 2x its TTFT. So each engine of a group keeps its own cores (its
home) and, before each step, adds its share of the home cores of the instances that are idle or gone,
running one torch thread per core it holds. An instance that turns busy claims its home back: it waits
until no other instance's current step uses those cores (a borrower gives them back at its next step
boundary), at most RECALL_S, then starts anyway; a wrong guess costs one step's speed, never an answer.
It waits at most once for the same step of a borrower: one that is stopped or stuck in a long step costs
its lender RECALL_S once, not at every step.

The group is a file (under /dev/shm where there is one), one fixed-size record per instance, each
written only by its own instance: pid, busy, a count of its steps, and two bitmaps, its home cores and
the cores its current step uses. A record whose pid is gone is free (a restarted instance takes the
first free one under the file's lock) and its cores are lent out. Reads are not atomic with writes; a
torn read is one stale decision, corrected at the next step, and anything lending cannot make sense of
(a bad record, an error) leaves the engine on its home cores: lending costs speed, never a step.
`pdserve up` creates the file (O_EXCL, mode 0600, a random name) and removes it at exit; an engine
refuses a symlink or another user's file.

The engine's process is not pinned while it lends: its threads go where the OS puts them among the cores
it was allowed, and the thread count, not a pin, keeps it to its share.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import mmap
import os
import struct
import tempfile
import time
from typing import Callable, Iterable

logger = logging.getLogger(__name__)

MAX_CORES = 1024
MAX_SLOTS = 256
_BITMAP_BYTES = MAX_CORES // 8
_RECORD = struct.Struct(f"<qqq{_BITMAP_BYTES}s{_BITMAP_BYTES}s")   # pid, busy, steps, home, using
RECALL_S = 0.25          # how long a busy-again instance waits for borrowers to leave its home cores
_RECALL_POLL_S = 0.001
_ALIVE_TTL_S = 1.0       # how long a peer's liveness (a kill(pid, 0)) is trusted
JOIN_TIMEOUT_S = 10.0    # for the file's lock, held by a joining instance for microseconds


def _bitmap(cores: Iterable[int]) -> bytes:
    value = 0
    for core in cores:
        if not 0 <= core < MAX_CORES:
            raise ValueError(f"core {core}: core lending handles cores 0..{MAX_CORES - 1}")
        value |= 1 << core
    return value.to_bytes(_BITMAP_BYTES, "little")


@functools.lru_cache(maxsize=4096)   # a group has few distinct bitmaps, read at every step
def _cores(bitmap: bytes) -> frozenset[int]:
    value = int.from_bytes(bitmap, "little")
    return frozenset(i for i in range(value.bit_length()) if value >> i & 1)


def default_group_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "/tmp"


_GROUP_PREFIX = "pdserve-cores-"


def create_group_file() -> str:
    """A new, empty group file of this user's only (`pdserve up`'s; it removes it at exit). Its name holds
    the creator's pid, so that a later `up` can remove the file of one that was killed (remove_stale_group_files)."""
    remove_stale_group_files()
    fd, path = tempfile.mkstemp(prefix=f"{_GROUP_PREFIX}{os.getpid()}-", dir=default_group_dir())
    os.close(fd)
    return path


def remove_stale_group_files(directory: str | None = None) -> list[str]:
    """Remove this user's group files whose creating `up` is gone (a SIGKILL leaves its file; /dev/shm
    keeps it until reboot). A pid that is alive, or another user's, keeps its file."""
    directory = directory or default_group_dir()
    removed = []
    for name in os.listdir(directory):
        pid_part = name[len(_GROUP_PREFIX):].split("-", 1)[0]
        if not name.startswith(_GROUP_PREFIX) or not pid_part.isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != os.geteuid():
                continue
            os.kill(int(pid_part), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
        except (OSError, OverflowError):   # alive under another user (EPERM), gone meanwhile
            continue
    return removed


def plan(me: int, peers: list[tuple[int, bool, frozenset[int]]]) -> list[int]:
    """The cores slot `me` runs its next step on. peers: (slot, busy, home) of every instance, `me`
    included (and counted busy); a dead or departed one is listed idle, so its home is free. The free cores
    (the homes of idle instances) go round the busy instances in slot order, so that instances that
    read the same state agree on who gets which core."""
    busy = sorted(slot for slot, is_busy, _ in peers if is_busy or slot == me)
    mine = next(home for slot, _, home in peers if slot == me)
    taken = set().union(*(home for slot, is_busy, home in peers if is_busy or slot == me))
    every = set().union(*(home for _, _, home in peers))
    free = sorted(every - taken)
    lent = [core for j, core in enumerate(free) if busy[j % len(busy)] == me]
    return sorted(mine) + lent


class CoreLending:
    """This engine's record in a group file; before_step() / idle() around the engine's steps."""

    def __init__(self, path: str, home: Iterable[int], *,
                 set_threads: Callable[[int], None] | None = None) -> None:
        self.home = frozenset(home)
        if not self.home:
            raise ValueError("core lending: an instance needs at least one core of its own (--cpu-cores)")
        self.path = path
        self.pid = os.getpid()
        if set_threads is None:
            import torch   # here, not at the top: `pdserve up` creates the group file without loading torch
            set_threads = torch.set_num_threads
        self._set_threads = set_threads
        self._alive: dict[int, tuple[bool, float]] = {}
        size = MAX_SLOTS * _RECORD.size
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            if os.fstat(self._fd).st_uid != os.geteuid():
                raise RuntimeError(f"core lending group {path}: the file belongs to another user")
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            while True:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise RuntimeError(f"core lending group {path}: its lock stayed taken for "
                                           f"{JOIN_TIMEOUT_S:.0f} s") from None
                    time.sleep(0.01)
            try:
                if os.fstat(self._fd).st_size < size:
                    os.ftruncate(self._fd, size)
                self._map = mmap.mmap(self._fd, size)
                self.steps = 0
                self.slot = next((s for s in range(MAX_SLOTS) if not self._is_alive(self._read(s)[0], 0.0)), None)
                if self.slot is None:
                    self._map.close()
                    raise RuntimeError(f"core lending group {path}: all {MAX_SLOTS} places are taken")
                # Busy until the engine's loop first finds nothing to do: it is still loading and warming up.
                self._write(busy=True, using=self.home)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(self._fd)
            raise
        self.busy = True
        self.using: list[int] = sorted(self.home)
        self.threads: int | None = None   # set at the first step, whatever the engine started with
        self._failed = False
        self.num_recalls_timed_out = 0
        self._waited_on: set[tuple[int, int, int]] = set()   # (slot, pid, steps) of borrowers waited out
        logger.info("core lending: cores %s of group %s (place %d)", sorted(self.home), path, self.slot)
        shared = sorted(set().union(*(home & self.home for slot, pid, _, _, home, _ in self._peers()
                                      if slot != self.slot and pid)))
        if shared:   # two homes on one core: their threads outnumber it whenever both are busy
            logger.warning("core lending: cores %s are also another instance's own in %s", shared, path)

    # -- the record ----------------------------------------------------------------------------------
    def _read(self, slot: int) -> tuple[int, bool, int, frozenset[int], frozenset[int]]:
        pid, busy, steps, home, using = _RECORD.unpack_from(self._map, slot * _RECORD.size)
        return pid, bool(busy), steps, _cores(home), _cores(using)

    def _write(self, *, busy: bool, using: Iterable[int], pid: int | None = None) -> None:
        _RECORD.pack_into(self._map, self.slot * _RECORD.size, self.pid if pid is None else pid, int(busy),
                          self.steps, _bitmap(self.home), _bitmap(using))

    def _is_alive(self, pid: int, now: float) -> bool:
        if pid <= 0:
            return False
        if pid == self.pid:
            return True
        known = self._alive.get(pid)
        if known is not None and now - known[1] < _ALIVE_TTL_S:
            return known[0]
        try:
            os.kill(pid, 0)
            alive = True
        except (ProcessLookupError, PermissionError):   # gone, or another user's process: not ours
            alive = False
        except (OverflowError, OSError, ValueError):      # not a pid at all: a bad record
            alive = False
        self._alive[pid] = (alive, now)
        return alive

    def _peers(self) -> list[tuple[int, int, bool, int, frozenset[int], frozenset[int]]]:
        now = time.monotonic()
        out = []
        for slot in range(MAX_SLOTS):
            pid, busy, steps, home, using = self._read(slot)
            if not home:   # never taken: places are taken first-free, so none past it is either
                break
            if pid and self._is_alive(pid, now):
                out.append((slot, pid, busy, steps, home, using))
            else:          # dead or departed: idle, its cores free
                out.append((slot, 0, False, 0, home, frozenset()))
        return out

    # -- around the engine's steps ---------------------------------------------------------------------
    def before_step(self) -> int:
        """Claim this step's cores and set the thread count to match; returns it."""
        self.steps += 1
        try:
            cores = self._claim()
        except Exception:   # lending must never fail a step: stay home
            if not self._failed:
                logger.exception("core lending failed; this engine keeps to its own cores %s", sorted(self.home))
                self._failed = True
            cores = sorted(self.home)
        self.using = cores
        if len(cores) != self.threads:
            self._set_threads(len(cores))
            self.threads = len(cores)
        return self.threads

    def _claim(self) -> list[int]:
        if not self.busy:
            self.busy = True
            self._write(busy=True, using=self.home)
            self._recall()
        peers = [(slot, busy, home) for slot, _, busy, _, home, _ in self._peers()]
        cores = plan(self.slot, peers)
        self._write(busy=True, using=cores)   # every step: a lender tells a new step from a stuck one
        # A lender may have turned busy between that read and this write, and found no borrower on its
        # cores: read the lenders again, after the write, and leave theirs to them.
        lenders = [slot for slot, _, home in peers if slot != self.slot and home & set(cores)]
        if any(self._read(slot)[1] for slot in lenders):
            cores = plan(self.slot, [(slot, busy, home) for slot, _, busy, _, home, _ in self._peers()])
            self._write(busy=True, using=cores)
        return cores

    def _recall(self) -> None:
        """Wait (at most RECALL_S) until no other instance's step runs on this one's home cores."""
        deadline = time.monotonic() + RECALL_S
        while True:
            steps = {(slot, pid, steps) for slot, pid, _, steps, _, using in self._peers()
                     if slot != self.slot and using & self.home}
            self._waited_on &= steps   # a borrower that moved on is waited for again at its next step
            borrowers = steps - self._waited_on
            if not borrowers:
                return
            if time.monotonic() >= deadline:
                self.num_recalls_timed_out += 1
                self._waited_on |= borrowers
                logger.debug("core lending: cores %s still in use by place(s) %s after %.2f s; going on",
                             sorted(self.home), sorted(b[0] for b in borrowers), RECALL_S)
                return
            time.sleep(_RECALL_POLL_S)

    def idle(self) -> None:
        """Nothing to compute: lend the home cores out until the next step."""
        if self.busy:
            self.busy = False
            self.using = []
            self._write(busy=False, using=())

    def close(self) -> None:
        """Leave the group: the record is free again and its cores lent out."""
        if self._map.closed:
            return
        self._write(busy=False, using=(), pid=0)
        self._map.close()
        os.close(self._fd)
