"""Metrics against hand-computed cases."""
import json

import pytest

from pdserve.bench.client import RequestRecord
from pdserve.bench.metrics import (SLO, compute_metrics, format_summary, latency_stats, max_rate_meeting_slo,
                                   meets_slo, parse_rate)


def ok(index, ttft, e2e, output_tokens, prompt_tokens=10, itls=()):
    return RequestRecord(index=index, success=True, ttft=ttft, e2e=e2e, itls=list(itls),
                         prompt_tokens=prompt_tokens, output_tokens=output_tokens)


def test_latency_stats_match_hand_computed_percentiles():
    stats = latency_stats([i / 1000 for i in range(1, 11)])  # 1..10 ms
    assert stats["mean"] == pytest.approx(5.5)
    assert stats["p50"] == pytest.approx(5.5)   # halfway between 5 and 6
    assert stats["p90"] == pytest.approx(9.1)   # rank 0.9 * 9 = 8.1 → 9 + 0.1 * (10 - 9)
    assert stats["p99"] == pytest.approx(9.91)
    assert latency_stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_is_decode_time_over_output_tokens_after_the_first():
    assert ok(0, ttft=0.1, e2e=0.5, output_tokens=5).tpot == pytest.approx(0.1)   # 0.4 s / 4
    assert ok(0, ttft=0.1, e2e=0.5, output_tokens=1).tpot is None
    assert RequestRecord(index=0, success=False, ttft=0.1, e2e=0.5, output_tokens=5).tpot is None


def test_compute_metrics_hand_case_with_slo_goodput_and_a_failure():
    records = [
        ok(0, ttft=0.1, e2e=0.5, output_tokens=9, itls=[0.05] * 8),       # TPOT 50 ms: meets (≤)
        ok(1, ttft=0.3, e2e=0.6, output_tokens=7, itls=[0.05] * 6),       # TTFT 300 ms: misses
        ok(2, ttft=0.1, e2e=1.1, output_tokens=11, itls=[0.1] * 10),      # TPOT 100 ms: misses
        RequestRecord(index=3, success=False, error="HTTP 500: boom", e2e=0.01),
    ]
    m = compute_metrics(records, duration=2.0, slo=SLO(ttft_ms=200, tpot_ms=50))
    assert (m["num_requests"], m["num_completed"], m["num_failed"]) == (4, 3, 1)
    assert m["total_output_tokens"] == 27 and m["total_prompt_tokens"] == 30
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_token_throughput"] == pytest.approx(13.5)
    assert m["total_token_throughput"] == pytest.approx(28.5)
    assert m["ttft_ms"]["mean"] == pytest.approx(500 / 3)
    assert m["ttft_ms"]["p50"] == pytest.approx(100)
    assert m["tpot_ms"]["p50"] == pytest.approx(50)
    assert m["e2e_ms"]["mean"] == pytest.approx(2200 / 3)            # the failure's e2e is left out
    assert m["itl_ms"]["mean"] == pytest.approx((14 * 50 + 10 * 100) / 24)  # pooled over requests
    assert m["num_meeting_slo"] == 1
    assert m["goodput"] == pytest.approx(0.5)
    assert m["slo_attainment"] == pytest.approx(0.25)                 # the failure counts as missed
    assert m["errors"] == {"HTTP 500: boom": 1}
    json.dumps(m, allow_nan=False)


def test_without_slo_every_completed_request_meets_it_and_failures_never_do():
    records = [ok(0, ttft=5.0, e2e=9.0, output_tokens=3), RequestRecord(index=1, success=False, error="x")]
    m = compute_metrics(records, duration=1.0)
    assert m["num_meeting_slo"] == 1 and m["slo_attainment"] == 0.5 and m["goodput"] == 1.0


def test_one_token_answer_meets_any_tpot_slo_but_missing_usage_does_not():
    one_token = ok(0, ttft=0.01, e2e=0.01, output_tokens=1)
    no_usage = ok(1, ttft=0.01, e2e=0.5, output_tokens=None, prompt_tokens=None)
    slo = SLO(tpot_ms=1)
    assert meets_slo(one_token, slo)
    assert not meets_slo(no_usage, slo)
    assert meets_slo(no_usage, SLO(ttft_ms=100))
    m = compute_metrics([one_token, no_usage], duration=1.0, slo=slo)
    assert m["num_without_usage"] == 1 and m["total_output_tokens"] == 1
    assert "no usage" in format_summary(m)


def test_max_rate_meeting_slo_takes_the_highest_rate_with_all_lower_rates_passing():
    def entry(rate, attainment):
        return {"request_rate": rate, "metrics": {"slo_attainment": attainment}}

    sweep = [entry("inf", 0.95), entry(4, 0.5), entry(1, 1.0), entry(2, 0.95)]
    assert max_rate_meeting_slo(sweep) == 2.0           # inf passed, but 4 did not
    assert max_rate_meeting_slo(sweep, attainment=0.4) == float("inf")
    assert max_rate_meeting_slo({"results": sweep}) == 2.0
    assert max_rate_meeting_slo([entry(1, 0.5), entry(2, 1.0)]) is None


@pytest.mark.parametrize("bad", ["0", "-1", "x", "nan", None])
def test_parse_rate_rejects_non_positive_and_junk(bad):
    with pytest.raises(ValueError, match="request_rate"):
        parse_rate(bad)


def test_parse_rate_accepts_numbers_and_inf():
    assert parse_rate("inf") == float("inf") and parse_rate("2.5") == 2.5 and parse_rate(3) == 3.0


def test_summary_table_names_every_metric():
    m = compute_metrics([ok(0, ttft=0.1, e2e=0.5, output_tokens=5, itls=[0.1] * 4)], 1.0, SLO(100, 50))
    text = format_summary(m, title="t")
    for word in ("TTFT", "TPOT", "ITL", "E2E", "Goodput", "SLO attainment", "Output token throughput"):
        assert word in text
