"""Instance: load reports (lenient, malformed), health (ejection, re-admission), the router's own accounting,
the estimates the policies use, and the rates learned from the counters (restarts included)."""
import math

import pytest

from pdserve.router.instances import (DEFAULT_BLOCK_SIZE, DEFAULT_DECODE_STEP_S, DEFAULT_KV_BYTES_PER_TOKEN,
                                      DEFAULT_PREFILL_TOKENS_PER_S, DEFAULT_TRANSFER_BYTES_PER_S, EWMA_ALPHA,
                                      Instance, LoadReport)


def report(**fields):
    base = {"boot_id": "b1", "kv_role": "producer", "healthy": True, "block_size": 16, "num_blocks": 1000,
            "num_free_blocks": 800, "kv_bytes_per_token": 1024, "max_num_seqs": 8,
            "num_requests_running": 0, "num_requests_waiting": 0, "num_requests_waiting_for_remote_kvs": 0,
            "num_prefill_tokens_waiting": 0, "num_blocks_held_for_transfer": 0,
            "num_prompt_tokens_computed_total": 0, "num_output_tokens_total": 0, "busy_seconds_total": 0.0,
            "kv_transfer_bytes_total": 0, "kv_transfer_seconds_total": 0.0}
    base.update(fields)
    return base


# --- reports --------------------------------------------------------------------------------------------------

def test_missing_fields_are_none_and_estimates_fall_back_to_defaults():
    inst = Instance("decode-0", "http://d0", "decode")
    assert inst.update({}, now=1.0)
    assert inst.report == LoadReport()
    assert inst.free_blocks is None and inst.held_fraction is None and inst.num_blocks is None
    assert inst.block_size == DEFAULT_BLOCK_SIZE and inst.hash_extra == ""
    assert inst.kv_bytes_per_token == DEFAULT_KV_BYTES_PER_TOKEN
    assert inst.queued_prefill_tokens == 0 and inst.num_in_flight == 0
    assert inst.update({"num_free_blocks": None, "unknown_field": [1]}, now=2.0)   # nulls, extras: fine


@pytest.mark.parametrize("bad", [
    None, [1, 2], "load", {"num_blocks": "1000"}, {"num_blocks": -1}, {"num_blocks": True},
    {"num_blocks": 10.0}, {"busy_seconds_total": float("nan")}, {"busy_seconds_total": -0.5},
    {"healthy": "yes"}, {"block_size": 0}, {"boot_id": 7}, {"hash_extra": 3},
    {"kv_events": []}, {"kv_events": {"reset": True, "snapshot": "all"}},
    {"kv_events": {"last_seq": 2, "batches": [[2, "stored", ["h"]]]}},
])
def test_a_malformed_report_is_refused_and_changes_nothing(bad):
    inst = Instance("prefill-0", "http://p0", "prefill")
    assert inst.update(report(num_free_blocks=500), now=1.0)
    assert inst.update(bad, now=2.0) is False
    assert inst.free_blocks == 500 and inst.report_time == 1.0 and inst.num_reports == 1
    assert inst.detail.startswith("load report")


def test_role_is_checked():
    with pytest.raises(ValueError, match="role"):
        Instance("x-0", "http://x", "router")


# --- health ---------------------------------------------------------------------------------------------------

def test_ejected_after_consecutive_failures_and_readmitted_on_success():
    inst = Instance("decode-0", "http://d0", "decode")
    assert inst.is_available          # before any poll: serve, let failures eject it
    assert inst.record_failure(3, "timeout") is False
    assert inst.record_failure(3) is False
    inst.record_success()             # the count is of failures in a row
    assert inst.consecutive_failures == 0
    assert [inst.record_failure(3, "refused") for _ in range(3)] == [False, False, True]
    assert not inst.is_available and inst.state == "ejected" and inst.detail == "refused"
    assert inst.record_failure(3) is False   # already out: not ejected again
    assert inst.record_success() is True
    assert inst.is_available and inst.detail is None
    assert inst.record_success() is False


def test_eject_after_one():
    inst = Instance("decode-0", "http://d0", "decode")
    assert inst.record_failure(1)
    assert not inst.is_available


# --- accounting and estimates ---------------------------------------------------------------------------------

def test_estimates_take_the_larger_of_reported_and_own():
    inst = Instance("decode-0", "http://d0", "decode")
    inst.update(report(num_requests_running=3, num_requests_waiting=1, num_requests_waiting_for_remote_kvs=1,
                       num_prefill_tokens_waiting=100), now=0.0)
    assert inst.num_in_flight == 5 and inst.queued_prefill_tokens == 100
    tickets = [inst.begin(num_prompt_tokens=50, num_blocks=2) for _ in range(6)]
    assert inst.num_in_flight == 6 and inst.queued_prefill_tokens == 300
    inst.prompt_done(tickets[0])
    inst.prompt_done(tickets[0])      # once only
    assert inst.queued_prefill_tokens == 250
    for ticket in tickets:
        inst.end(ticket)
        inst.end(ticket)              # idempotent
    assert inst.own_in_flight == 0 and inst.own_prompt_tokens == 0
    assert inst.num_in_flight == 5 and inst.queued_prefill_tokens == 100


