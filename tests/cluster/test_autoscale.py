"""The autoscaler on synthetic metric streams: it follows sustained pressure, ignores spikes and
oscillation, respects the cooldown, the minimums and max_instances, and moves an instance between pools
at the cap only when the other pool can spare one."""
from __future__ import annotations

import pytest

from pdserve.cluster.autoscale import AutoscaleConfig, Autoscaler

CFG = AutoscaleConfig(slo_ttft_s=1.0, slo_tpot_s=0.05, max_instances=4, patience=3, cooldown_s=30.0)


def status(num_p: int, num_d: int, *, queued: int = 0, rate: float = 1000.0, step: float = 0.02,
           kv: float = 0.1, waiting: int = 0, state: str = "healthy", running: int = 4, measured: bool = True) -> dict:
    instances = [{"name": f"prefill-{i}", "role": "prefill", "state": state, "prefill_tokens_waiting": queued // num_p,
                  "rates": {"prefill_tokens_per_s": rate}} for i in range(num_p)]
    instances += [{"name": f"decode-{i}", "role": "decode", "state": state, "kv_usage": kv, "waiting": waiting,
                   "running": running, "rates": {"decode_step_s": step, "measured": {"decode_step_s": measured}}}
                  for i in range(num_d)]
    return {"instances": instances}


def run(scaler: Autoscaler, stream, wanted: dict, start: float = 0.0, every: float = 5.0):
    """Feed one status per decision tick; apply each decision; the decisions, in order."""
    decisions = []
    for n, make in enumerate(stream):
        decision = scaler.decide(make(wanted), wanted, True, start + n * every)
        if decision is not None:
            wanted = {**wanted, "prefill": decision.prefill, "decode": decision.decode}
            decisions.append(decision)
    return decisions, wanted


def test_a_sustained_prefill_backlog_adds_a_prefill_after_patience_then_waits_out_the_cooldown():
    scaler = Autoscaler(CFG)
    backlog = lambda w: status(w["prefill"], w["decode"], queued=2000 * w["prefill"])   # 2 s per P: pressure 2
    decisions, wanted = run(scaler, [backlog] * 8, {"prefill": 1, "decode": 1})
    # ticks 0, 1, 2 agree → change at tick 2 (t=10); the cooldown (30 s) holds until t=40, past the stream
    assert [d.reason.split()[0] for d in decisions] == ["prefill_up"]
    assert wanted == {"prefill": 2, "decode": 1}
    assert scaler.counts == {"prefill_up": 1}


def test_a_one_tick_spike_and_an_oscillating_load_change_nothing():
    scaler = Autoscaler(CFG)
    high = lambda w: status(w["prefill"], w["decode"], queued=5000)
    calm = lambda w: status(w["prefill"], w["decode"], queued=300)
    decisions, _ = run(scaler, [calm, calm, high, calm, calm] + [high, calm] * 10, {"prefill": 1, "decode": 1})
    assert decisions == []


def test_nothing_is_decided_while_pools_are_not_at_their_size():
    scaler = Autoscaler(CFG)
    for n in range(10):
        assert scaler.decide(status(1, 1, queued=9000), {"prefill": 1, "decode": 1}, False, 5.0 * n) is None


def test_decode_grows_on_step_time_on_kv_usage_and_on_requests_waiting_for_a_slot():
    for kwargs in ({"step": 0.06}, {"kv": 0.95}, {"waiting": 3}):
        scaler = Autoscaler(CFG)
        decisions, wanted = run(scaler, [lambda w, k=kwargs: status(w["prefill"], w["decode"], **k)] * 3,
                                {"prefill": 1, "decode": 1})
        assert [d.reason.split()[0] for d in decisions] == ["decode_up"], kwargs
        assert wanted == {"prefill": 1, "decode": 2}


