"""The side channel beside a KV transport: small control messages over plain TCP.

One request per connection: the client connects, sends one message, reads one reply, closes.
A message is a JSON object plus an optional opaque blob (e.g. NIXL agent metadata):

    [u32 json_len][u32 blob_len][json_len bytes of UTF-8 JSON][blob_len bytes]   # big-endian

Every request has "type" and "version"; every reply has "ok" (and "error" when not ok). The
server runs in its own thread (one short-lived thread per connection) and calls the handler the
owner registered for the message type; handlers run off the engine thread, so the owner guards
whatever they share with a lock and never touches the transport from them. The handoff's types
(lifecycle.py): handshake, claim, heartbeat, release, done. The client side for one peer,
PeerClient, runs exchanges on its own threads under one deadline each and hands outcomes back as
events; a client never raises into its owner.
No pyzmq: the GPU image lacks it, and one framed request/reply needs nothing more than sockets.

Authentication: with a key (the cluster's router key), every request carries "ts" (the sender's clock)
and "auth", an HMAC-SHA256 of the rest of the message and of the blob; the server refuses a message
whose MAC is wrong or whose ts is more than MAX_CLOCK_SKEW_S away from its own clock. Without the key
nobody can fetch P's transport metadata (with NIXL, the means to read its memory), extend, release or
complete a lease. Replies are not signed and nothing is encrypted: the key keeps out callers on the
network, not an eavesdropper (docs/security.md).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import socketserver
import struct
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

logger = logging.getLogger(__name__)
# Causes an exchange's on_error gets, which callers tell apart (a refusal: nothing listens there)
CAUSE_TIMEOUT = "its side channel did not answer in time"
CAUSE_REFUSED = "its side channel refused the connection"

PROTOCOL_VERSION = 1
DEFAULT_TIMEOUT_S = 5.0
_HEADER = struct.Struct(">II")
_MAX_JSON_BYTES = 16 << 20    # a reply (the handshake's blob is NIXL agent metadata)
_MAX_BLOB_BYTES = 64 << 20
# What a server reads of a request before it can check its MAC: requests carry ids, never a blob, so an
# unauthenticated peer cannot make the server hold more than this per connection.
MAX_REQUEST_JSON_BYTES = 4 << 20
MAX_REQUEST_BLOB_BYTES = 64 << 10
MAX_CONNECTIONS = 64          # served at once; more are closed at once (a flood costs no threads)
MAX_CLOCK_SKEW_S = 60.0

# handler(message, blob) -> (reply, reply_blob)
Handler = Callable[[dict[str, Any], bytes], tuple[dict[str, Any], bytes]]


def _recv_exact(sock: socket.socket, num_bytes: int, deadline: float | None = None) -> bytes:
    chunks, remaining = [], num_bytes
    while remaining:
        if deadline is not None:  # one deadline for the whole reply, not one per recv
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("side channel: no complete reply before the deadline")
            sock.settimeout(left)
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise ConnectionError(f"side channel: peer closed after {num_bytes - remaining} of {num_bytes} bytes")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def send_message(sock: socket.socket, message: dict[str, Any], blob: bytes = b"") -> None:
    body = json.dumps(message).encode()
    sock.sendall(_HEADER.pack(len(body), len(blob)) + body + blob)


def recv_message(sock: socket.socket, deadline: float | None = None, max_json_bytes: int = _MAX_JSON_BYTES,
                 max_blob_bytes: int = _MAX_BLOB_BYTES) -> tuple[dict[str, Any], bytes]:
    json_len, blob_len = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if json_len > max_json_bytes or blob_len > max_blob_bytes:
        raise ConnectionError(f"side channel: oversized message ({json_len} + {blob_len} bytes)")
    message = json.loads(_recv_exact(sock, json_len, deadline))
    if not isinstance(message, dict):
        raise ConnectionError("side channel: message is not a JSON object")
    return message, _recv_exact(sock, blob_len, deadline)


def _mac(key: str, message: dict[str, Any], blob: bytes) -> str:
    signed = {k: v for k, v in message.items() if k != "auth"}
    payload = json.dumps(signed, sort_keys=True).encode() + hashlib.sha256(blob).digest()
    return hmac.new(key.encode(), payload, hashlib.sha256).hexdigest()


def sign(message: dict[str, Any], blob: bytes, key: str | None) -> dict[str, Any]:
    if key is None:
        return message
    message = {**message, "ts": time.time()}
    return {**message, "auth": _mac(key, message, blob)}


def verify(message: dict[str, Any], blob: bytes, key: str | None) -> str | None:
    """Why the message is refused, or None when it may be served."""
    if key is None:
        return None
    auth, ts = message.get("auth"), message.get("ts")
    if not isinstance(auth, str) or not hmac.compare_digest(auth.encode(), _mac(key, message, blob).encode()):
        return "not authorized (wrong or missing router key)"
    if not isinstance(ts, (int, float)) or abs(time.time() - ts) > MAX_CLOCK_SKEW_S:
        return f"not authorized (message timestamp more than {MAX_CLOCK_SKEW_S:g} s off)"
    return None


def request(host: str, port: int, message: dict[str, Any], blob: bytes = b"",
            timeout: float = DEFAULT_TIMEOUT_S, key: str | None = None) -> tuple[dict[str, Any], bytes]:
    """Send one message (signed with `key` if given) and wait for the reply; blocking, so call it off
    the engine thread. `timeout` bounds the whole exchange (connect, send, reply), not each call."""
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        send_message(sock, sign({"version": PROTOCOL_VERSION, **message}, blob, key), blob)
        return recv_message(sock, deadline)


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 128   # the listen backlog (socketserver's 5 makes a burst of Ds retry SYNs for seconds)

    def __init__(self, address: tuple[str, int], handlers: dict[str, Handler], key: str | None,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.handlers, self.key, self.max_connections = handlers, key, max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, _RequestHandler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            logger.warning("side channel: %d connections open; refusing %s", self.max_connections, client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)   # a thread that releases the slot
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _RequestHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(DEFAULT_TIMEOUT_S)
        try:  # one deadline for the whole request: a peer that trickles bytes is cut off too
            message, blob = recv_message(sock, time.monotonic() + DEFAULT_TIMEOUT_S, MAX_REQUEST_JSON_BYTES,
                                         MAX_REQUEST_BLOB_BYTES)
        except (OSError, ValueError, RecursionError) as e:
            logger.warning("side channel: bad request from %s: %s", self.client_address, e)
            return
        kind = message.get("type")
        handler = self.server.handlers.get(kind) if isinstance(kind, str) else None  # type: ignore[attr-defined]
        refusal = verify(message, blob, self.server.key)  # type: ignore[attr-defined]
        if refusal is not None:
            logger.warning("side channel: %s from %s refused: %s", kind, self.client_address, refusal)
            reply, reply_blob = {"ok": False, "error": f"side channel: {refusal}"}, b""
        elif message.get("version") != PROTOCOL_VERSION:
            reply, reply_blob = {"ok": False, "error": f"side channel: protocol version "
                                 f"{message.get('version')!r}, expected {PROTOCOL_VERSION}"}, b""
        elif handler is None:
            reply, reply_blob = {"ok": False, "error": f"side channel: unknown message type {kind!r}"}, b""
        else:
            try:
                reply, reply_blob = handler(message, blob)
            except Exception as e:  # a bad request ends that request, not the server
                logger.exception("side channel: %s handler failed", kind)
                reply, reply_blob = {"ok": False, "error": f"{type(e).__name__}: {e}"}, b""
        try:
            send_message(sock, reply, reply_blob)
        except OSError as e:
            logger.warning("side channel: could not reply to %s: %s", self.client_address, e)


class SideChannelServer:
    """A TCP server in a background thread; binds at construction (port 0: a free port)."""

    def __init__(self, host: str, port: int, handlers: dict[str, Handler], key: str | None = None,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self._server = _Server((host, port), handlers, key, max_connections)
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"pdserve-side-channel-{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=DEFAULT_TIMEOUT_S)


class PeerClient:
    """The client side for one peer address: one thread for handshakes, claims, releases and done
    notices (so one P that accepts and never answers holds up only its own requests, and messages to
    one P keep their order), one for heartbeats (so a slow claim never delays a lease's extension)."""

    def __init__(self, address: tuple[str, int], key: str | None, timeout: float, events: queue.SimpleQueue,
                 clock: Callable[[], float]) -> None:
        self.address, self._key, self._timeout, self._events, self._clock = address, key, timeout, events, clock
        self._lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"pdserve-kv-{lane}-{address[1]}")
                       for lane in ("client", "heartbeat")]
        self.num_pending = self.num_heartbeats_pending = 0  # engine thread only
        self.last_used = clock()

    def send(self, message: dict[str, Any], on_reply: Callable, on_error: Callable | None = None,
             accept_refusal: bool = False) -> None:
        """Queue one exchange; the outcome goes to `events` as (self, message, on_reply, on_error,
        (reply, blob, sent_at)) or (self, message, on_error, None, (cause,)), for the owner's thread to
        run (lifecycle.Loader.step). A reply with ok=false counts as an error unless accept_refusal."""
        self.num_pending += 1
        self.num_heartbeats_pending += message["type"] == "heartbeat"
        self.last_used = self._clock()

        def run() -> None:
            sent_at = self._clock()
            try:
                reply, blob = request(*self.address, message, timeout=self._timeout, key=self._key)
                if not reply.get("ok") and not accept_refusal:
                    raise RuntimeError(f"refused: {reply.get('error')}")
                event = (self, message, on_reply, on_error, (reply, blob, sent_at))
            except Exception as e:  # every error, not only OSError: none may vanish in a Future
                logger.warning("%s to %s:%d failed: %s: %s", message["type"], *self.address, type(e).__name__, e)
                # A refused connection is told apart: nothing listens there (the push handoff's D takes
                # that for a P that is gone; any other failure may have reached the peer).
                cause = (CAUSE_TIMEOUT if isinstance(e, TimeoutError) else
                         CAUSE_REFUSED if isinstance(e, ConnectionRefusedError) else "its side channel failed")
                event = (self, message, on_error, None, (cause,))
            self._events.put(event)
        try:
            self._lanes[message["type"] == "heartbeat"].submit(run)
        except RuntimeError:  # shut down
            pass

    def close(self) -> None:
        for lane in self._lanes:
            lane.shutdown(wait=False, cancel_futures=True)


class PeerClients:
    """One PeerClient per peer address, made on first use and closed once idle."""

    def __init__(self, key: str | None, timeout: float, events: queue.SimpleQueue, clock: Callable[[], float]) -> None:
        self._key, self._timeout, self._events, self._clock = key, timeout, events, clock
        self._clients: dict[tuple[str, int], PeerClient] = {}

    def get(self, address: tuple[str, int]) -> PeerClient:
        if address not in self._clients:
            self._clients[address] = PeerClient(address, self._key, self._timeout, self._events, self._clock)
        return self._clients[address]

    def sweep(self, in_use: set[tuple[str, int]], idle_s: float) -> None:
        now = self._clock()
        for address, client in list(self._clients.items()):
            if address not in in_use and not client.num_pending and now - client.last_used > idle_s:
                client.close()
                del self._clients[address]

    def values(self):
        return self._clients.values()

    def __len__(self) -> int:
        return len(self._clients)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
