"""RoundRobin: the order it picks in, exclusion, and the empty pool."""
import pytest

from pdserve.router.policy import RoundRobin


def test_round_robin_cycles_in_order():
    policy = RoundRobin(["a", "b", "c"])
    assert [policy.pick() for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_skips_excluded_and_returns_none_when_all_are():
    policy = RoundRobin(["a", "b", "c"])
    assert policy.pick(exclude={"a"}) == "b"
    assert policy.pick(exclude={"c"}) == "a"      # after b comes c, excluded, so a
    assert policy.pick(exclude={"a", "b", "c"}) is None
    assert policy.pick() == "b"                   # a failed pick does not move the cursor
    policy.release("b")                           # a no-op for round-robin


def test_round_robin_needs_a_url():
    with pytest.raises(ValueError, match="urls"):
        RoundRobin([])
