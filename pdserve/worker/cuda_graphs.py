"""CUDA graphs for pure-decode steps: one graph per batch-size bucket, replayed with new inputs.

A decode step of a large model is hundreds of small kernel launches; launched one by one from Python
they cost more than the kernels themselves at small batch. Captured once into a graph, a step is
one replay.

Lifecycle:
  1. capture(): for each bucket, largest first, run the model twice (compiles Triton kernels, sets up
     cuBLAS), then capture input → model → logits into a graph; all graphs share one memory pool.
     The inputs are static buffers; during capture every slot is -1, so nothing is written to the cache.
  2. run(): pad the batch to its bucket, copy the inputs into the static buffers (pinned host memory,
     non-blocking), replay, return the first n rows of the bucket's logits.
     A padded row has slot -1 (write_kv skips it) and context length 1 (it reads the block in column 0
     of its table row, an id written there earlier or the initial 0: always a real block); its logits
     are never looked at.
The attention kernels read the context lengths and block tables from device memory and choose their
split count from the batch size alone, so one capture serves any context length up to the table width.
"""
from __future__ import annotations

import torch

from pdserve.model.attention import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes to capture for an instance running at most max_num_seqs requests: powers of two up
    to 256, then steps of 128 (padding a 300-request batch to 512 would waste 40 % of the step)."""
    small = [b for b in BUCKETS if b < max_num_seqs]
    large = [b for b in BUCKETS if b >= max_num_seqs][:1] or \
        list(range(BUCKETS[-1] + 128, max_num_seqs + 128, 128))
    return tuple(small + large)


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, max_blocks_per_seq: int,
                 buckets: tuple[int, ...] = BUCKETS) -> None:
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.buckets = tuple(sorted(buckets))
        self.max_batch_size = self.buckets[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        dev = kv_cache.device
        n = self.max_batch_size
        # Static inputs. ids | positions | slots are packed so one copy fills them: for bucket b the
        # views are flat[0:b], flat[b:2b], flat[2b:3b] (each contiguous).
        self.token_inputs = torch.zeros(3 * n, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)  # one token each
        self.pin_memory = dev.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket holding num_seqs; None when the batch is too large for any graph."""
        for size in self.buckets:
            if size >= num_seqs:
                return size
        return None

    def can_run(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.max_batch_size and max_blocks <= self.max_blocks_per_seq

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.buckets):
            self.token_inputs[:2 * size].zero_()            # token 0 at position 0
            self.token_inputs[2 * size:3 * size].fill_(-1)  # every slot of the capture batch: no write
            for _ in range(2):  # warm-up outside the graph: Triton compilation, cuBLAS workspaces
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def _forward(self, size: int) -> torch.Tensor:
        flat = self.token_inputs
        md = AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=flat[2 * size:3 * size],
            query_lens_cpu=[1] * size, seq_lens_cpu=[1] * size, block_size=self.block_size)
        hidden = self.model(flat[:size], flat[size:2 * size], md, self.kv_cache)  # [size, hidden]
        return self.model.compute_logits(hidden)                                  # [size, vocab] fp32

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
            seq_lens: list[int], block_tables: torch.Tensor,
            fill: tuple[torch.Tensor | slice, torch.Tensor] | None = None) -> torch.Tensor:
        """One decode token per sequence; block_tables: [n, width] int32 on the host (pinned on CUDA).
        fill: (rows: a slice or an index tensor on the device, token ids on the device), written
        over input_ids' placeholders at those rows.
        Returns the logits [n, vocab] (a view of the graph's output, valid until the next replay)."""
        num_seqs = len(input_ids)
        size = self.bucket(num_seqs)
        pad = size - num_seqs
        tokens = torch.tensor(input_ids + [0] * pad + positions + [0] * pad + slot_mapping + [-1] * pad,
                              dtype=torch.long, pin_memory=self.pin_memory)
        lens = torch.tensor(seq_lens + [1] * pad, dtype=torch.int32, pin_memory=self.pin_memory)
        self.token_inputs[:3 * size].copy_(tokens, non_blocking=True)
        if fill is not None:
            self.token_inputs[fill[0]] = fill[1]
        self.seq_lens[:size].copy_(lens, non_blocking=True)
        # Columns past width and padded rows keep earlier valid block ids: a padded row (context 1)
        # reads only its column 0, a real row only its own blocks.
        self.block_tables[:num_seqs, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.graphs[size].replay()
        return self.logits[size][:num_seqs]
