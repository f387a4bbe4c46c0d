"""A decode hop's SSE stream, relayed to the client whole event by whole event, keeping what a recovery needs.

pdserve instances write whole events (`data: {...}\\n\\n`); one read from the socket may hold several, or part
of one. The relay forwards only whole events, so a hop that dies mid-event leaves nothing half-sent to the
client. Of each event it notes, from the bytes alone (no JSON parse on the usual path):
  - the tokens of the event, in the top-level `router_token_ids` the router asks for (the event's last key),
    cut off before the event goes on: the client never sees them (its own `return_token_ids` are untouched);
  - a finish reason; the instance's own error event and the [DONE] after it, held back (a recovery may
    make them moot); [DONE] after a normal end goes on as it came.
JSON escapes every quote inside a string, so `,"router_token_ids":[` or `"finish_reason":"` never match text.
An event with output but no token ids (an instance that does not report them) makes the stream
untracked: it cannot be resumed.
Events of a resumed hop are parsed and rewritten with the id, created and model of the stream the client
has been reading (a resumed hop is rare: the usual path parses nothing).
"""
from __future__ import annotations

import json

from pdserve.protocol import SSE_DONE

ROUTER_TOKEN_IDS = b',"router_token_ids":['
FINISHED = b'"finish_reason":"'
CHOICES = b'"choices":[{'
ROLE_CHUNK = b'"delta":{"role":"assistant","content":""}'
# An event whose output is tokens alone (text held back, e.g. the start of a possible stop string): the router
# needs its ids, the client would get an empty chunk (its own token_ids, when it asked, come before `}]`).
NO_OUTPUT = (b'"text":"","logprobs":null,"finish_reason":null}]',
             b'"delta":{},"logprobs":null,"finish_reason":null}]')
ERROR = b'data: {"error":'
DONE = SSE_DONE[:-2]
MAX_EVENT_BYTES = 4 << 20   # one step's output of one request is far smaller; a stream without ends is not SSE
RECOVERABLE_ERROR_CODES = frozenset({500, 502, 503})   # not 504: the request's own deadline ran out


class MalformedStream(Exception):
    """The backend's stream is not what a pdserve instance writes."""


class StreamRelay:
    def __init__(self) -> None:
        self.token_ids = bytearray()        # every token id so far, comma-separated (parsed only to resume)
        self.num_tokens = 0
        self.is_finished = False            # a finish reason went to the client
        self.is_tracked = True              # every event with output carried its token ids
        self.is_done = False                # this hop's [DONE] arrived
        self.error_event: bytes | None = None   # this hop's own error event, held back
        self._first_event: bytes | None = None  # the client's first event: its id, created and model
        self._rewrite: dict | None = None       # on a resumed hop: those three
        self._pending = b""

    def start_hop(self, is_resumed: bool) -> None:
        """A new hop's stream begins; a resumed one (after another hop failed) speaks for the first."""
        self._pending, self.error_event, self.is_done = b"", None, False
        if is_resumed and self._rewrite is None and self._first_event is not None:
            first = json.loads(self._first_event[len(b"data: "):])
            self._rewrite = {key: first.get(key) for key in ("id", "created", "model")}

    def resume_token_ids(self) -> list[int]:
        return json.loads(b"[" + self.token_ids + b"]")

    @property
    def error_code(self) -> int | None:
        try:
            return json.loads(self.error_event[len(b"data: "):])["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return None

    @property
    def error_is_recoverable(self) -> bool:
        return self.error_code in RECOVERABLE_ERROR_CODES

    def feed(self, chunk: bytes) -> bytes:
        """The whole events that `chunk` completes, as the client is to see them; keeps the rest."""
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            if len(data) > MAX_EVENT_BYTES:
                raise MalformedStream(f"an SSE event of more than {MAX_EVENT_BYTES} bytes")
            self._pending = data
            return b""
        self._pending = data[end + 2:]
        if end + 2 == len(data) and data.find(b"\n\n") == end:   # one whole event: the usual read
            return self._event(data[:end])
        return b"".join([self._event(event) for event in data[:end].split(b"\n\n") if event])

    def _event(self, event: bytes) -> bytes:
        if event == DONE:
            self.is_done = True
            return b"" if self.error_event is not None else SSE_DONE
        if event.startswith(ERROR):
            self.error_event = event + b"\n\n"
            return b""
        if self.is_done or self.error_event is not None:
            raise MalformedStream("an event after the end of the stream")
        if self._first_event is None:
            self._first_event = event
        i = event.find(ROUTER_TOKEN_IDS)
        if i >= 0:
            j = event.find(b"]", i)
            if j < 0:
                raise MalformedStream("an unterminated router_token_ids")
            ids = event[i + len(ROUTER_TOKEN_IDS):j]
            if ids:
                if self.token_ids:
                    self.token_ids += b","
                self.token_ids += ids
                self.num_tokens += ids.count(b",") + 1
            event = event[:i] + event[j + 1:]
            if event.endswith(NO_OUTPUT, 0, len(event) - 1):   # (before the event's closing brace)
                return b""
        elif CHOICES in event and FINISHED not in event and ROLE_CHUNK not in event:
            self.is_tracked = False
        if FINISHED in event:
            self.is_finished = True
        if self._rewrite is not None:
            if ROLE_CHUNK in event and i < 0:   # a hop resumed before any token: the client has its role chunk
                return b""
            payload = json.loads(event[len(b"data: "):])
            payload.update(self._rewrite)
            event = b"data: " + json.dumps(payload, separators=(",", ":")).encode()
        return event + b"\n\n"
