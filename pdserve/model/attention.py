"""Paged attention over the KV cache.

KV cache layout (chosen for the handoff): ONE tensor for the whole model,
    kv_cache = torch.empty(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    # [blocks, layers, k/v, slots, heads, dim]
so a block holds every layer's K and V for block_size tokens, contiguous in memory: a run of
consecutive block ids is one contiguous byte range, one transfer descriptor. Layer i sees the view
kv_cache[:, i]  # [blocks, 2, slots, heads, dim]

Two implementations behind write_kv(), rope_and_write_kv() and paged_attention():
  triton     (model/triton_attention.py) on CUDA: paged flash attention straight from the cache, GQA
             packed, split-K for decode; its write_kv skips negative slots (padded CUDA-graph rows).
  reference  plain torch, the ground truth the fast paths are tested against; used on CPU only where the
             C kernels cannot serve (model/cpu_kernels.py: decode rows and prefill chunks, float32, read
             straight from the cache), BACKEND is "reference" or no compiler built them.
BACKEND picks: "auto" (triton on CUDA when Triton imports, else reference with the CPU kernel),
"triton" (also on CPU under TRITON_INTERPRET=1, for tests) or "reference" (plain torch only). Its
default comes from $PDSERVE_ATTENTION_BACKEND.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.model import cpu_kernels, layers, triton_attention
from pdserve.model.host_copy import to_device
from pdserve.model.layers import apply_rotary

BACKENDS = ("auto", "triton", "reference")
BACKEND = os.environ.get("PDSERVE_ATTENTION_BACKEND", "auto")
if BACKEND not in BACKENDS:
    raise ValueError(f"PDSERVE_ATTENTION_BACKEND: expected one of {BACKENDS}, got {BACKEND!r}")


def use_triton(x: torch.Tensor) -> bool:
    """Whether the fast kernels serve tensors on x's device under the current BACKEND."""
    if BACKEND == "reference" or not triton_attention.is_available():
        return False
    return BACKEND == "triton" or x.is_cuda


