"""The pull handoff over NIXL with KV in VRAM: P's progress thread runs on a CUDA host too, and a READ
completes exactly while only D steps (P inside a long step) and while P's thread is the only progress."""
from __future__ import annotations

import time

import pytest
import torch

from pdserve.kv_transfer.pull import PullConnectorMeta, SendSpec
from tests.kv_transfer.helpers import KV_SHAPE, assert_idle, nixl_available, poll, recv_spec, worker_factory

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not nixl_available(), reason="needs NIXL")]


@pytest.fixture
def make_worker():
    yield from worker_factory("nixl")


def test_reads_from_vram_complete_while_p_steps_only_through_its_progress_thread(make_worker):
    p_cache = torch.randn(KV_SHAPE, device="cuda")
    p = make_worker("producer", kv_cache=p_cache.clone())
    d = make_worker("consumer", kv_cache=torch.zeros(KV_SHAPE, device="cuda"))
    assert p._progress is not None   # on CUDA hosts too
    for n, blocks in enumerate(([1, 2], [3, 4, 5], list(range(10, 30)))):
        local = list(range(2, 2 + len(blocks)))
        p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec(f"p{n}", blocks)]))
        d.start_load_kv(PullConnectorMeta(reqs_to_recv=[recv_spec(f"d{n}", p, local, blocks,
                                                                   p_request_id=f"p{n}")]))
        poll([p, d] if n == 0 else [d], lambda s, r: f"d{n}" in r, timeout=10.0)
        assert d.get_block_ids_with_load_errors() == set()
        assert torch.equal(d._kv_cache[local], p_cache[blocks])
        poll([p], lambda s, r: f"p{n}" in s)
    assert_idle(p, d)


def test_shutdown_stops_the_progress_thread_of_a_p_holding_vram_blocks(make_worker):
    p = make_worker("producer", kv_cache=torch.randn(KV_SHAPE, device="cuda"))
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec("p-req", [3, 4])]))
    poll([p], lambda s, r: p.holder.num_pending() == 1)
    assert p._progress.thread.is_alive()
    started = time.monotonic()
    p.shutdown()
    assert not p._progress.thread.is_alive() and time.monotonic() - started < 1.5
