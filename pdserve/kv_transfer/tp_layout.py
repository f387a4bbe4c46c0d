"""Where the ranks of a tensor-parallel instance put their KV heads in a peer's blocks of a whole-model (or fewer
ranks') layout, and how the peer puts them back: shared by the push into a D of fewer ranks (nixl_tp.py) and
the store's commit of a tensor-parallel insert (kv_store/server.py).

A rank's heads are a contiguous part of each slot of its own block, strided in a block holding more heads
([blocks, layers, 2, slots, heads, dim]). So each of the k ranks writes its blocks whole into its k-th of each
run of the peer's blocks (grouped_layout: one descriptor per run), and the peer regroups the run in place
once every part is in (regroup_run).
"""
from __future__ import annotations

import torch

from pdserve.kv_transfer.transport_worker import coalesce

# A push from a bigger P is grouped by runs of D's blocks of at most this many: D's regroup copies a run through
# a buffer of its size, which stays small (e.g. 32 MiB at Llama-3-8B's bf16 block of one rank of two); a longer
# run of D's blocks costs one more descriptor per P rank per MAX_GROUP_BLOCKS.
MAX_GROUP_BLOCKS = 32


def runs_of(block_ids: list[int], max_len: int = MAX_GROUP_BLOCKS) -> list[tuple[int, int]]:
    """(first block, count) of each run of consecutive ids, in order, cut at max_len blocks."""
    return [(start + i, min(max_len, n - i)) for start, _, n in coalesce(block_ids, block_ids)
            for i in range(0, n, max_len)]


def grouped_layout(block_ids: list[int], k: int, part: int) -> list[int]:
    """Where part `part` of k (a P rank, of the k that hold one D rank's heads) writes its blocks in D's
    blocks, in units of 1/k of D's block: each run of n consecutive D blocks takes the k parts one after
    the other, n of our blocks each, so that one descriptor per run moves a part (D regroups afterwards)."""
    out = []
    for start, n in runs_of(block_ids):
        out += [start * k + part * n + i for i in range(n)]
    return out


def regroup_run(run: torch.Tensor, k: int, outer: int) -> None:
    """run: n consecutive blocks as bytes [n, block bytes], written by k parts in grouped_layout (part j's n
    blocks one after the other, each [outer, heads/k bytes]); in place, each block [outer, k, heads/k bytes]:
    the whole-model layout. outer = layers * 2 * slots."""
    n, block_bytes = run.shape
    if block_bytes % (k * outer):
        raise ValueError(f"a block of {block_bytes} bytes is not {k} parts of {outer} rows")
    grouped = run.reshape(-1).view(k, n, outer, block_bytes // (k * outer)).clone()
    run.copy_(grouped.permute(1, 2, 0, 3).reshape(n, block_bytes))
