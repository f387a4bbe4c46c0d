"""Every end-to-end module stops the servers it started."""
from __future__ import annotations

import pytest

from tests.e2e import cluster


@pytest.fixture(scope="module", autouse=True)
def no_server_left_running():
    before = set(cluster.LIVE)
    yield
    left = [p for p in cluster.LIVE - before if p.proc.poll() is None]
    for p in left:
        p.stop()
    assert not left, f"servers left running by this module: {[(p.name, p.proc.pid) for p in left]}"