@dataclass
class AttentionMetadata:
    """A flattened batch of num_tokens query tokens from num_seqs sequences (no padding).

    Sequence i owns query tokens [query_start_loc[i], query_start_loc[i+1]); those are its
    positions [seq_lens[i] - query_len_i, seq_lens[i]); its earlier tokens are already in the cache.
    """
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32, on the model's device
    seq_lens: torch.Tensor          # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor      # [num_seqs, max_num_blocks] int32, padded with 0
    slot_mapping: torch.Tensor      # [num_tokens] int64: block_id * block_size + offset
    query_lens_cpu: list[int]       # host copies so the reference path needs no device sync
    seq_lens_cpu: list[int]
    block_size: int
    # How many leading sequences are decodes (their one token sampled by the step before); the one-token
    # prefill chunks after them go to the prefill kernel on CPU. None: every leading one-token sequence.
    decodes: int | None = None
    # Derived once per step, not per layer:
    num_decodes: int = field(init=False)    # leading sequences with one query token (the runner puts them first)
    cpu_decodes: int = field(init=False)    # of those, the ones the CPU decode kernel takes
    max_query_len: int = field(init=False)  # 1: a decode-only batch
    _chunks: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        n = 0
        for query_len in self.query_lens_cpu:
            if query_len != 1:
                break
            n += 1
        self.num_decodes = n
        self.cpu_decodes = n if self.decodes is None else min(n, self.decodes)
        self.max_query_len = max(self.query_lens_cpu, default=1)

    def chunks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sequences after the decodes that have query tokens (prefill chunks), for the CPU
        prefill kernel: (block_tables [n, max_blocks], query_start [n + 1] token offsets, seq_lens [n]).
        Made once per step, on first use by a layer."""
        if self._chunks is None:
            seqs = [i for i in range(self.cpu_decodes, len(self.query_lens_cpu)) if self.query_lens_cpu[i] > 0]
            starts = [sum(self.query_lens_cpu[:self.cpu_decodes])]
            for i in seqs:
                starts.append(starts[-1] + self.query_lens_cpu[i])
            index = torch.tensor(seqs, dtype=torch.long)
            self._chunks = (self.block_tables.index_select(0, index.to(self.block_tables.device)),
                            torch.tensor(starts, dtype=torch.int32),
                            torch.tensor([self.seq_lens_cpu[i] for i in seqs], dtype=torch.int32))
        return self._chunks


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, block_size: int) -> None:
    """Store this step's keys and values in the cache, in place.

    kv_layer: [blocks, 2, slots, kv_heads, dim] (the view kv_cache[:, layer]); k, v: [T, kv_heads, dim];
    token t goes to block slot_mapping[t] // block_size, slot slot_mapping[t] % block_size.
    On the fast path a negative slot writes nothing (the reference path never sees one).
    """
    if use_triton(k):
        triton_attention.write_kv_triton(kv_layer, k, v, slot_mapping, block_size)
        return
    block_ids = slot_mapping // block_size  # [T]
    offsets = slot_mapping % block_size     # [T]
    kv_layer[block_ids, 0, offsets] = k
    kv_layer[block_ids, 1, offsets] = v


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_layer: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """Rotary embedding on q and k, then write_kv of the rotated k and v. Returns the rotated q.

    q: [T, heads, dim], k, v: [T, kv_heads, dim]; cos, sin: [T, 1, dim/2] from RotaryEmbedding.
    The fast path is one kernel that rotates q in place (q may be a view of the fused qkv output).
    """
    if use_triton(q):
        triton_attention.rope_write_kv_triton(q, k, v, cos, sin, kv_layer, slot_mapping, block_size)
        return q
    if (BACKEND != "reference" and not q.is_cuda and layers.CPU_FUSED_OPS
            and cpu_kernels.rope_write_kv(q, k, v, cos, sin, kv_layer, slot_mapping)):
        return q
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    write_kv(kv_layer, k, v, slot_mapping, block_size)
    return q


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, md: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attention of a flattened mixed batch over the paged cache (this step's K/V already written).

    q: [T, heads, dim]; kv_layer: [blocks, 2, slots, kv_heads, dim]; returns [T, heads, dim].
    Query token j of sequence i sits at position seq_len_i - query_len_i + j and attends to every
    position <= its own (causal inside the new tokens, full over the cached prefix). GQA when
    heads > kv_heads.
    """
    if use_triton(q):
        # Host lists choose tile shapes only (1 = a decode-only batch): no device sync.
        return triton_attention.paged_attention_triton(
            q, kv_layer, md.query_start_loc, md.seq_lens, md.block_tables, md.block_size, scale,
            md.max_query_len, num_decodes=md.num_decodes)
    out = torch.empty_like(q)
    n = md.cpu_decodes   # the runner puts decodes first: sequences [0, n) are query tokens [0, n)
    if BACKEND == "reference" or q.is_cuda:
        return paged_attention_reference(q, kv_layer, md, scale, out=out)
    if n and not cpu_kernels.decode_attention(q[:n], kv_layer, md.block_tables[:n], md.seq_lens[:n], scale, out[:n]):
        return paged_attention_reference(q, kv_layer, md, scale, out=out)
    if n == len(md.seq_lens_cpu):
        return out
    block_tables, query_start, seq_lens = md.chunks()
    if cpu_kernels.prefill_attention(q, kv_layer, block_tables, query_start, seq_lens, scale, out):
        return out
    return paged_attention_reference(q, kv_layer, md, scale, out=out, num_done=n)


