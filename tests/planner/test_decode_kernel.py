"""planner/profile.py's decode-kernel term: the decodes' attention as the makespan of the kernel's programs
(docs/planner.md, "Decode steps between graph buckets and over unequal contexts"), in the step model, its
fit, its profile file and the simulator."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from pdserve.planner.profile import (DecodeKernel, StepModel, StepPoint, decode_attention_context,
                                     decode_num_splits, fit_step_model, load_step_model, padded_batches,
                                     step_seconds)
from pdserve.planner.simulator import ClusterSpec, Workload, simulate

H100 = DecodeKernel(kv_heads=8, bandwidth_programs=220.0)   # programs_per_sm 4, 132 SMs


def test_the_split_rule_is_the_kernels():
    attention = pytest.importorskip("pdserve.model.triton_attention")
    for sms in (132, 108, 1):
        for kv_heads in (8, 4, 1):
            for batch in range(1, 600):
                assert decode_num_splits(batch, kv_heads, sms) == attention.decode_num_splits(batch, kv_heads, sms)


def test_an_equal_batch_of_enough_programs_costs_its_summed_context():
    # 64 sequences of 5,000 tokens in the graph of 64: one split, 512 programs, over rho and under 528 slots
    assert decode_attention_context(64, 64 * 5000, 5000, 64, H100) == pytest.approx(64 * 5000)
    # equal lengths recorded as 0 (not measured) are the same batch
    assert decode_attention_context(64, 64 * 5000, 0, 64, H100) == pytest.approx(64 * 5000)
    # batch 16 in its own graph: four splits of 1,250 tokens, 512 programs
    assert decode_attention_context(16, 16 * 5000, 5000, 16, H100) == pytest.approx(16 * 5000)
    # no kernel term: the summed context
    assert decode_attention_context(36, 36 * 5300, 8600, 64, DecodeKernel(8, 0.0)) == 36 * 5300


def test_too_few_programs_run_as_long_as_one_program_alone():
    """33 sequences in the graph of 64 run one split each: 264 programs, below rho = 300, so the step lasts
    one program's time, rho x its length, not the summed context at full bandwidth."""
    kernel = DecodeKernel(kv_heads=8, bandwidth_programs=300.0)
    assert decode_attention_context(33, 33 * 5000, 5000, 64, kernel) == pytest.approx(300 * 5000 / 8)
    # the graph of 32 splits each sequence in two: 512 programs, at bandwidth
    assert decode_attention_context(32, 32 * 5000, 5000, 32, kernel) == pytest.approx(32 * 5000)


def test_unequal_contexts_cost_more_than_their_sum():
    """Worked by hand: one KV head, one SM (so one split), no slot limit, rho = 2; four sequences with
    contexts uniform on [2, 6] (mean 4). The running share falls to rho / n = 1/2 at x = 6 - 4 / 2 = 4:
    sum(min(length, 4)) = 4 x ((4 - 2)(2 + 4) / 2 + (6 - 4) x 4) / 4 = 14, plus rho x (6 - 4) = 4: 18 > 16."""
    kernel = DecodeKernel(kv_heads=1, bandwidth_programs=2.0, programs_per_sm=0, num_sms=1)
    assert decode_num_splits(4, 1, 1) == 1
    assert decode_attention_context(4, 16, 6, 4, kernel) == pytest.approx(18)
    # longer longest, same sum: longer; the 36-sequence batch of docs/planner.md on an H100: +36 %
    assert decode_attention_context(4, 16, 7, 4, kernel) > 18
    assert decode_attention_context(36, 36 * 5300, 8600, 64, H100) / (36 * 5300) == pytest.approx(1.363, abs=1e-3)
    # a longest far above twice the mean: part of the batch is taken as empty, the sum is kept
    assert decode_attention_context(100, 100 * 1000, 9000, 128, H100) >= 100 * 1000


def test_more_programs_than_slots_end_with_a_last_wave():
    """Equal lengths, one KV head, one SM holding 3 programs, rho = 2: 4 programs of 10 tokens run as a wave
    of 3 at bandwidth (30), then the fourth alone at 1/rho of it (2 x 10): 50 against a sum of 40."""
    kernel = DecodeKernel(kv_heads=1, bandwidth_programs=2.0, programs_per_sm=3, num_sms=1)
    assert decode_attention_context(4, 40, 10, 4, kernel) == pytest.approx(50)
    # 80 sequences of 2,048 in the graph of 128 on an H100: 640 programs over 528 slots, 112 left alone
    assert decode_attention_context(80, 80 * 2048, 2048, 128, H100) == pytest.approx((528 + 220) * 2048 / 8)