def test_at_max_instances_a_pool_takes_an_instance_only_from_an_idle_other_pool():
    cfg = AutoscaleConfig(slo_ttft_s=1.0, slo_tpot_s=0.05, max_instances=4, patience=2, cooldown_s=0.0)
    scaler = Autoscaler(cfg)
    # prefill swamped, decode idle (step 5 ms of 50, KV 5 %) with 3 Ds: one moves to prefill
    decisions, wanted = run(scaler, [lambda w: status(w["prefill"], w["decode"], queued=9000, step=0.005, kv=0.05)] * 2,
                            {"prefill": 1, "decode": 3})
    assert [d.reason.split()[0] for d in decisions] == ["prefill_from_decode"]
    assert wanted == {"prefill": 2, "decode": 2}
    # both busy at the cap: nothing moves, and it is counted
    scaler = Autoscaler(cfg)
    decisions, wanted = run(scaler, [lambda w: status(w["prefill"], w["decode"], queued=9000, step=0.03)] * 4,
                            {"prefill": 2, "decode": 2})
    assert decisions == [] and wanted == {"prefill": 2, "decode": 2} and scaler.counts["at_max"] == 2


def test_idle_pools_shrink_to_their_minimums_and_no_further():
    cfg = AutoscaleConfig(slo_ttft_s=1.0, slo_tpot_s=0.05, max_instances=8, patience=2, cooldown_s=0.0)
    scaler = Autoscaler(cfg)
    idle = lambda w: status(w["prefill"], w["decode"], queued=0, step=0.002, kv=0.0)
    decisions, wanted = run(scaler, [idle] * 30, {"prefill": 3, "decode": 3})
    assert wanted == {"prefill": 1, "decode": 1}
    assert len(decisions) == 4 and all("_down" in d.reason for d in decisions)


def test_an_idle_decode_pool_is_idle_whatever_step_time_it_last_reported():
    """The router reports its default step (25 ms) for a D never measured, and the last measured one for a D
    gone idle: neither is load. With a 20 ms TPOT SLO they would read as pressure > 1 and grow the pool."""
    scaler = Autoscaler(AutoscaleConfig(slo_tpot_s=0.02, patience=1, cooldown_s=0.0))
    assert scaler.pressures(status(1, 2, step=0.025, kv=0.0, measured=False))["decode"] == 0.0
    assert scaler.pressures(status(1, 2, step=0.04, kv=0.0, running=0))["decode"] == 0.0
    assert scaler.pressures(status(1, 2, step=0.04, kv=0.0))["decode"] == pytest.approx(2.0)
    decisions, wanted = run(scaler, [lambda w: status(w["prefill"], w["decode"], step=0.025, kv=0.0, running=0)] * 3,
                            {"prefill": 1, "decode": 3})
    assert wanted == {"prefill": 1, "decode": 1}


def test_colocated_instances_do_not_count_against_max_instances():
    scaler = Autoscaler(AutoscaleConfig(slo_ttft_s=1.0, max_instances=4, patience=1, cooldown_s=0.0))
    decision = scaler.decide(status(1, 2, queued=9000), {"prefill": 1, "decode": 2, "colocated": 5}, True, 0.0)
    assert decision is not None and (decision.prefill, decision.decode) == (2, 2)


def test_a_pool_with_no_healthy_report_is_left_alone():
    scaler = Autoscaler(AutoscaleConfig(patience=1, cooldown_s=0.0))
    assert scaler.decide(status(2, 2, queued=9000, state="ejected"), {"prefill": 2, "decode": 2}, True, 0.0) is None
    assert scaler.last_pressure == {"prefill": None, "decode": None}
    # at the cap, a pool of unknown pressure is not taken for idle
    cfg = AutoscaleConfig(slo_ttft_s=1.0, max_instances=3, patience=1, cooldown_s=0.0)
    swamped = status(1, 2, queued=9000)
    for inst in swamped["instances"]:
        if inst["role"] == "decode":
            inst["state"] = "ejected"
    assert Autoscaler(cfg).decide(swamped, {"prefill": 1, "decode": 2}, True, 0.0) is None
    no_rate = status(1, 1, queued=9000, rate=None)
    assert scaler.pressures(no_rate)["prefill"] is None


@pytest.mark.parametrize("kwargs", [{"slo_ttft_s": 0}, {"slo_tpot_s": float("nan")}, {"up": 0.1, "down": 0.2},
                                    {"min_prefill": 0}, {"max_instances": 1}, {"patience": 0},
                                    {"cooldown_s": -1}])
def test_a_config_that_cannot_work_is_refused(kwargs):
    with pytest.raises(ValueError):
        AutoscaleConfig(**kwargs)
