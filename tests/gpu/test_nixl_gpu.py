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


def test_a_staged_read_in_rounds_never_lands_under_a_copy_still_queued():
    """A one-rank D reads a two-rank P's blocks through a staging pool of one block, while the stream is busy:
    each round's copy into the cache is queued behind that work, and the range must stay taken until the
    copy has run (its CUDA event), or the next round's READ (DMA, outside the stream) overwrites it first."""
    import uuid

    from pdserve.kv_transfer.nixl_tp import RankReader
    heads, blocks = 4, 16
    shape = lambda tp: (blocks, 2, 2, 16, heads // tp, 64)  # noqa: E731
    unit = 2 * 2 * 16 * heads * 64 * 4
    made = []

    def reader(rank, tp, cache, staging_bytes=1 << 20):
        r = RankReader.create(f"gpu-staging-{uuid.uuid4().hex[:8]}", False, rank, tp, heads,
                              staging_bytes=staging_bytes)
        made.append(r)
        r.entry = r.register(cache)
        return r
    try:
        p_caches = [torch.randn(shape(2), device="cuda") for _ in range(2)]
        p = [reader(r, 2, c) for r, c in enumerate(p_caches)]
        d = reader(0, 1, torch.zeros(shape(1), device="cuda"), staging_bytes=unit)
        d.connect("P:boot", [x.entry for x in p])
        torch.cuda.synchronize()
        a, b = torch.randn(4096, 4096, device="cuda"), torch.randn(4096, 4096, device="cuda")
        for _ in range(40):   # ~0.1 s of work queued ahead of every copy
            a = a @ b
        local, remote = list(range(8)), list(range(8, 16))
        read_id, state, _ = d.post("P:boot", local, remote)
        deadline = time.monotonic() + 20.0
        while state == "PROC" and time.monotonic() < deadline:
            for x in p:
                x.poll()
            state = d.poll()[read_id]
        assert state == "DONE"
        torch.cuda.synchronize()
        assert torch.equal(d.kv_cache[local], torch.cat([c[remote] for c in p_caches], dim=4))
        d.release(read_id)
    finally:
        for r in reversed(made):
            r.deregister()
