"""How the decode kernel splits keys at small batches: the split count is fixed per batch size (a
captured graph serves every context), so it must leave each split few tiles past 2,048 tokens."""
import pytest

from pdserve.model import triton_attention as ta  # the split policy is plain Python: no Triton needed

H200_SMS = 132


def test_batch_one_splits_a_4k_context_into_single_tiles():
    """At batch 1 on the 8B shape (8 KV heads) every split of a 4,096-token context is one key tile:
    with 16 splits of 128-token tiles the step from 2,048 to 2,064 tokens took a layer from 9.4 to
    13.2 us on an H200, with 64 splits of 64-token tiles 9.1 to 9.2 (gpu-split-sweep-2026-11-30.json)."""
    splits = ta.decode_num_splits(1, 8, H200_SMS)
    assert splits * ta.decode_launch_config(splits, ieee=False)["BLOCK_N"] >= 4096


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_small_batches_take_the_light_split_tiles(batch):
    splits = ta.decode_num_splits(batch, 8, H200_SMS)
    assert ta.decode_launch_config(splits, ieee=False) == ta.DECODE_SPLIT_CONFIG


@pytest.mark.parametrize("batch", [16, 64, 256])
def test_larger_batches_keep_the_pipelined_tiles(batch):
    splits = ta.decode_num_splits(batch, 8, H200_SMS)
    assert splits < ta.SPLIT_CONFIG_MIN_SPLITS
    assert ta.decode_launch_config(splits, ieee=False) == ta.DECODE_CONFIG


def test_split_counts_fill_the_gpu_twice_over():
    for batch, splits in ((1, 64), (2, 32), (4, 16), (8, 8), (16, 4), (64, 1)):
        assert ta.decode_num_splits(batch, 8, H200_SMS) == splits
