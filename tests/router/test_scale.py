"""The router at hundreds of instances (issue 14): the polls stay within their budget and spread over the round,
and a request looks at a bounded sample of a large pool: round-robin stays exact, the prompt's prefix holders
are always among the candidates, and an instance outside the sample is found when none inside can take it."""
from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.router.instances import Instance
from pdserve.router.monitor import Monitor
from pdserve.router.policy import Router, RouterConfig, RouteRequest
from pdserve.router.prefix_index import PrefixIndex

REPORT = {"boot_id": "b", "kv_role": None, "healthy": True, "health": "ok", "block_size": 16, "hash_extra": "",
          "num_blocks": 1000, "num_free_blocks": 1000, "num_requests_running": 0, "num_requests_waiting": 0,
          "kv_events": {"last_seq": 0, "reset": False, "snapshot": None, "batches": []}}


def colocated(n: int) -> list[Instance]:
    instances = [Instance(f"i{i}", f"http://127.0.0.1:{40000 + i}", "colocated") for i in range(n)]
    for inst in instances:
        inst.update(dict(REPORT), time.monotonic())
    return instances


class CountingMonitor(Monitor):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[tuple[float, str]] = []

    async def fetch(self, inst):
        self.asked.append((time.monotonic(), inst.name))
        return dict(REPORT)


def test_the_polls_keep_to_their_budget_and_spread_over_the_round():
    """Before, every instance was asked every interval at once: 500 instances every 0.1 s took 75 % of the
    router's core (benchmarks/cpu_router_scale.py)."""
    instances = colocated(50)
    monitor = CountingMonitor(instances, PrefixIndex(), headers={}, interval=0.05, max_polls_per_s=200)
    assert monitor.round_seconds() == pytest.approx(0.25)

    async def run():
        task = asyncio.create_task(monitor.run(None))
        await asyncio.sleep(1.0)
        task.cancel()
    asyncio.run(run())
    assert 150 <= len(monitor.asked) <= 260   # ~200 a second, not 1,000
    first_round = sorted(t for t, _ in monitor.asked[:50])
    assert first_round[-1] - first_round[0] >= 0.15   # in slices over the round, not one burst
    assert {name for _, name in monitor.asked[:50]} == {inst.name for inst in instances}   # each once a round
    assert CountingMonitor(colocated(10), PrefixIndex(), headers={}, interval=0.1).round_seconds() == 0.1
    with pytest.raises(ValueError, match="max_polls_per_s"):
        Monitor(instances, PrefixIndex(), headers={}, max_polls_per_s=0)


class RefusingMonitor(CountingMonitor):
    async def fetch(self, inst):
        self.asked.append((time.monotonic(), inst.name))
        if inst.name == "i0":
            raise ValueError("refused")
        return dict(REPORT)


def test_an_instance_that_fails_is_ejected_within_eject_after_intervals_however_long_the_round():
    """Before the out-of-turn polls a failing instance was asked once a round: 3 rounds of 3 s at 3,000
    instances before its ejection (review)."""
    instances = colocated(200)
    monitor = RefusingMonitor(instances, PrefixIndex(), headers={}, interval=0.05, max_polls_per_s=200,
                              eject_after=3)
    assert monitor.round_seconds() == pytest.approx(1.0)
    rounds = []
    monitor.on_round = lambda: rounds.append(time.monotonic())

    async def run():
        task = asyncio.create_task(monitor.run(None))
        began = time.monotonic()
        while instances[0].is_available and time.monotonic() - began < 5:
            await asyncio.sleep(0.01)
        task.cancel()
        return time.monotonic() - began
    assert asyncio.run(run()) < 0.6   # 3 failures a slice apart, not a round apart
    gaps = [b - a for a, b in zip(rounds, rounds[1:])]
    assert gaps and max(gaps) < 0.2   # waiters for capacity hear of every slice


def route_names(router: Router, n: int, req: RouteRequest | None = None) -> list[str]:
    names = []
    for _ in range(n):
        route = router.route(req or RouteRequest(8, 1), now=time.monotonic())
        names.append(route.decode.name)
    return names


def test_round_robin_over_a_large_pool_stays_exact():
    router = Router(colocated(100), "round-robin", RouterConfig(max_candidates=8))   # (it never samples)
    assert route_names(router, 250) == [f"i{i % 100}" for i in range(250)]


