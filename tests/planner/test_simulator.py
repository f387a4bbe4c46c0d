"""planner/: the step model's fit, the cluster simulator against queues worked out by hand, and `pdserve plan`."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.cli import main as cli_main
from pdserve.planner.profile import StepModel, StepPoint, fit_step_model, load_step_model
from pdserve.planner.simulator import ClusterSpec, EngineSpec, Workload, simulate

# Every step takes 10 ms, whatever it holds: queues can be followed by hand.
FLAT = StepModel(fixed=0.01, weights=0.0, per_token=1e-15, per_context_token=0.0, per_attention_pair=0.0,
                 per_decode_seq=0.0, prefill_step=0.0)


def run(cluster, arrival, prompt, output, model=FLAT):
    return simulate(cluster, model, Workload(arrival, prompt, output))


def test_one_request_colocated_and_disaggregated():
    r = run(ClusterSpec(num_colocated=1), [0.0], [100], [5])
    # the prefill step makes the first token; four decode steps the rest
    assert r.ttft.tolist() == pytest.approx([0.01]) and r.tpot.tolist() == pytest.approx([0.01])
    r = run(ClusterSpec(num_prefill=1, num_decode=1, handoff_latency_s=0.005, kv_bytes_per_token=1000,
                        handoff_bytes_per_s=1e7), [0.0], [100], [5])
    # P's prefill (10 ms) and the hop to D (5 ms) make the first token: P's, which D sends before it reads
    # the KV (5 ms + 100 x 1000 B at 10 MB/s = 10 ms); then D's four steps the rest
    assert r.ttft.tolist() == pytest.approx([0.015]) and r.finish.tolist() == pytest.approx([0.065])
    r = run(ClusterSpec(num_prefill=1, num_decode=1, handoff_latency_s=0.005), [0.0], [100], [1])
    assert r.ttft.tolist() == r.finish.tolist() == pytest.approx([0.015])   # P's token was the answer


def test_a_request_arriving_during_a_step_waits_for_the_step_after_next():
    """Async scheduling: step 2 was scheduled when step 1 started, so B (arrived during step 1) joins step 3."""
    cluster = ClusterSpec(num_colocated=1, engine=EngineSpec(max_num_batched_tokens=100, enable_chunked_prefill=False))
    r = run(cluster, [0.0, 0.001], [80, 80], [2, 2])
    assert r.ttft.tolist() == pytest.approx([0.01, 0.029])
    assert r.finish.tolist() == pytest.approx([0.02, 0.04])


def test_the_token_budget_chunks_a_long_prompt_or_holds_it_back():
    chunked = ClusterSpec(num_colocated=1, engine=EngineSpec(max_num_batched_tokens=100))
    assert run(chunked, [0.0], [250], [1]).ttft.tolist() == pytest.approx([0.03])   # 100 + 100 + 50
    whole = ClusterSpec(num_colocated=1, engine=EngineSpec(max_num_batched_tokens=100, enable_chunked_prefill=False))
    # without chunking two 60-token prompts do not share a step: the second prefills in the next one
    assert run(whole, [0.0, 0.0], [60, 60], [1, 1]).ttft.tolist() == pytest.approx([0.01, 0.02])


def test_max_num_seqs_and_kv_capacity_hold_requests_back():
    one_seq = ClusterSpec(num_colocated=1, engine=EngineSpec(max_num_seqs=1))
    r = run(one_seq, [0.0, 0.0], [10, 10], [3, 3])
    assert r.ttft.tolist() == pytest.approx([0.01, 0.04])   # B starts when A's three steps are done
    small_kv = ClusterSpec(num_colocated=1, engine=EngineSpec(kv_capacity_tokens=30))
    r = run(small_kv, [0.0, 0.0, 0.0], [10, 10, 40], [10, 10, 1])
    assert r.rejected == 1   # 41 tokens never fit in 30
    assert r.ttft.tolist() == pytest.approx([0.01, 0.11])   # 20 + 20 > 30: B waits for A's KV


def test_short_prompts_skip_prefill_instances_with_pd_min_prompt_tokens():
    cluster = ClusterSpec(num_prefill=1, num_decode=1, pd_min_prompt_tokens=50, handoff_latency_s=0.5,
                          kv_bytes_per_token=0)
    r = run(cluster, [0.0, 1.0], [20, 100], [2, 2])
    assert r.ttft.tolist() == pytest.approx([0.01, 0.51])   # straight to D; through P and a 0.5 s hop


def test_least_load_spreads_and_round_robin_alternates():
    for policy in ("least-load", "round-robin"):
        r = run(ClusterSpec(num_colocated=2, policy=policy), [0.0, 0.0], [10, 10], [1, 1])
        assert r.ttft.tolist() == pytest.approx([0.01, 0.01]), policy   # one each, in parallel


def test_bad_clusters_and_workloads_are_refused():
    model = FLAT
    with pytest.raises(ValueError, match="come together"):
        simulate(ClusterSpec(num_prefill=1), model, Workload([0.0], [1], [1]))
    with pytest.raises(ValueError, match="policy"):
        simulate(ClusterSpec(num_colocated=1, policy="magic"), model, Workload([0.0], [1], [1]))
    with pytest.raises(ValueError, match="in order"):
        Workload([1.0, 0.0], [1, 1], [1, 1])
    with pytest.raises(ValueError, match=">= 1"):
        Workload([0.0], [0], [1])


def test_the_fit_recovers_a_known_step_model():
    true = StepModel(0.004, 0.0, 2e-5, 3e-8, 2e-9, 4e-6, 0.007)
    rng = np.random.default_rng(0)
    points = []
    for i in range(40):   # decode-only steps too: without them the fixed cost and a prefill's are one term
        p, b = (0 if i % 2 else int(rng.integers(1, 8000))), int(rng.integers(1, 500))
        c = b * int(rng.integers(100, 4000))
        a = p * (p + 1) // 2
        points.append(StepPoint(p, a, b, c, true.seconds(p, a, b, c)))
    fit = fit_step_model(points)
    assert fit.max_relative_error < 1e-6
    # the fixed cost and the weights' read trade places across the max, so compare predictions, not terms
    for p, b, c in [(0, 1, 500), (0, 256, 500_000), (8192, 0, 0), (512, 64, 100_000), (1, 0, 0)]:
        a = p * (p + 1) // 2
        assert fit.seconds(p, a, b, c) == pytest.approx(true.seconds(p, a, b, c), rel=1e-6)


def test_a_profile_file_is_checked(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fixed": -1}))
    with pytest.raises(ValueError, match="missing"):
        load_step_model(bad)
    bad.write_text(json.dumps({**FLAT.as_dict(), "fixed": -1.0}))
    with pytest.raises(ValueError, match="finite and >= 0"):
        load_step_model(bad)
    with pytest.raises(ValueError, match="profile"):
        load_step_model(tmp_path / "absent.json")


def test_plan_recommends_the_smallest_cluster_that_meets_the_slo(capsys, tmp_path):
    profile = tmp_path / "flat.json"
    profile.write_text(json.dumps(FLAT.as_dict()))
    # 10 ms per step whatever it holds: TPOT is 10 ms on any cluster, TTFT grows only with queueing
    rc = cli_main(["plan", "--workload", "decode-heavy", "--rate", "2", "--num-requests", "200", "--slo-ttft-ms",
                   "100", "--slo-tpot-ms", "15", "--profile", str(profile), "--max-instances", "3", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["recommended"]["instances"] == 1
    rc = cli_main(["plan", "--workload", "decode-heavy", "--rate", "2", "--num-requests", "50", "--slo-ttft-ms",
                   "100", "--slo-tpot-ms", "5", "--profile", str(profile), "--max-instances", "2"])
    assert rc == 1 and "no cluster of up to 2 instances" in capsys.readouterr().out


def test_plan_names_a_bad_workload(capsys, tmp_path):
    rc = cli_main(["plan", "--workload", str(tmp_path / "nope.json"), "--rate", "1", "--slo-ttft-ms", "1",
                   "--slo-tpot-ms", "1"])
    assert rc == 2 and "nope.json" in capsys.readouterr().err
    runs = tmp_path / "run.jsonl"
    runs.write_text('{"prompt_len": 100, "output_len": 10}\n')
    rc = cli_main(["plan", "--workload", str(runs), "--rate", "1", "--num-requests", "20", "--slo-ttft-ms", "1000",
                   "--slo-tpot-ms", "100", "--max-instances", "1", "--no-pd"])
    assert rc == 0


def test_the_shipped_profile_loads():
    from pdserve.planner.plan import DEFAULT_PROFILE
    model = load_step_model(DEFAULT_PROFILE)
    assert 0.002 < model.seconds(0, 0, 1, 2048) < 0.02   # one 8B decode step on an H200: milliseconds


def test_requests_that_can_never_run_are_counted_not_left_queued():
    """Without chunked prefill a prompt above the token budget can never be scheduled: it is refused (as a
    real engine refuses it) and counted as a miss, instead of blocking its instance's queue, which left
    every figure NaN."""
    whole = ClusterSpec(num_colocated=1, engine=EngineSpec(max_num_batched_tokens=100, enable_chunked_prefill=False))
    r = run(whole, [0.0, 0.0], [150, 50], [2, 2])
    assert r.rejected == 1 and r.ttft.tolist() == pytest.approx([0.01])
    assert r.attainment(1.0, 1.0) == 0.5


def test_plan_refuses_non_finite_numbers(capsys):
    for flag, value in (("--rate", "nan"), ("--rate", "inf"), ("--slo-ttft-ms", "nan"), ("--handoff-gbps", "0")):
        args = {"--rate": "1", "--slo-ttft-ms": "100", "--slo-tpot-ms": "10", flag: value}
        rc = cli_main(["plan", *[x for kv in args.items() for x in kv]])
        assert rc == 2 and flag in capsys.readouterr().err, flag


def test_a_decode_only_step_costs_the_rows_of_its_cuda_graph_bucket():
    """Three decoding sequences replay the graph captured for 4 (worker/cuda_graphs.py): 4 rows of matmuls.
    The step profile only measured bucket sizes, so the fit alone would charge 3."""
    model = StepModel(fixed=0.01, weights=0.0, per_token=0.001, per_context_token=0.0, per_attention_pair=0.0,
                      per_decode_seq=0.0, prefill_step=0.0)
    # step 1: A's prompt (10 + 10 x 1 ms); step 2, eager (a prefill): B's and C's prompts and A's decode
    # (10 + 21 ms), ends at 0.051; step 3: A, B, C decode alone: the graph of 4 (10 + 4 ms), A is done at
    # 0.065; step 4: B and C, the graph of 2 (12 ms): 0.077. Charged 3 rows, step 3 would end at 0.064.
    r = run(ClusterSpec(num_colocated=1), [0.0, 0.0, 0.0], [10, 10, 10], [3, 3, 3], model=model)
    assert r.finish.tolist() == pytest.approx([0.065, 0.077, 0.077])
    eager = ClusterSpec(num_colocated=1, engine=EngineSpec(cuda_graphs=False))
    assert run(eager, [0.0, 0.0, 0.0], [10, 10, 10], [3, 3, 3], model=model).finish.tolist() == \
        pytest.approx([0.064, 0.076, 0.076])


def test_the_graph_buckets_are_the_engines():
    cuda_graphs = pytest.importorskip("pdserve.worker.cuda_graphs")
    from pdserve.planner.simulator import graph_buckets, padded_batches
    for max_num_seqs in (1, 3, 64, 100, 256, 300, 512, 1000):
        assert graph_buckets(max_num_seqs) == cuda_graphs.graph_buckets(max_num_seqs), max_num_seqs
        rows = padded_batches(max_num_seqs)
        assert all(min(b for b in graph_buckets(max_num_seqs) if b >= n) == rows[n]
                   for n in range(1, max_num_seqs + 1))
