"""The controller's ways out, without a Ray cluster (a fake `ray` whose calls never answer): an actor that
never answers its drain is killed once the drain's deadline passes, and a router actor that never starts
serving is replaced once its start-up deadline passes."""
from __future__ import annotations

import pytest

from pdserve.cluster import ray as pools
from pdserve.cluster.ray import DRAINING, Controller, Member, PoolSpec


class Pending:
    """An ObjectRef that never completes."""


class FakeRay:
    class exceptions:
        class GetTimeoutError(Exception):
            pass

        class RayActorError(Exception):
            pass

    def __init__(self) -> None:
        self.killed: list = []

    def wait(self, refs, timeout=None, num_returns=1):
        return [r for r in refs if not isinstance(r, Pending)], [r for r in refs if isinstance(r, Pending)]

    def get(self, ref, timeout=None):
        if isinstance(ref, Pending):
            raise self.exceptions.GetTimeoutError()
        return ref

    def kill(self, actor, no_restart=True):
        self.killed.append(actor)


class Remote:
    def __init__(self, result) -> None:
        self.result = result

    def remote(self, *args, **kwargs):
        return self.result


class HungActor:
    drain = Remote(Pending())


class Router:
    in_flight = Remote({"decode-1": 0})


@pytest.fixture
def fake_ray(monkeypatch):
    fake = FakeRay()
    monkeypatch.setattr(pools, "require_ray", lambda: fake)
    return fake


def test_an_actor_that_never_answers_its_drain_is_killed_at_the_deadline(fake_ray):
    controller = Controller(PoolSpec(model="m", serve_args=[], role_args={}, drain_timeout=2.0))
    controller.router, controller.pushed = Router(), []
    actor = HungActor()
    controller.members["decode-1"] = Member("decode-1", "decode", actor, None, 0.0, state=DRAINING)
    controller.check_draining(0.0)      # no hop open on it: its drain is asked for at once
    assert controller.members["decode-1"].drain_ref is not None
    controller.check_draining(10.0)     # not answered, deadline (2 + 15 s) not reached
    assert "decode-1" in controller.members and fake_ray.killed == []
    controller.check_draining(17.5)
    assert "decode-1" not in controller.members and fake_ray.killed == [actor]
    assert any("did not answer its drain" in e for e in controller.events)


def test_a_router_that_never_starts_serving_is_replaced_at_its_deadline(fake_ray, monkeypatch):
    controller = Controller(PoolSpec(model="m", serve_args=[], role_args={}))
    started = []

    def restart():
        started.append(1)
        controller.router, controller.router_start_ref = object(), Pending()
        controller.router_start_deadline = clock[0] + pools.ROUTER_START_TIMEOUT_S
    clock = [1000.0]
    monkeypatch.setattr(pools.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(controller, "restart_router", restart)
    restart()
    controller.check_router()
    assert len(started) == 1
    clock[0] += pools.ROUTER_START_TIMEOUT_S + 1
    old = controller.router
    controller.check_router()
    assert len(started) == 2 and fake_ray.killed == [old]
    assert any("did not start" in e for e in controller.events)
    assert not controller.ready()
