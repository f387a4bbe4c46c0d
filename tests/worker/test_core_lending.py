"""Cores lent between engines of one host (worker/core_lending.py): who gets which core, the recall of a
lender's cores with its deadline, dead instances, and an engine that lends while idle."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.worker import core_lending
from pdserve.worker.core_lending import CoreLending, plan
from tests.helpers_models import make_tiny_hf_model


def test_idle_cores_go_round_the_busy_instances_in_place_order():
    homes = {0: frozenset({0}), 1: frozenset({1}), 2: frozenset({2, 3}), 3: frozenset({4})}
    everyone_idle = [(s, False, h) for s, h in homes.items()]
    assert plan(0, everyone_idle) == [0, 1, 2, 3, 4]            # alone busy: every core
    two_busy = [(s, s in (0, 3), h) for s, h in homes.items()]
    assert plan(0, two_busy) == [0, 1, 3] and plan(3, two_busy) == [4, 2]   # free 1, 2, 3 dealt in turn
    all_busy = [(s, True, h) for s, h in homes.items()]
    assert plan(2, all_busy) == [2, 3]                           # nothing to lend: the home alone
    # a dead instance is not listed: its cores are free
    assert plan(1, [(1, True, homes[1]), (3, True, homes[3])]) == [1]


class Threads:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


@pytest.fixture
def group(tmp_path):
    made = []

    def make(home, threads=None, idle=True):
        lending = CoreLending(str(tmp_path / "cores"), home, set_threads=threads or Threads())
        if idle:   # joined busy (still loading); these tests start from an idle instance
            lending.idle()
        made.append(lending)
        return lending
    yield make
    for lending in made:
        lending.close()


def test_a_busy_instance_borrows_an_idle_ones_cores_and_gives_them_back(group, monkeypatch):
    monkeypatch.setattr(core_lending, "RECALL_S", 0.2)
    a_threads = Threads()
    a, b = group([0], a_threads), group([1])
    assert (a.slot, b.slot) == (0, 1)
    assert a.before_step() == 2 and a.using == [0, 1] and a_threads.calls == [2]
    # b turns busy while a's step still runs on core 1: b waits for it, then goes on at the deadline
    start = time.monotonic()
    assert b.before_step() == 1
    assert 0.18 < time.monotonic() - start < 1.0 and b.num_recalls_timed_out == 1
    # b waits once for a given step of a: the same stuck step costs it nothing more
    b.idle()
    start = time.monotonic()
    b.before_step()
    assert time.monotonic() - start < 0.1 and b.num_recalls_timed_out == 1
    assert a.before_step() == 1 and a.using == [0] and a_threads.calls == [2, 1]
    b.idle()
    assert a.before_step() == 2


def test_a_lender_waits_only_until_the_borrowers_step_ends(group):
    a, b = group([0]), group([1])
    a.before_step()                               # a runs on both cores
    ended = threading.Event()

    def a_ends_its_step_soon():
        time.sleep(0.05)
        a.before_step()                           # a's next step sees b busy and keeps to core 0
        ended.set()
    worker = threading.Thread(target=a_ends_its_step_soon)
    worker.start()
    start = time.monotonic()
    b.before_step()
    waited = time.monotonic() - start
    worker.join()
    assert ended.is_set() and 0.04 < waited < core_lending.RECALL_S and b.num_recalls_timed_out == 0
    assert a.using == [0] and b.using == [1]


def test_a_dead_instances_place_and_cores_are_taken_over(group, tmp_path):
    path = tmp_path / "cores"
    a = group([0])
    # an instance that joins, takes place 1 and dies busy without leaving (as under SIGKILL: no close)
    subprocess.run([sys.executable, "-c", "import os; from pdserve.worker.core_lending import CoreLending; "
                    f"c = CoreLending({str(path)!r}, [1], set_threads=lambda n: None); c.before_step(); "
                    "os._exit(0)"], check=True, timeout=60)
    assert a.slot == 0
    assert a.before_step() == 2 and a.using == [0, 1]   # core 1's owner is gone: its core is lent
    b = group([1], idle=False)                    # its restart
    assert b.slot == 1                            # the dead instance's place, taken over
    assert a.before_step() == 1 and a.using == [0]      # b joined busy (loading): core 1 is b's again


def test_an_instance_that_leaves_lends_its_cores_and_frees_its_place(group):
    a, b = group([0]), group([1])
    b.before_step()
    assert a.before_step() == 1
    b.close()
    assert a.before_step() == 2                   # b left: its core is lent
    c = group([1], idle=False)
    assert c.slot == 1 and a.before_step() == 1   # c joins busy and keeps its core
    c.idle()
    assert a.before_step() == 2


def test_core_lending_needs_own_cores_and_one_rank():
    with pytest.raises(ValueError, match="cpu_affinity"):
        EngineConfig(core_lending="/tmp/x").validate()
    with pytest.raises(ValueError, match="tensor-parallel"):
        config = EngineConfig(core_lending="/tmp/x", cpu_affinity=[0])
        config.parallel.tensor_parallel_size = 3
        config.validate()


def _lending_engine(tmp_path, group_file: str):
    """A tiny-model engine owning core 0 of `group_file`."""
    from pdserve.engine.engine_core import EngineCore
    config = EngineConfig(model=ModelConfig(model=make_tiny_hf_model(tmp_path, "llama")),
                          cache=CacheConfig(kv_cache_memory=8 << 20), scheduler=SchedulerConfig(max_num_seqs=4),
                          num_threads=1, cpu_affinity=[0], core_lending=group_file)
    return EngineCore(config)


def test_an_engine_holds_its_cores_while_it_computes_and_lends_them_when_idle(tmp_path):
    group_file = str(tmp_path / "cores")
    other = CoreLending(group_file, [1], set_threads=lambda n: None)
    other.idle()
    try:
        core = _lending_engine(tmp_path, group_file)
        try:
            core.add_request("r", [104, 105, 106], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            steps = []
            while core.has_work():
                core.step()
                steps.append((core.core_lending.busy, core.core_lending.using))
            assert steps[0] == (True, [0, 1])     # the other instance is idle: both cores
            assert not core.core_lending.busy     # done: its cores are lent
            other.before_step()
            assert other.using == [1, 0]          # and the other instance takes them
        finally:
            core.shutdown()
        assert core.core_lending._map.closed
    finally:
        other.close()


def test_an_engine_whose_step_only_waits_for_transfers_lends_its_cores(tmp_path):
    """A P whose KV D is still reading (or a D waiting for it) steps without computing: holding its cores
    then kept its peer decoding on one core (1P1D single-stream TPOT at 1.8x colocated)."""
    from pdserve.core.batch import SchedulerOutput
    group_file = str(tmp_path / "cores")
    other = CoreLending(group_file, [1], set_threads=lambda n: None)
    other.idle()
    try:
        core = _lending_engine(tmp_path, group_file)
        try:
            core.add_request("r", [104, 105, 106], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            schedule = core.scheduler.schedule
            core.scheduler.schedule = lambda: SchedulerOutput(scheduled=[], num_scheduled_tokens=0)
            core.step()                               # nothing to compute, the request still unfinished
            assert core.has_work() and not core.core_lending.busy
            other.before_step()
            assert other.using == [1, 0]
            other.idle()
            core.scheduler.schedule = schedule
            core.step()
            assert core.core_lending.using == [0, 1]
        finally:
            core.shutdown()
    finally:
        other.close()


def test_an_instance_joins_busy_and_sets_its_threads_at_its_first_step(group):
    threads = Threads()
    a = group([0], threads, idle=False)
    b = group([1], idle=False)
    assert a.busy and b.busy
    assert a.before_step() == 1 and threads.calls == [1]   # set, though the engine may have started with more
    b.idle()
    assert a.before_step() == 2 and threads.calls == [1, 2]


def test_a_bad_record_leaves_every_engine_on_its_own_cores_never_fails_a_step(group, monkeypatch):
    a, b = group([0]), group([1])
    b._write(busy=True, using=[1], pid=1 << 40)          # not a pid: os.kill overflows
    assert a.before_step() == 2                           # read as a dead instance: its core is free
    monkeypatch.setattr(core_lending, "plan", lambda *args: next(iter(())))   # whatever lending trips on
    assert a.before_step() == 1 and a.using == [0]        # a keeps to its home; the step is not failed
    assert a.before_step() == 1


def test_a_group_file_that_is_a_symlink_or_another_users_is_refused(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"x")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        CoreLending(str(tmp_path / "link"), [0], set_threads=lambda n: None)
    assert target.read_bytes() == b"x"
    if os.geteuid() == 0:
        os.chown(target, 12345, 12345)
        with pytest.raises(RuntimeError, match="another user"):
            CoreLending(str(target), [0], set_threads=lambda n: None)


@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_linear_layers_give_the_same_bits_at_any_thread_count(rows):
    """Lending changes an engine's threads from step to step: a row's numbers must not change with them,
    or P/D output would depend on what the other instance was doing."""
    import torch
    from pdserve.model import layers
    before = torch.get_num_threads()
    try:
        gen = torch.Generator().manual_seed(rows)
        for out_features, in_features in [(960, 576), (576, 1536), (49152, 576)]:
            x = torch.randn(rows, in_features, generator=gen)
            w = torch.randn(out_features, in_features, generator=gen)
            results = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                results.append(layers.linear(x, w))
            assert torch.equal(results[0], results[1]), (out_features, in_features)
    finally:
        torch.set_num_threads(before)


def test_the_engine_loop_does_not_lend_the_cores_of_a_burst_it_just_began():
    """The loop read `busy` before taking its messages: a request that came while idle got its first step,
    then the loop called idle() with work left, and peers borrowed the cores the next step had to recall."""
    from pdserve.engine.async_engine import _engine_loop

    class Core:
        broken = degraded = None
        last_step_was_empty = False

        def __init__(self):
            self.work, self.calls = 0, []

        def has_work(self):
            return self.work > 0

        def add_request(self, *args):
            self.work = 3                          # three steps to do

        def step(self):
            self.work -= 1
            self.calls.append(("step", self.work))
            return []

        def idle(self):
            self.calls.append(("idle", self.work))

        def check_ranks(self):
            pass

        def stats(self):
            return {}

        def take_kv_events(self):
            return []

    class Conn:
        def __init__(self, messages):
            self.messages = messages

        def poll(self, timeout=0.0):
            return bool(self.messages)

        def recv(self):
            return self.messages.pop(0)

        def send(self, msg):   # stop once the loop has idled past the burst
            if msg[0] == "stats" and not core.work and ("idle", 0) in core.calls and not inbox.messages:
                inbox.messages.append(("shutdown",))

    core = Core()
    inbox = Conn([("add", "r", [1, 2], None, None, None)])
    assert _engine_loop(core, inbox, Conn([])) is None
    assert [c for c in core.calls if c[0] == "idle"] and all(work == 0 for what, work in core.calls if what == "idle")


def test_a_killed_ups_group_file_is_removed_by_the_next_one(tmp_path):
    """SIGKILL leaves `up`'s group file in /dev/shm until reboot (review): the next `up` removes the files
    whose creator is gone, and only those."""
    import subprocess
    import sys
    from pdserve.worker.core_lending import remove_stale_group_files
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"pdserve-cores-{dead.pid}-abc"
    live = tmp_path / f"pdserve-cores-{os.getpid()}-def"
    other = tmp_path / "pdserve-cores-notapid"
    for f in (stale, live, other):
        f.write_bytes(b"")
    assert remove_stale_group_files(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()
