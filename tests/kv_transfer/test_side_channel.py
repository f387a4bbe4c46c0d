"""The side channel's authentication: with a router key only its holders are served."""
from __future__ import annotations

import time

import pytest

from pdserve.kv_transfer import side_channel

KEY = "router-secret"


@pytest.fixture
def server():
    seen = []
    srv = side_channel.SideChannelServer("127.0.0.1", 0, {"release": lambda m, b: (seen.append(m) or {"ok": True}, b"")},
                                         key=KEY)
    srv.seen = seen
    yield srv
    srv.close()


def test_a_signed_message_is_served(server):
    reply, _ = side_channel.request("127.0.0.1", server.port, {"type": "release", "remote_request_ids": ["r"]},
                                    key=KEY)
    assert reply == {"ok": True} and server.seen[0]["remote_request_ids"] == ["r"]


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_a_message_without_the_key_is_refused(server, key):
    reply, _ = side_channel.request("127.0.0.1", server.port, {"type": "release", "remote_request_ids": ["r"]},
                                    key=key)
    assert reply["ok"] is False and "not authorized" in reply["error"] and server.seen == []


def test_a_tampered_or_stale_message_is_refused(server, monkeypatch):
    message = side_channel.sign({"version": side_channel.PROTOCOL_VERSION, "type": "release",
                                 "remote_request_ids": ["r"]}, b"", KEY)
    assert side_channel.verify(message, b"", KEY) is None
    assert side_channel.verify({**message, "remote_request_ids": ["other"]}, b"", KEY) is not None
    assert side_channel.verify(message, b"a blob that was not signed", KEY) is not None
    monkeypatch.setattr(time, "time", lambda: message["ts"] + side_channel.MAX_CLOCK_SKEW_S + 1)
    assert "timestamp" in side_channel.verify(message, b"", KEY)


def test_without_a_key_everything_is_served_as_before():
    seen = []
    srv = side_channel.SideChannelServer("127.0.0.1", 0, {"release": lambda m, b: (seen.append(m) or {"ok": True}, b"")})
    try:
        reply, _ = side_channel.request("127.0.0.1", srv.port, {"type": "release"})
        assert reply == {"ok": True} and len(seen) == 1
    finally:
        srv.close()