@pytest.mark.parametrize("policy", ["least-load", "cost", "prefix-affinity"])
def test_equal_instances_of_a_sampled_pool_are_each_taken_in_turn(policy):
    """Before, the window followed a cursor that only some picks moved: short prompts routed straight to D
    reached 32 of 100 decode instances, and a window jumping by its length 25 of them (review)."""
    instances = [Instance("p0", "http://127.0.0.1:40990", "prefill")] + [
        Instance(f"d{i}", f"http://127.0.0.1:{41000 + i}", "decode") for i in range(100)]
    for inst in instances:
        inst.update({**REPORT, "kv_role": "producer" if inst.role == "prefill" else "consumer"}, time.monotonic())
    router = Router(instances, policy, RouterConfig(max_candidates=32, pd_min_prompt_tokens=64))
    names = route_names(router, 300)   # 8-token prompts: straight to a D
    assert len(set(names)) >= 95 and max(map(names.count, set(names))) <= 10   # (a full scan: 100, 3)


def test_misses_spread_over_the_whole_pool_while_a_hot_prefix_draws_half_the_requests():
    """Before, every hit on the hot prefix's holder (i5) moved the cursor the window started at to i6, so every
    miss saw i6..i37 only (review)."""
    index = PrefixIndex()
    router = Router(colocated(100), "prefix-affinity", RouterConfig(max_candidates=32, balance_requests=10**6),
                    index)
    hot = RouteRequest.from_token_ids(list(range(64)), 16, 16, "")
    index.apply_report("i5", {"last_seq": 1, "reset": True, "snapshot": list(hot.block_hashes), "batches": []},
                       time.monotonic())
    live, missed = [], set()
    for n in range(2000):
        req = hot if n % 2 else RouteRequest.from_token_ids([1000 + n] * 64, 16, 16, "")
        route = router.route(req, now=time.monotonic())
        live.append((route.decode, router.begin(route.decode, req, time.monotonic(), computes_prompt=True)))
        if n % 2:
            assert route.decode.name == "i5"
        else:
            missed.add(route.decode.name)
        if len(live) > 150:   # 150 requests in flight
            router.end(*live.pop(0))
    assert len(missed) >= 95   # (with the window at the picks' cursor: 32)


def test_a_d_prefills_only_when_every_p_is_backlogged_not_only_the_sampled_ones():
    instances = [Instance(f"p{i}", f"http://127.0.0.1:{41000 + i}", "prefill") for i in range(40)]
    instances += [Instance("d0", "http://127.0.0.1:42000", "decode")]
    for n, inst in enumerate(instances):
        busy = inst.role == "prefill" and n < 32   # the window's 32 have a long queue, 8 are idle
        inst.update({**REPORT, "kv_role": "producer" if inst.role == "prefill" else "consumer",
                     "num_prefill_tokens_waiting": 10**7 if busy else 0}, time.monotonic())
    route = Router(instances, "least-load", RouterConfig(max_candidates=32)).route(RouteRequest(512, 16),
                                                                                   now=time.monotonic())
    assert route.reason == "disaggregated" and route.prefill.name in {f"p{i}" for i in range(32, 40)}


def test_a_block_every_instance_holds_takes_no_place_in_the_sample():
    """A chat template's first block is on every instance: it must not give the same 16 instances the
    holders' half of every sample (review)."""
    index = PrefixIndex()
    router = Router(colocated(100), "cost", RouterConfig(max_candidates=8), index)
    template = RouteRequest.from_token_ids(list(range(16)), 1, 16, "")
    for inst in reversed(router.instances):
        index.apply_report(inst.name, {"last_seq": 1, "reset": True, "snapshot": list(template.block_hashes),
                                       "batches": []}, time.monotonic())
    req = RouteRequest.from_token_ids(list(range(16)) + [999] * 16, 1, 16, "")
    sample = router._sample(router.instances, ("decode", "colocated"), router._matched(req, time.monotonic()))
    start = int(sample[0].name[1:])
    assert [inst.name for inst in sample] == [f"i{(start + i) % 100}" for i in range(8)]   # the window alone


