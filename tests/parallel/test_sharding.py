"""Which slice of each weight a rank holds: every rank's slices put back together are the weight."""
from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig, KVTransferConfig, ParallelConfig
from pdserve.parallel.group import TPGroup
from pdserve.parallel.sharding import ShardSpec, check_tp_size, full_shape, local_vocab_size, shard, shard_spec

Q, KV, INTER, VOCAB = 12, 4, 10, 7


def unshard(pieces: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Inverse of shard(): segment by segment, rank by rank."""
    size = len(pieces)
    if spec.pad:
        return torch.cat(pieces, dim=0)[:spec.segments[0]]
    out, start = [], 0
    for full in spec.segments:
        local = full // size
        out += [p.narrow(spec.dim, start // size, local) for p in pieces]
        start += full
    return torch.cat(out, dim=spec.dim)


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.self_attn.qkv_proj.weight", (Q + 2 * KV, 6)),
    ("layers.3.self_attn.qkv_proj.bias", (Q + 2 * KV,)),
    ("model.layers.0.self_attn.q_proj.weight", (Q, 6)),
    ("model.layers.0.self_attn.k_proj.bias", (KV,)),
    ("model.layers.1.self_attn.o_proj.weight", (6, Q)),
    ("layers.0.mlp.gate_up_proj.weight", (2 * INTER, 6)),
    ("model.layers.0.mlp.down_proj.weight", (6, INTER)),
    ("model.embed_tokens.weight", (VOCAB, 6)),
    ("lm_head.weight", (VOCAB, 6)),
])
def test_every_ranks_slices_put_together_are_the_weight(name, shape):
    spec = shard_spec(name, Q, KV, INTER, VOCAB)
    weight = torch.randn(shape)
    pieces = [shard(weight, spec, rank, 2) for rank in range(2)]
    assert all(full_shape(p.shape, spec, 2) == tuple(shape) for p in pieces)
    assert torch.equal(unshard(pieces, spec), weight)


def test_a_fused_weight_is_split_segment_by_segment():
    spec = shard_spec("layers.0.self_attn.qkv_proj.weight", Q, KV, INTER, VOCAB)
    rows = torch.arange(Q + 2 * KV).unsqueeze(1)   # row i holds i
    rank1 = shard(rows, spec, 1, 2).flatten().tolist()
    assert rank1 == [6, 7, 8, 9, 10, 11, 14, 15, 18, 19]   # its half of q, then of k, then of v


def test_the_vocabulary_is_padded_with_zero_rows_to_a_multiple_of_the_ranks():
    spec = shard_spec("model.embed_tokens.weight", Q, KV, INTER, VOCAB)
    weight = torch.arange(1, VOCAB + 1, dtype=torch.float32).unsqueeze(1)
    pieces = [shard(weight, spec, rank, 3) for rank in range(3)]
    assert local_vocab_size(VOCAB, 3) == 3 and [p.shape[0] for p in pieces] == [3, 3, 3]
    assert pieces[2].flatten().tolist() == [7.0, 0.0, 0.0]


def test_a_row_parallel_bias_is_held_by_rank_0_alone():
    spec = shard_spec("model.layers.0.mlp.down_proj.bias", Q, KV, INTER, VOCAB)
    bias = torch.randn(6)
    assert torch.equal(shard(bias, spec, 0, 2), bias)
    assert not shard(bias, spec, 1, 2).any()
    assert shard_spec("model.layers.0.input_layernorm.weight", Q, KV, INTER, VOCAB) is None


def test_a_size_that_does_not_divide_the_model_is_refused_naming_the_sizes_that_do():
    check_tp_size(3, 9, 3, 1536)
    with pytest.raises(ValueError) as e:
        check_tp_size(2, 9, 3, 1536)
    assert "9 query heads, 3 KV heads and intermediate size 1536" in str(e.value)
    assert "sizes that do: 1, 3" in str(e.value)


def test_the_config_refuses_a_bad_size_and_a_tensor_parallel_pd_instance():
    with pytest.raises(ValueError, match="tensor_parallel_size: must be in"):
        ParallelConfig(tensor_parallel_size=0).validate()
    config = EngineConfig(kv_transfer=KVTransferConfig(kv_connector="cuda_ipc"),
                          parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="not supported yet"):
        config.validate()
    EngineConfig(kv_transfer=KVTransferConfig(kv_connector="nixl-push"),
                 parallel=ParallelConfig(tensor_parallel_size=2)).validate()


def test_one_rank_needs_no_process_group():
    group = TPGroup()
    x = torch.randn(3, 4)
    assert group.all_reduce(x) is x and group.all_gather_last_dim(x) is x and group.broadcast_from_driver(x) is x
    assert group.min_over_ranks(5, torch.device("cpu")) == 5
    with pytest.raises(ValueError):
        TPGroup(2, 2)


def test_each_decode_rank_reads_its_heads_from_the_prefill_ranks_holding_them():
    from pdserve.kv_transfer.nixl_tp import ReadPiece, read_plan
    assert read_plan(2, 1, 2, 8) == [ReadPiece(1, 0, 0, 4)]                      # same size: rank to rank
    assert read_plan(4, 3, 2, 8) == [ReadPiece(1, 2, 0, 2)]                      # a wider P: part of one rank
    assert read_plan(1, 0, 2, 8) == [ReadPiece(0, 0, 0, 4), ReadPiece(1, 0, 4, 4)]   # a narrower P: whole ranks
    assert read_plan(2, 1, 4, 8) == [ReadPiece(2, 0, 0, 2), ReadPiece(3, 0, 2, 2)]
    with pytest.raises(ValueError, match="one must divide the other"):
        read_plan(2, 0, 3, 6)
    # every head of every D rank comes from exactly one place, for every pair of sizes
    for local_tp in (1, 2, 4, 8):
        for remote_tp in (1, 2, 4, 8):
            covered = []
            for rank in range(local_tp):
                for p in read_plan(local_tp, rank, remote_tp, 8):
                    src = p.remote_rank * (8 // remote_tp) + p.src_head
                    dst = rank * (8 // local_tp) + p.dst_head
                    assert src == dst
                    covered += range(dst, dst + p.num_heads)
            assert sorted(covered) == list(range(8))