def test_queued_requests_count_the_routers_own_past_max_num_seqs():
    inst = Instance("decode-0", "http://d0", "decode")
    inst.update(report(max_num_seqs=4, num_requests_waiting=1), now=0.0)
    assert inst.num_queued_requests == 1
    for _ in range(7):
        inst.begin()
    assert inst.num_queued_requests == 3


def test_free_blocks_subtract_what_was_sent_since_the_report():
    inst = Instance("decode-0", "http://d0", "decode")
    inst.update(report(num_free_blocks=100), now=0.0)
    a = inst.begin(num_blocks=30)
    b = inst.begin(num_blocks=50)
    assert inst.free_blocks == 20
    inst.end(a)                      # ended before the next report: its blocks are back
    assert inst.free_blocks == 50
    inst.update(report(num_free_blocks=60), now=0.1)   # this report counts b's blocks itself
    assert inst.free_blocks == 60
    inst.end(b)                      # begun before that report: ending it changes nothing known
    assert inst.free_blocks == 60
    inst.begin(num_blocks=500)
    assert inst.free_blocks == 0


def test_held_fraction_of_a_prefill_instance():
    inst = Instance("prefill-0", "http://p0", "prefill")
    assert inst.held_fraction is None
    inst.update(report(num_blocks=1000, num_blocks_held_for_transfer=400), now=0.0)
    assert inst.held_fraction == pytest.approx(0.4)
    inst.begin(num_prompt_tokens=1600, num_blocks=100)
    assert inst.held_fraction == pytest.approx(0.5)


def test_blocks_for_rounds_up():
    inst = Instance("decode-0", "http://d0", "decode")
    inst.update(report(block_size=16), now=0.0)
    assert [inst.blocks_for(n) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]


def test_status_has_what_pdserve_status_shows():
    inst = Instance("decode-0", "http://d0", "decode")
    inst.update(report(num_blocks=1000, num_free_blocks=250, num_requests_running=2), now=0.0)
    status = inst.status()
    assert status["name"] == "decode-0" and status["state"] == "healthy" and status["running"] == 2
    assert status["kv_usage"] == pytest.approx(0.75)
    assert status["rates"]["prefill_tokens_per_s"] == DEFAULT_PREFILL_TOKENS_PER_S
    assert "url" not in status       # addresses stay in the log


# --- learned rates --------------------------------------------------------------------------------------------

def test_defaults_until_measured():
    inst = Instance("decode-0", "http://d0", "decode")
    assert inst.prefill_tokens_per_s == DEFAULT_PREFILL_TOKENS_PER_S
    assert inst.decode_step_s == DEFAULT_DECODE_STEP_S
    assert inst.transfer_bytes_per_s == DEFAULT_TRANSFER_BYTES_PER_S
    assert not any(inst.rates_measured.values())


def test_prefill_rate_of_a_prefill_instance_is_an_ewma_of_its_intervals():
    inst = Instance("prefill-0", "http://p0", "prefill")
    inst.update(report(), now=0.0)
    inst.update(report(num_prompt_tokens_computed_total=8000, busy_seconds_total=2.0,
                       num_output_tokens_total=4), now=0.1)
    assert inst.prefill_tokens_per_s == pytest.approx(4000.0)     # the first measurement replaces the default
    inst.update(report(num_prompt_tokens_computed_total=10000, busy_seconds_total=2.5,
                       num_output_tokens_total=5), now=0.2)
    assert inst.prefill_tokens_per_s == pytest.approx(4000.0)
    inst.update(report(num_prompt_tokens_computed_total=12000, busy_seconds_total=3.5,
                       num_output_tokens_total=6), now=0.3)
    assert inst.prefill_tokens_per_s == pytest.approx((1 - EWMA_ALPHA) * 4000.0 + EWMA_ALPHA * 2000.0)


def test_idle_and_tiny_intervals_teach_nothing():
    inst = Instance("prefill-0", "http://p0", "prefill")
    inst.update(report(), now=0.0)
    inst.update(report(), now=0.1)                                           # idle
    inst.update(report(num_prompt_tokens_computed_total=10, busy_seconds_total=0.001), now=0.2)  # too little
    inst.update(report(num_prompt_tokens_computed_total=5000, busy_seconds_total=0.005), now=0.3)
    assert not inst.rates_measured["prefill_tokens_per_s"]


def test_decode_step_time_from_output_tokens_and_the_running_batch():
    inst = Instance("decode-0", "http://d0", "decode")
    inst.update(report(num_requests_running=8), now=0.0)
    # 800 tokens out of a batch of 8: 100 steps in 1 s of engine time
    inst.update(report(num_requests_running=8, num_output_tokens_total=800, busy_seconds_total=1.0), now=1.0)
    assert inst.decode_step_s == pytest.approx(0.01)
    assert not inst.rates_measured["prefill_tokens_per_s"]    # a D reading its KV computes no prompt


