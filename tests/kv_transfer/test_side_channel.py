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


def _raw(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def test_an_unauthenticated_peer_cannot_make_the_server_buffer_much(server):
    """Found by the hostile tester: frames of up to 80 MiB were read in full before the MAC check."""
    import struct
    start = time.monotonic()
    header = struct.pack(">II", side_channel.MAX_REQUEST_JSON_BYTES + 1, 0)
    assert _raw(server.port, header) == b""   # closed at once, without waiting for the announced bytes
    header = struct.pack(">II", 2, side_channel.MAX_REQUEST_BLOB_BYTES + 1)
    assert _raw(server.port, header + b"{}") == b""
    assert time.monotonic() - start < 1.0
    reply, _ = side_channel.request("127.0.0.1", server.port, {"type": "release", "remote_request_ids": ["r"]},
                                    key=KEY)
    assert reply == {"ok": True}


def test_a_trickling_peer_is_cut_off_at_one_deadline(server, monkeypatch):
    import socket
    import struct
    monkeypatch.setattr(side_channel, "DEFAULT_TIMEOUT_S", 0.5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(struct.pack(">II", 100, 0))
        start = time.monotonic()
        closed = False
        for _ in range(40):   # one byte every 0.2 s: every recv is quick, the whole is not
            try:
                sock.sendall(b" ")
            except OSError:
                closed = True
                break
            time.sleep(0.2)
            sock.setblocking(False)
            try:
                closed = sock.recv(1) == b""
            except BlockingIOError:
                pass
            sock.setblocking(True)
            if closed:
                break
        assert closed and time.monotonic() - start < 3


def test_deep_json_and_a_connection_flood_leave_the_server_serving(server):
    import socket
    import struct
    deep = b"[" * 100_000
    assert _raw(server.port, struct.pack(">II", len(deep), 0) + deep) == b""
    flood = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(side_channel.MAX_CONNECTIONS + 20)]
    try:
        time.sleep(0.3)
        # past MAX_CONNECTIONS the server closes new connections at once instead of starting threads
        closed = 0
        for sock in flood[side_channel.MAX_CONNECTIONS:]:
            sock.settimeout(2)
            try:
                closed += sock.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:   # still open: a thread waits on it
                pass
        assert closed == 20
    finally:
        for sock in flood:
            sock.close()
    time.sleep(0.2)
    reply, _ = side_channel.request("127.0.0.1", server.port, {"type": "release", "remote_request_ids": ["r"]},
                                    key=KEY)
    assert reply == {"ok": True}
