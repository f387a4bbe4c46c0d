"""GET /v1/load (docs/router.md): the router's alone when the instance has a router key, events_after
parsed strictly, outside admission, and the engine's load report as it is."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdserve.config import ServerConfig
from pdserve.http_guard import ROUTER_KEY_HEADER
from pdserve.server.app import SERVER_KEY, build_app

from .fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(30)

ROUTER_KEY = "router-secret"
ROUTER = {ROUTER_KEY_HEADER: ROUTER_KEY}


def get_all(engine: FakeEngine, requests: list[tuple[str, dict]], **config) -> list[tuple[int, dict]]:
    """(status, JSON body) of each GET (path, headers), against one app; a path "POST /x" posts
    {"prompt": [1]}. at_capacity=True: every admission slot is taken first."""
    at_capacity = config.pop("at_capacity", False)

    async def main():
        app = build_app(engine, ServerConfig(**config))
        if at_capacity:
            server = app[SERVER_KEY]
            server.num_in_flight = server.max_in_flight
        async with TestClient(TestServer(app)) as client:
            answers = []
            for path, headers in requests:
                if path.startswith("POST "):
                    response = await client.post(path[5:], json={"prompt": [1]}, headers=headers)
                else:
                    response = await client.get(path, headers=headers)
                answers.append((response.status, await response.json()))
            return answers

    return asyncio.run(main())


def test_the_load_report_as_the_engine_builds_it():
    engine = FakeEngine(extra_stats={"num_free_blocks": 7})
    [(status, body)] = get_all(engine, [("/v1/load?events_after=0", {})])
    assert status == 200 and body == {**engine.load_report(0), "max_prompt_chars": 32 * engine.max_model_len}
    assert body["kv_events"]["batches"] == [[1, "stored", [11, 12]]] and body["num_free_blocks"] == 7
    assert engine.load_report_calls[0] == 0


def test_events_after_absent_or_a_seq_reaches_the_engine_as_none_or_an_int():
    engine = FakeEngine()
    answers = get_all(engine, [("/v1/load", {}), ("/v1/load?events_after=1", {}),
                               ("/v1/load?events_after=18446744073709551616", {})])
    assert [status for status, _ in answers] == [200, 200, 200]
    assert engine.load_report_calls == [None, 1, 2**64]
    assert answers[0][1]["kv_events"]["reset"] is True and answers[0][1]["kv_events"]["snapshot"] == [11, 12]


@pytest.mark.parametrize("query", ["events_after=-1", "events_after=1.0", "events_after=", "events_after=%201",
                                   "events_after=0x1", "events_after=%C2%B2", "events_after=1&events_after=2",
                                   "events_after=" + "9" * 21])
def test_a_malformed_events_after_is_a_400_naming_it(query):
    engine = FakeEngine()
    [(status, body)] = get_all(engine, [(f"/v1/load?{query}", {})])
    assert status == 400 and body["error"]["param"] == "events_after", body
    assert engine.load_report_calls == []


def test_with_a_router_key_only_the_router_reads_it():
    engine = FakeEngine()
    answers = get_all(engine, [("/v1/load", {}), ("/v1/load", {ROUTER_KEY_HEADER: "wrong"}),
                               ("/v1/load", {"Authorization": "Bearer client-key"}), ("/v1/load", ROUTER)],
                      api_key="client-key", router_key=ROUTER_KEY)
    assert [status for status, _ in answers] == [401, 401, 403, 200]
    assert answers[2][1]["error"]["message"] == "only the router may read the load report"
    assert engine.load_report_calls == [None]   # only the router's call reached the engine


def test_with_a_router_key_and_no_api_key_a_client_gets_403():
    engine = FakeEngine()
    answers = get_all(engine, [("/v1/load", {}), ("/v1/load", ROUTER)], router_key=ROUTER_KEY)
    assert [status for status, _ in answers] == [403, 200]


def test_it_answers_while_the_server_is_at_capacity():
    """The router polls hardest when the instance is full: the load report is never admitted."""
    engine = FakeEngine(healthy=False)
    [(tokenize_status, _), (status, body)] = get_all(
        engine, [("POST /tokenize", ROUTER), ("/v1/load", ROUTER)], router_key=ROUTER_KEY, at_capacity=True)
    assert tokenize_status == 503   # the server is full indeed
    assert status == 200 and body["healthy"] is False and body["health"] == "fake engine is unhealthy"