def test_a_colocated_instance_splits_busy_time_between_prefill_and_decode():
    inst = Instance("colocated-0", "http://c0", "colocated")
    inst.update(report(num_requests_running=4), now=0.0)
    # 100 steps at the default step time (2.5 s) and 7,500 prompt tokens in the remaining 2.5 s
    inst.update(report(num_requests_running=4, num_output_tokens_total=400, busy_seconds_total=5.0,
                       num_prompt_tokens_computed_total=7500), now=1.0)
    assert inst.prefill_tokens_per_s == pytest.approx(3000.0)
    # ... and the step time from the prefill rate as it was: (5 s − 7500 / 4000 t/s) / 100 steps. Both kinds
    # are timed against the other's estimate before this interval; intervals of varied mix settle them.
    assert inst.decode_step_s == pytest.approx(0.03125)
    inst.update(report(num_requests_running=4, num_output_tokens_total=800, busy_seconds_total=7.5,
                       num_prompt_tokens_computed_total=7500), now=2.0)    # decode only: 100 steps in 2.5 s
    assert inst.decode_step_s == pytest.approx((1 - EWMA_ALPHA) * 0.03125 + EWMA_ALPHA * 0.025)


def test_transfer_rate_from_kv_read_counters():
    inst = Instance("decode-0", "http://d0", "decode")
    inst.update(report(), now=0.0)
    inst.update(report(kv_transfer_bytes_total=10**9, kv_transfer_seconds_total=0.5), now=0.1)
    assert inst.transfer_bytes_per_s == pytest.approx(2e9)
    inst.update(report(kv_transfer_bytes_total=10**9, kv_transfer_seconds_total=0.5), now=0.2)  # no reads
    assert inst.transfer_bytes_per_s == pytest.approx(2e9)


def test_a_new_boot_id_forgets_the_rates():
    inst = Instance("prefill-0", "http://p0", "prefill")
    inst.update(report(), now=0.0)
    inst.update(report(num_prompt_tokens_computed_total=1000, busy_seconds_total=1.0), now=0.1)
    assert inst.rates_measured["prefill_tokens_per_s"]
    # the new process's counters start over: no delta against the old ones
    inst.update(report(boot_id="b2", num_prompt_tokens_computed_total=100000, busy_seconds_total=1.5), now=0.2)
    assert inst.num_restarts == 1 and not inst.rates_measured["prefill_tokens_per_s"]
    inst.update(report(boot_id="b2", num_prompt_tokens_computed_total=102000, busy_seconds_total=2.5), now=0.3)
    assert inst.prefill_tokens_per_s == pytest.approx(2000.0)


def test_counters_going_backwards_are_a_restart():
    inst = Instance("prefill-0", "http://p0", "prefill")
    inst.update(report(num_prompt_tokens_computed_total=5000, busy_seconds_total=10.0), now=0.0)
    inst.update(report(num_prompt_tokens_computed_total=6000, busy_seconds_total=10.5), now=0.1)
    assert inst.rates_measured["prefill_tokens_per_s"]
    inst.update(report(num_prompt_tokens_computed_total=100, busy_seconds_total=0.2), now=0.2)
    assert inst.num_restarts == 1 and not inst.rates_measured["prefill_tokens_per_s"]
    assert inst.prefill_tokens_per_s == DEFAULT_PREFILL_TOKENS_PER_S and not math.isnan(inst.prefill_tokens_per_s)


def test_restarted_keeps_the_routers_own_hops_in_flight():
    inst = Instance("decode-0", "http://d0", "decode")
    inst.update(report(num_free_blocks=100), now=0.0)
    ticket = inst.begin(num_prompt_tokens=10, num_blocks=5)
    inst.restarted()
    assert inst.report is None and inst.free_blocks is None and inst.num_in_flight == 1
    inst.end(ticket)
    assert inst.num_in_flight == 0


def test_an_ejected_instance_cuts_the_hops_on_it_only_while_its_polls_go_unanswered():
    """A stopped or hung instance answers no poll: its hops are given up on at its ejection. One that answers
    unhealthy (draining, a long step) keeps them (the rule's first form compared clocks and cut these too)."""
    inst = Instance("prefill-0", "http://p", "prefill")
    inst.update(report(), 10.0)
    inst.last_heard = 10.0
    assert inst.record_failure(1, "unhealthy: draining")   # an answered poll that ejects it
    assert inst.why_silent(9.0, 0, 600.0, 10.5) is None
    inst.record_failure(1, "timed out", answered=False)
    assert inst.why_silent(9.0, 0, 600.0, 11.0) == "ejected (its polls go unanswered)"
    inst.record_failure(1, "unhealthy: draining")           # it answers again
    assert inst.why_silent(9.0, 0, 600.0, 11.5) is None
    assert inst.record_success() and inst.unanswered_polls == 0
