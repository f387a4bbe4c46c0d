"""The router at hundreds of instances (issue 14): the polls stay within their budget and spread over the round,
and a request looks at a bounded sample of a large pool: round-robin stays exact, the prompt's prefix holders
are always among the candidates, and an instance outside the sample is found when none inside can take it."""
from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.router.instances import Instance
from pdserve.router.monitor import Monitor
from pdserve.router.policy import DIRECT, Router, RouterConfig, RouteRequest
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
    """Before, every instance was asked every interval at once: 500 instances every 0.1 s took 76 % of the
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


def route_names(router: Router, n: int, req: RouteRequest | None = None) -> list[str]:
    names = []
    for _ in range(n):
        route = router.route(req or RouteRequest(8, 1), now=time.monotonic())
        names.append(route.decode.name)
    return names


def test_round_robin_over_a_sampled_pool_stays_exact():
    router = Router(colocated(100), "round-robin", RouterConfig(max_candidates=8))
    assert route_names(router, 250) == [f"i{i % 100}" for i in range(250)]


def test_the_prompts_prefix_holders_are_always_candidates():
    """Instance 77 holds the prompt: the cost policy finds it even though the window of 8 starts at 0."""
    index = PrefixIndex()
    router = Router(colocated(100), "cost", RouterConfig(max_candidates=8), index)
    req = RouteRequest.from_token_ids(list(range(64)), 1, 16, "")
    index.apply_report("i77", {"last_seq": 1, "reset": True, "snapshot": list(req.block_hashes), "batches": []},
                       time.monotonic())
    sample = router._sample(router.instances, DIRECT, router._matched(req, time.monotonic()))
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
