"""Argument types shared by the command line's parsers (no heavy imports: `pdserve --help` loads these)."""
from __future__ import annotations

import argparse
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str, what: str = "capacity") -> int:
    """'4GiB', '512MB', '1000000' (bytes); '1e9' is refused."""
    match = _SIZE.match(str(text))
    if not match or match.group(2) is not None and match.group(2).lower() not in _UNITS:
        raise ValueError(f"{what}: expected bytes like 4GiB, 512MiB or 1000000, got {text!r}")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def byte_size(text: str) -> int:
    """An argparse type: a positive size in bytes, with or without a unit."""
    try:
        value = parse_bytes(text, "size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def _port(text: str, lowest: int) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not lowest <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is {lowest} to 65535, got {text!r}")
    return port


def port(text: str) -> int:
    """An argparse type: a TCP port to listen on, 1 to 65535."""
    return _port(text, 1)


def port_or_zero(text: str) -> int:
    """An argparse type: a TCP port, or 0 for a free one."""
    return _port(text, 0)
