"""A router whose instances come and go (`Proxy.set_members`, what a Ray cluster's registry drives): it starts
empty, routes to instances as they join, stops sending to those that leave while their hops end, and keeps
its prefix index's instance bits bounded however many instances pass through."""
from __future__ import annotations

import pytest

from pdserve.hashing import hash_prompt_blocks
from pdserve.router.instances import Instance
from pdserve.router.policy import Router
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.proxy import PROXY_KEY

from .test_routing import cluster, complete, get_json, tail, wait_for

POLL = 0.05


def set_members(harness, members):
    proxy = harness.proxy_app[PROXY_KEY]

    async def apply():   # on the proxy's loop, as the Ray router actor does
        return proxy.set_members(members)
    return harness.run(apply())


def test_an_empty_dynamic_router_answers_503_then_routes_to_instances_as_they_join(harness):
    url = harness.proxy(dynamic=True, poll_interval=POLL)
    status, health = get_json(url, "/health")
    assert status == 503 and health["backends"] == {}
    assert complete(url, tail(0, 4))[0] == 503

    a = harness.backend("colocated")
    assert set_members(harness, [("colocated-a", a.url, "colocated")]) == (["colocated-a"], [])
    assert complete(url, tail(0, 4))[0] == 200 and len(a.received) == 1
    assert wait_for(lambda: a.num_polls > 0)

    p, d = harness.backend("prefill"), harness.backend("decode")
    members = [("colocated-a", a.url, "colocated"), ("prefill-x", p.url, "prefill"), ("decode-y", d.url, "decode")]
    assert set_members(harness, members) == (["prefill-x", "decode-y"], [])
    assert get_json(url, "/health")[1]["mode"] == "pd"
    assert {i["name"] for i in cluster(url)["instances"]} == {"colocated-a", "prefill-x", "decode-y"}


def test_a_removed_instance_gets_no_new_request_and_is_no_longer_polled(harness):
    a, b = harness.backend("colocated"), harness.backend("colocated")
    url = harness.proxy(dynamic=True, poll_interval=POLL)
    set_members(harness, [("c-a", a.url, "colocated"), ("c-b", b.url, "colocated")])
    for i in range(4):
        assert complete(url, tail(10 * i, 4))[0] == 200
    assert (len(a.received), len(b.received)) == (2, 2)

    assert set_members(harness, [("c-b", b.url, "colocated")]) == ([], ["c-a"])
    polls = a.num_polls
    for i in range(4):
        assert complete(url, tail(10 * i, 4))[0] == 200
    assert (len(a.received), len(b.received)) == (2, 6)
    assert not wait_for(lambda: a.num_polls > polls + 1, timeout=5 * POLL)
    assert [i["name"] for i in cluster(url)["instances"]] == ["c-b"]


def test_a_name_that_comes_back_at_another_address_is_a_new_instance(harness):
    a, b = harness.backend("colocated"), harness.backend("colocated")
    url = harness.proxy(dynamic=True, poll_interval=POLL)
    set_members(harness, [("c-0", a.url, "colocated")])
    assert set_members(harness, [("c-0", b.url, "colocated")]) == (["c-0"], ["c-0"])
    assert complete(url, tail(0, 4))[0] == 200
    assert (len(a.received), len(b.received)) == (0, 1)


@pytest.mark.parametrize("members", [
    [("x", "http://127.0.0.1:1", "colocated"), ("x", "http://127.0.0.1:2", "colocated")],
    [("x", "http://127.0.0.1:1", "colocated"), ("y", "127.0.0.1:1", "decode")],
    [("x", "http://127.0.0.1:1", "router")],
])
def test_a_malformed_member_list_changes_nothing(harness, members):
    a = harness.backend("colocated")
    harness.proxy(dynamic=True, poll_interval=POLL)
    set_members(harness, [("c-a", a.url, "colocated")])
    with pytest.raises(ValueError):
        set_members(harness, members)
    assert [inst.name for inst in harness.proxy_app[PROXY_KEY].router.instances] == ["c-a"]


def test_a_static_router_still_refuses_an_empty_or_one_sided_configuration():
    with pytest.raises(ValueError):
        Router([])
    with pytest.raises(ValueError):
        Router([Instance("p", "http://127.0.0.1:1", "prefill")])
    assert Router([], dynamic=True).mode == "colocated"


def test_instances_passing_through_reuse_the_prefix_index_bits():
    """A cluster that replaces instances for weeks: each newcomer takes a departed one's bit, and the
    newcomer never inherits the departed one's cached blocks."""
    router = Router([], dynamic=True)
    hashes = hash_prompt_blocks(list(range(64)), 16, "")
    for n in range(200):
        name = f"decode-{n}"
        router.add(Instance(name, f"http://127.0.0.1:{1000 + n}", "decode"))
        if n == 0:
            assert router.index.match(hashes, [name]) == {}
        _store(router.index, name, hashes)
        assert router.index.match(hashes, [name]) == {name: 4}
        router.remove(name)
        assert router.index.match(hashes) == {}
    assert len(router.index._names) == 1


def _store(index: PrefixIndex, name: str, hashes) -> None:
    for block_hash in hashes:
        index._store(name, block_hash)


def test_a_decode_removed_while_its_prefill_runs_is_replaced_for_the_decode_hop(harness):
    """The router picks P and D together; if D leaves the cluster during P's prefill, the KV goes to a D
    that is still in it (the leaving one may already refuse connections while it drains)."""
    import threading
    p, d_old, d_new = harness.backend("prefill", "slow_2s"), harness.backend("decode"), harness.backend("decode")
    url = harness.proxy(dynamic=True, poll_interval=POLL)
    set_members(harness, [("p", p.url, "prefill"), ("d-old", d_old.url, "decode")])
    result = {}
    client = threading.Thread(target=lambda: result.update(answer=complete(url, tail(0, 4))))
    client.start()
    assert wait_for(lambda: len(p.received) == 1)
    set_members(harness, [("p", p.url, "prefill"), ("d-new", d_new.url, "decode")])
    client.join(15)
    assert not client.is_alive() and result["answer"][0] == 200
    assert (len(d_old.received), len(d_new.received)) == (0, 1)
    proxy = harness.proxy_app[PROXY_KEY]
    assert wait_for(lambda: proxy.num_in_flight_on("d-old") == 0) and "d-old" not in proxy.departed
