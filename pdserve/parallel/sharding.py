"""Which slice of each weight a tensor-parallel rank holds (Megatron's split, as vLLM and gpt-fast do it).

Column-parallel (split the output rows): q/k/v by heads, gate/up by intermediate rows, the embedding and
the LM head by vocabulary rows. Row-parallel (split the input columns, then all-reduce the partial sums):
o_proj and down_proj; their bias is added once, so rank 0 holds it and the other ranks hold zeros.
Norms and the rotary table are whole on every rank.

A fused weight is several segments stacked along one dimension (qkv_proj = [q; k; v], gate_up_proj =
[gate; up]); each segment is split on its own, so a rank's fused weight is [q_r; k_r; v_r].
The vocabulary is padded with zero rows to a multiple of T: a rank's logits for padding rows are dropped
after the all-gather, and its embedding rows there are never looked up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    dim: int                      # the dimension split among the ranks
    segments: tuple[int, ...]     # full sizes of the consecutive segments along dim, each split evenly
    pad: bool = False             # the vocabulary: one segment, padded to a multiple of the ranks
    driver_only: bool = False     # a row-parallel bias: rank 0 holds it whole, the other ranks zeros


def check_tp_size(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """ValueError naming the model's sizes when `size` ranks cannot split it evenly."""
    if size == 1:
        return
    if num_heads % size or num_kv_heads % size or intermediate_size % size:
        sizes = [t for t in range(1, num_kv_heads + 1)
                 if not num_heads % t and not num_kv_heads % t and not intermediate_size % t]
        raise ValueError(f"tensor_parallel_size: {size} does not divide the model's {num_heads} query heads, "
                         f"{num_kv_heads} KV heads and intermediate size {intermediate_size}; sizes that do: "
                         f"{', '.join(map(str, sizes))}")


def local_vocab_size(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)


def shard_spec(name: str, q_size: int, kv_size: int, intermediate_size: int, vocab_size: int) -> ShardSpec | None:
    """The split of the weight `name` (HF's name or our fused one); None: every rank holds it whole."""
    kind = name.rsplit(".", 1)[-1]  # weight | bias
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return ShardSpec(0, (vocab_size,), pad=True)
    parts = {"qkv_proj": (q_size, kv_size, kv_size), "q_proj": (q_size,), "k_proj": (kv_size,),
             "v_proj": (kv_size,), "gate_up_proj": (intermediate_size, intermediate_size),
             "gate_proj": (intermediate_size,), "up_proj": (intermediate_size,)}
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if module in parts:
        return ShardSpec(0, parts[module])
    if module in ("o_proj", "down_proj"):
        full = q_size if module == "o_proj" else intermediate_size
        return ShardSpec(1, (full,)) if kind == "weight" else ShardSpec(0, (), driver_only=True)
    return None


def shard(tensor: torch.Tensor, spec: ShardSpec | None, rank: int, size: int) -> torch.Tensor:
    """The full `tensor`'s slice for `rank` of `size` (the tensor itself when nothing is split)."""
    if spec is None or size == 1:
        return tensor
    if spec.driver_only:
        return tensor if rank == 0 else torch.zeros_like(tensor)
    if spec.pad:
        rows = local_vocab_size(spec.segments[0], size)
        padded = tensor.new_zeros((rows * size, *tensor.shape[1:]))
        padded[:tensor.shape[0]] = tensor
        return padded[rank * rows:(rank + 1) * rows]
    if tensor.shape[spec.dim] != sum(spec.segments):
        raise ValueError(f"shard: dimension {spec.dim} of a {tuple(tensor.shape)} tensor is not "
                         f"{'+'.join(map(str, spec.segments))}")
    pieces, start = [], 0
    for full in spec.segments:
        local = full // size
        pieces.append(tensor.narrow(spec.dim, start + rank * local, local))
        start += full
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.dim)


def full_shape(local_shape: torch.Size, spec: ShardSpec | None, size: int) -> tuple[int, ...]:
    """The unsplit shape of a parameter whose rank-local shape is `local_shape`."""
    shape = list(local_shape)
    if spec is not None and size > 1 and not spec.driver_only:
        shape[spec.dim] = sum(spec.segments)
    return tuple(shape)
