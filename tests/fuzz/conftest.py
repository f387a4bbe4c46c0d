"""Fixtures both fuzz modules share: one event loop thread and one ERROR-log collector per module."""
from __future__ import annotations

import pytest

from .common import ErrorLog, LoopThread


@pytest.fixture(scope="module")
def loop():
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def errors():
    log = ErrorLog()
    with log.installed():
        yield log