def test_the_prompts_prefix_holders_are_always_candidates():
    """Instance 77 holds the prompt: the cost policy finds it even though the window of 8 starts at 0."""
    index = PrefixIndex()
    router = Router(colocated(100), "cost", RouterConfig(max_candidates=8), index)
    req = RouteRequest.from_token_ids(list(range(64)), 1, 16, "")
    index.apply_report("i77", {"last_seq": 1, "reset": True, "snapshot": list(req.block_hashes), "batches": []},
                       time.monotonic())
    sample = router._sample(router.instances, ("decode", "colocated"), router._matched(req, time.monotonic()))
    assert len(sample) == 8 and "i77" in {inst.name for inst in sample}
    assert route_names(router, 1, req) == ["i77"]


def test_an_instance_outside_the_sample_takes_the_request_when_no_sampled_one_can():
    instances = colocated(40)
    for inst in instances[:39]:
        inst.update({**REPORT, "num_free_blocks": 0}, time.monotonic())
    router = Router(instances, "least-load", RouterConfig(max_candidates=4))
    assert route_names(router, 3) == ["i39"] * 3


def test_a_sample_size_of_one_is_refused():
    with pytest.raises(ValueError, match="max_candidates"):
        RouterConfig(max_candidates=1)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["route", "short", "full", "free", "remove", "add", "hold"]),
                          st.integers(0, 49)), min_size=1, max_size=80))
def test_round_robin_with_a_window_answers_as_a_full_scan(ops):
    """Round-robin's window (the instances at and after its cursors, and those holding the prompt) gives the
    full scan's answer whatever instances are full, removed, added or holding the prompt, in P/D mode with
    colocated instances beside, short prompts going straight to D. (Before: a D holding the prompt outside
    the window was missed, and a sample of D and colocated instances together could hold no D: review.)"""
    instances = [Instance("p0", "http://127.0.0.1:40990", "prefill")] + [
        Instance(f"d{i}", f"http://127.0.0.1:{41000 + i}", "decode") for i in range(40)] + [
        Instance(f"c{i}", f"http://127.0.0.1:{42000 + i}", "colocated") for i in range(10)]
    roles = {"prefill": "producer", "decode": "consumer", "colocated": None}
    for inst in instances:
        inst.update({**REPORT, "kv_role": roles[inst.role]}, time.monotonic())
    routers = [Router(list(instances), "round-robin", RouterConfig(max_candidates=k, pd_min_prompt_tokens=16))
               for k in (4, 0)]
    prompt = RouteRequest.from_token_ids(list(range(64)), 1, 16, "")
    added = 0
    for op, i in ops:
        inst = instances[1 + i]
        if op in ("full", "free"):
            inst.update({**REPORT, "kv_role": roles[inst.role], "num_free_blocks": 0 if op == "full" else 1000},
                        time.monotonic())
        elif op == "hold" and inst.name in routers[0].by_name:
            for router in routers:
                router.index.apply_report(inst.name, {"last_seq": 1, "reset": True, "batches": [],
                                                      "snapshot": list(prompt.block_hashes)}, time.monotonic())
        elif op == "remove" and len(routers[0].instances) > 3 and inst.name in routers[0].by_name:
            for router in routers:
                router.remove(inst.name)
        elif op == "add":
            added += 1
            new = Instance(f"n{added}", f"http://127.0.0.1:{43000 + added}", "decode")
            new.update({**REPORT, "kv_role": "consumer"}, time.monotonic())
            for router in routers:
                router.add(new)
        elif op in ("route", "short"):
            req = RouteRequest.from_token_ids(list(range(8)), 1, 16, "") if op == "short" else prompt
            a, b = (router.route(req, now=time.monotonic()) for router in routers)
            assert (a and (a.reason, a.decode.name, a.prefill and a.prefill.name)) == \
                (b and (b.reason, b.decode.name, b.prefill and b.prefill.name))


def test_a_sample_of_a_pool_with_colocated_instances_still_finds_a_free_d():
    instances = [Instance("p0", "http://127.0.0.1:40990", "prefill"), Instance("d0", "http://127.0.0.1:41000", "decode")]
    instances += [Instance(f"c{i}", f"http://127.0.0.1:{42000 + i}", "colocated") for i in range(10)]
    for inst in instances:
        inst.update({**REPORT, "kv_role": {"prefill": "producer", "decode": "consumer"}.get(inst.role)},
                    time.monotonic())
    for policy in ("round-robin", "least-load", "cost"):
        router = Router(instances, policy, RouterConfig(max_candidates=4))
        routes = [router.route(RouteRequest(64, 1), now=time.monotonic()) for _ in range(5)]
        assert {(r.reason, r.decode.name) for r in routes} == {("disaggregated", "d0")}, policy