def paged_attention_reference(q: torch.Tensor, kv_layer: torch.Tensor, md: AttentionMetadata,
                              scale: float, out: torch.Tensor | None = None, num_done: int = 0) -> torch.Tensor:
    """Plain torch: every single-token (decode) sequence in one padded gather + one SDPA call;
    each multi-token (prefill chunk) sequence in its own SDPA call. Reads only host lists for
    control flow, so it makes no device sync. num_done: the leading decode sequences already in out."""
    if out is None:
        out = torch.empty_like(q)
    decode_seq_ids: list[int] = []
    decode_token_ids: list[int] = []
    token_start = 0
    # On CPU a per-sequence loop beats the padded gather: it copies exactly seq_len positions and needs
    # no mask (measured on the default model, batch 64 x ~300 tokens: 0.85-1.1 s per decode step padded).
    batch_decodes = q.is_cuda
    for seq_id, (query_len, seq_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
        if seq_id < num_done:
            pass
        elif query_len == 1 and batch_decodes:
            decode_seq_ids.append(seq_id)
            decode_token_ids.append(token_start)
        elif query_len > 0:
            token_end = token_start + query_len
            out[token_start:token_end] = _prefill_attention(
                q[token_start:token_end], kv_layer, md.block_tables[seq_id], seq_len, md.block_size, scale)
        token_start += query_len
    if not decode_seq_ids:
        return out
    if len(decode_seq_ids) == len(md.seq_lens_cpu):  # a pure decode batch: no gather of the inputs
        out[:] = _decode_attention(q, kv_layer, md.block_tables, md.seq_lens,
                                   max(md.seq_lens_cpu), md.block_size, scale)
        return out
    seq_index = to_device(decode_seq_ids, torch.long, q.device)
    token_index = to_device(decode_token_ids, torch.long, q.device)
    out[token_index] = _decode_attention(
        q[token_index], kv_layer, md.block_tables[seq_index], md.seq_lens[seq_index],
        max(md.seq_lens_cpu[i] for i in decode_seq_ids), md.block_size, scale)
    return out


def _prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor,
                       seq_len: int, block_size: int, scale: float) -> torch.Tensor:
    """One sequence's chunk. q: [query_len, heads, dim]; block_table: [max_num_blocks]."""
    query_len = q.shape[0]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks]
    # index_select, not advanced indexing: on CPU it is ~5x faster for these strided block views.
    k = torch.index_select(kv_layer[:, 0], 0, blocks).flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, dim]
    v = torch.index_select(kv_layer[:, 1], 0, blocks).flatten(0, 1)[:seq_len]
    if query_len == 1:  # a decode: the one query sees every key
        mask, is_causal = None, False
    elif query_len == seq_len:  # no cached prefix: plain causal
        mask, is_causal = None, True
    else:  # query j at position seq_len - query_len + j sees keys 0 .. that position
        key_pos = torch.arange(seq_len, device=q.device)
        query_pos = key_pos[seq_len - query_len:]
        mask, is_causal = key_pos[None, :] <= query_pos[:, None], False  # [query_len, seq_len]
    # 4-D [1, heads, len, dim]: on CPU only 4-D inputs take the fused (flash) kernel, 3-D ones fall
    # back to a path up to 30x slower.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [query_len, heads, dim]


def _decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, max_seq_len: int, block_size: int,
                      scale: float) -> torch.Tensor:
    """n single-token queries, padded to the longest context. q: [n, heads, dim];
    block_tables: [n, max_num_blocks]; seq_lens: [n] (device)."""
    num_blocks = -(-max_seq_len // block_size)
    blocks = block_tables[:, :num_blocks]                                   # [n, num_blocks]
    k = kv_layer[:, 0][blocks].flatten(1, 2)[:, :max_seq_len]                # [n, L, kv_heads, dim]
    v = kv_layer[:, 1][blocks].flatten(1, 2)[:, :max_seq_len]
    mask = torch.arange(max_seq_len, device=q.device)[None, :] < seq_lens[:, None]  # [n, L]
    # Padded slots hold stale or never-written memory (maybe NaN, and 0 * NaN = NaN): zero them.
    k = torch.where(mask[:, :, None, None], k, 0)
    v = torch.where(mask[:, :, None, None], v, 0)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),  # [n, heads, 1, dim], [n, kv_heads, L, dim]
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return out[:, :, 0]  # [n, heads, dim]
