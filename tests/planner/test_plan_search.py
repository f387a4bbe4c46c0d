"""`pdserve plan`'s search: the bisection past a few instances finds what the exhaustive search finds, in a
few dozen simulations instead of N^2/2 (a plan for a pool of hundreds tried every split before)."""
from __future__ import annotations

import json
import math

import pytest

from pdserve.cli import main as cli_main
from pdserve.planner.plan import smallest


@pytest.mark.parametrize("hi", [1, 2, 7, 64, 1000])
def test_smallest_finds_the_first_true_and_tries_little_more_than_twice_it(hi):
    for answer in range(1, hi + 1):
        tried = []

        def ok(n):
            tried.append(n)
            return n >= answer
        assert smallest(1, hi, ok) == answer
        assert max(tried) <= min(hi, 2 * answer) and len(tried) <= 2 * math.log2(2 * hi) + 2
    assert smallest(1, hi, lambda n: False) is None
    assert smallest(3, 2, lambda n: True) is None


def plan(*args: str) -> dict:
    return plan_json(*args)[1]


def plan_json(*args: str) -> tuple[int, dict]:
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main(["plan", "--num-requests", "300", "--json", *args])
    return rc, json.loads(out.getvalue())


@pytest.mark.parametrize("case", [
    ["--workload", "prefill-heavy", "--rate", "8", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "30"],
    ["--workload", "prefill-heavy", "--rate", "20", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "20"],
    ["--workload", "decode-heavy", "--rate", "30", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "20"],
    ["--workload", "prefill-heavy", "--rate", "20", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "20", "--no-colocated"],
])
def test_the_bisection_recommends_what_every_split_tried_recommends(case):
    exhaustive = plan(*case, "--max-instances", "10", "--search", "exhaustive")
    bisection = plan(*case, "--max-instances", "10", "--search", "bisection")
    assert exhaustive["search"] == "exhaustive" and bisection["search"] == "bisection"
    assert exhaustive["recommended"] is not None
    assert bisection["recommended"]["instances"] == exhaustive["recommended"]["instances"]
    assert bisection["recommended"]["slo_attainment"] >= 0.9


def test_the_bisection_shrinks_a_pool_sized_behind_too_large_a_partner():
    """D sized behind 15 P (whose handoffs come in bursts) was one too many: 5P6D where 5P5D meets the SLO
    (hostile review)."""
    case = ["--workload", "prefill-heavy", "--rate", "50", "--slo-ttft-ms", "3000", "--slo-tpot-ms", "15",
            "--num-requests", "400", "--max-instances", "16", "--no-colocated", "--pd-min-prompt-tokens", "3000"]
    assert plan(*case, "--search", "bisection")["recommended"]["cluster"] == \
        plan(*case, "--search", "exhaustive")["recommended"]["cluster"] == "5P5D"


def test_the_bisection_grows_d_when_d_prefills_the_prompts():
    """Prompts under --pd-min-prompt-tokens go straight to D, so only more D lowers their TTFT: the search
    added P one at a time up to 198P1D and found nothing (hostile review)."""
    rc, report = plan_json("--workload", "decode-heavy", "--rate", "60", "--slo-ttft-ms", "500", "--slo-tpot-ms",
                           "25", "--no-colocated", "--pd-min-prompt-tokens", "4000", "--max-instances", "200")
    assert rc == 0 and report["recommended"]["cluster"] == "1P2D" and len(report["candidates"]) < 20


def test_a_plan_for_hundreds_of_instances_simulates_a_few_dozen_clusters():
    rc, report = plan_json("--workload", "decode-heavy", "--rate", "200", "--slo-ttft-ms", "2000",
                           "--slo-tpot-ms", "30", "--max-instances", "500")
    assert rc == 0 and report["search"] == "bisection"   # auto, past 16 instances
    assert len(report["candidates"]) <= 6 * math.log2(500) + 10
    assert report["recommended"]["slo_attainment"] >= 0.9


def test_no_cluster_within_the_limit_is_said_so_by_the_bisection(capsys):
    # no decode step of the 8B shape takes under 1 ms on an H200
    rc = cli_main(["plan", "--workload", "prefill-heavy", "--rate", "4", "--num-requests", "200",
                   "--slo-ttft-ms", "2000", "--slo-tpot-ms", "1", "--max-instances", "20"])
    out = capsys.readouterr().out
    assert rc == 1 and "no cluster of up to 20 instances meets the SLO" in out and "bisection" in out


def test_a_batch_limit_past_any_engine_is_a_usage_error(capsys):
    """--max-num-seqs 1000000000 built a table of a billion entries: a MemoryError traceback (hostile review)."""
    rc = cli_main(["plan", "--rate", "8", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "20", "--max-instances", "4",
                   "--num-requests", "10", "--max-num-seqs", "1000000000"])
    assert rc == 2 and "max_num_seqs must be at most 1,000,000" in capsys.readouterr().err


def test_the_help_names_the_exhaustive_limit_in_force():
    from pdserve.planner.plan import DESCRIPTION, EXHAUSTIVE_UP_TO
    assert f"Up to {EXHAUSTIVE_UP_TO} instances" in DESCRIPTION
