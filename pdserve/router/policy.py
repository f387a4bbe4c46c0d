"""Which backend of a pool serves the next request: one policy object per pool (prefill, decode, colocated).

A policy answers `pick(exclude)` with a backend URL, or None when every URL of its pool is excluded (the
proxy excludes backends that already failed this request). `release(url)` is called once per successful
`pick`, when the proxy is done with that backend for the request, so that a load-aware policy can count
requests in flight; round-robin ignores it. A prefix-aware policy (pdserve.hashing block hashes of the prompt)
will need the request as well: it will get it as an extra keyword argument of `pick`, defaulting to None.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol


class Policy(Protocol):
    urls: tuple[str, ...]

    def pick(self, exclude: Collection[str] = ()) -> str | None: ...

    def release(self, url: str) -> None: ...


class RoundRobin:
    """Each pick takes the next URL in order, skipping excluded ones."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("urls: a pool needs at least one backend URL")
        self.urls = tuple(urls)
        self._next_index = 0

    def pick(self, exclude: Collection[str] = ()) -> str | None:
        num_urls = len(self.urls)
        for offset in range(num_urls):
            index = (self._next_index + offset) % num_urls
            if self.urls[index] not in exclude:
                self._next_index = (index + 1) % num_urls
                return self.urls[index]
        return None

    def release(self, url: str) -> None:
        pass