def test_the_model_file_carries_the_kernel(tmp_path):
    model = StepModel(0.004, 0.0, 2e-5, 3e-8, 0.0, 0.0, 0.007, decode_kernel=H100)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(model.as_dict()))
    loaded = load_step_model(path)
    assert loaded.decode_kernel == H100
    assert loaded.seconds(0, 0, 36, 36 * 5300, 8600, 64) == pytest.approx(model.seconds(0, 0, 36, 36 * 5300, 8600, 64))
    # without the kernel, as before: the summed context, whatever the longest
    plain = dataclasses.replace(model, decode_kernel=None)
    assert "decode_kernel" not in plain.as_dict()
    assert plain.seconds(0, 0, 36, 36 * 5300, 8600, 64) == pytest.approx(0.004 + 2e-5 * 36 + 3e-8 * 36 * 5300)
    assert model.seconds(0, 0, 36, 36 * 5300, 8600, 64) > plain.seconds(0, 0, 36, 36 * 5300, 8600, 64)
    for bad in ({"kv_heads": 0, "bandwidth_programs": 200}, {"kv_heads": 8}, {"kv_heads": 8, "bandwidth_programs": -1},
                [8, 200]):
        path.write_text(json.dumps({**model.as_dict(), "decode_kernel": bad}))
        with pytest.raises(ValueError, match="decode_kernel"):
            load_step_model(path)


def test_the_shipped_profile_has_the_kernel():
    from pdserve.planner.plan import DEFAULT_PROFILE
    model = load_step_model(DEFAULT_PROFILE)
    assert model.decode_kernel is not None and model.decode_kernel.kv_heads == 8
    equal = model.seconds(0, 0, 36, 36 * 5300, 5300, 64)
    assert model.seconds(0, 0, 36, 36 * 5300, 8600, 64) > 1.1 * equal


def test_the_fit_recovers_a_model_with_the_kernel_and_graph_rows():
    true = StepModel(0.004, 0.0, 2e-5, 3e-8, 2e-9, 4e-6, 0.007, decode_kernel=H100)
    rows = padded_batches(512)
    rng = np.random.default_rng(0)
    points = []
    for i in range(60):   # prefills, decode-only steps between buckets with unequal contexts, mixed steps
        p = 0 if i % 2 else int(rng.integers(1, 8000))
        b = int(rng.integers(1, 300))
        longest = int(rng.integers(500, 8000))
        c = b * int(rng.integers(longest // 3, longest)) if b > 1 else longest
        a = p * (p + 1) // 2
        point = StepPoint(p, a, b, c, 1.0, decode_max_context=longest)
        points.append(dataclasses.replace(point, seconds=step_seconds(true, point, rows)))
    fit = fit_step_model(points, decode_kernel=H100, graph_max_num_seqs=512)
    assert fit.max_relative_error < 1e-6 and fit.decode_kernel == H100
    assert fit.per_context_token == pytest.approx(3e-8, rel=1e-6)
    # the summed context alone cannot: it charges neither the tail nor the padded rows
    assert fit_step_model(points).max_relative_error > 0.05


def test_the_simulator_charges_the_longest_decoding_context():
    """Two KV heads on one SM (one split), no slot limit, rho = 8: up to four decoding sequences are fewer
    programs than rho, so their attention lasts rho x the longest context / 2 heads = 4 x the longest.
    A (prompt 10, 5 tokens) and B (prompt 30, 2 tokens) arrive together. Step 1: A's prefill (10 ms).
    Step 2: B's prefill and A's decode at 11: 10 + 0.1 x 4 x 11 = 14.4 ms, ends at 0.0244, B's first token.
    Step 3: A at 12 and B at 31, decode-only: 10 + 0.1 x 4 x 31 = 22.4 ms, ends at 0.0468, B is done.
    Steps 4-5: A alone at 13 and 14: 15.2 and 15.6 ms, A is done at 0.0776 (had B's finished entry stayed on
    top of the heap, 4 x 32 and 4 x 33). Without the kernel: 0.1 ms x the summed context (11, 43, 13, 14)."""
    kernel = DecodeKernel(kv_heads=2, bandwidth_programs=8.0, programs_per_sm=0, num_sms=1)
    assert decode_num_splits(1, 2, 1) == 1
    model = StepModel(fixed=0.01, weights=0.0, per_token=1e-15, per_context_token=1e-4, per_attention_pair=0.0,
                      per_decode_seq=0.0, prefill_step=0.0, decode_kernel=kernel)
    workload = Workload([0.0, 0.0], [10, 30], [5, 2])
    r = simulate(ClusterSpec(num_colocated=1), model, workload)
    assert r.ttft.tolist() == pytest.approx([0.01, 0.0244])
    assert r.finish.tolist() == pytest.approx([0.0776, 0.0468])
    r = simulate(ClusterSpec(num_colocated=1), dataclasses.replace(model, decode_kernel=None), workload)
    assert r.ttft.tolist() == pytest.approx([0.01, 0.0211])
    assert r.finish.tolist() == pytest.approx([0.0211 + 0.0143 + 0.0113 + 0.0114, 0.0354])
