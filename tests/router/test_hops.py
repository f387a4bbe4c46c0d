"""What the router sends its instances: bodies as UTF-8 JSON (hostile-test findings)."""
from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.http_guard import parse_json
from pdserve.protocol import ProtocolError
from pdserve.router import hops


def encode(body, body_bytes=0):
    async def run():
        hops.BODY_BYTES.set(body_bytes)
        return await hops.encode_json(body)
    return asyncio.run(run())


def test_a_body_goes_as_utf8_not_escaped():
    """json's default escapes made 29 MB of emoji an 88 MB body, encoded on the event loop."""
    body = {"prompt": "héllo 😀" * 3, "max_tokens": 4}
    data = encode(body)
    assert "😀".encode() in data and b"\\u" not in data and json.loads(data) == body
    assert encode(body, body_bytes=10 << 20) == data   # a large body: the same bytes, from a thread


def test_a_lone_surrogate_is_passed_on_escaped_as_it_came():
    body = parse_json(b'{"prompt": "a\\ud800b"}')
    data = encode(body)
    assert b"\\ud800" in data and json.loads(data) == body


def test_an_integer_past_pythons_digit_limit_is_a_plain_400():
    with pytest.raises(ProtocolError) as caught:
        parse_json(b'{"max_tokens": ' + b"9" * 5000 + b"}")
    assert caught.value.status == 400 and "digits" in caught.value.message
    assert "sys." not in caught.value.message and "set_int_max_str_digits" not in caught.value.message
