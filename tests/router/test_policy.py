"""Routing decisions against fake instance states: the four policies,
the hard caps, the PD decider's reasons, stream-recovery replacements, the accounting and the counters."""
import dataclasses

import pytest

from pdserve.hashing import hash_prompt_blocks
from pdserve.router.instances import Instance
from pdserve.router.policy import (DECODE, POLICIES, PREFILL, CostPolicy, Route, Router, RouterConfig,
                                   RouteRequest, estimated_seconds)
from pdserve.router.prefix_index import PrefixIndex

# --- fake cluster states --------------------------------------------------------------------------------------

BLOCK = 16
TOKENS = list(range(1, 4097))                 # a 4,096-token prompt: 256 blocks
HASHES = hash_prompt_blocks(TOKENS, BLOCK)


def inst(name, **fields):
    """An instance with a load report: ample room unless fields say otherwise."""
    role = name.split("-")[0]
    base = {"boot_id": "b", "block_size": BLOCK, "num_blocks": 100000, "num_free_blocks": 100000,
            "max_num_seqs": 64, "num_blocks_held_for_transfer": 0}
    instance = Instance(name, f"http://{name}", role)
    assert instance.update({**base, **fields}, now=0.0)
    return instance


def holds(index, name, num_blocks, hashes=HASHES):
    """The instance's events say it caches the first num_blocks blocks of the prompt."""
    index.apply_report(name, {"last_seq": 1, "reset": True, "snapshot": list(hashes[:num_blocks]), "batches": []},
                       now=0.0)


def req(num_tokens=4096, max_tokens=16):
    tokens = TOKENS[:num_tokens]
    return RouteRequest.from_token_ids(tokens, max_tokens, BLOCK)


def names(route):
    return (route.prefill.name if route.prefill else None, route.decode.name, route.reason)


def test_policies_by_name():
    assert set(POLICIES) == {"round-robin", "least-load", "prefix-affinity", "cost"}
    for name, cls in POLICIES.items():
        assert cls.name == name
    with pytest.raises(ValueError, match="policy"):
        Router([inst("decode-0")], policy="random")


def test_router_checks_its_pools():
    with pytest.raises(ValueError, match="decode"):
        Router([inst("prefill-0")])
    with pytest.raises(ValueError, match="unique"):
        Router([inst("decode-0"), inst("decode-0")])
    with pytest.raises(ValueError, match="at least one"):
        Router([])


# --- round-robin and least-load -------------------------------------------------------------------------------

def test_round_robin_pairs_in_order_and_skips_excluded_and_ejected():
    router = Router([inst("prefill-0"), inst("prefill-1"), inst("decode-0"), inst("decode-1")])
    picks = [names(router.route(req())) for _ in range(3)]
    assert picks == [("prefill-0", "decode-0", "disaggregated"), ("prefill-1", "decode-1", "disaggregated"),
                     ("prefill-0", "decode-0", "disaggregated")]
    assert names(router.route(req(), exclude={"prefill-1", "decode-1"})) == ("prefill-0", "decode-0",
                                                                              "disaggregated")
    router.by_name["decode-0"].record_failure(1)
    assert names(router.route(req())) == ("prefill-1", "decode-1", "disaggregated")


def test_least_load_picks_the_fewest_queued_prompt_tokens_and_requests():
    router = Router([inst("prefill-0", num_prefill_tokens_waiting=5000), inst("prefill-1",
                     num_prefill_tokens_waiting=100), inst("decode-0", num_requests_running=3),
                     inst("decode-1", num_requests_running=9)], policy="least-load")
    assert names(router.route(req())) == ("prefill-1", "decode-0", "disaggregated")


def test_least_load_ties_go_round_and_own_accounting_counts():
    router = Router([inst("prefill-0"), inst("prefill-1"), inst("decode-0"), inst("decode-1")],
                    policy="least-load")
    first = router.route(req())
    second = router.route(req())
    assert first.prefill.name != second.prefill.name and first.decode.name != second.decode.name
    # what the router sent counts before any report shows it
    router.begin(router.by_name["decode-0"], req(), now=0.0, computes_prompt=False)
    router.begin(router.by_name["prefill-0"], req(), now=0.0, computes_prompt=True)
    assert names(router.route(req())) == ("prefill-1", "decode-1", "disaggregated")


# --- prefix-affinity ------------------------------------------------------------------------------------------

def test_prefix_affinity_prefers_the_longest_cached_prefix():
    index = PrefixIndex()
    holds(index, "prefill-1", 200)
    holds(index, "prefill-2", 100)
    holds(index, "decode-0", 256)
    router = Router([inst("prefill-0"), inst("prefill-1", num_prefill_tokens_waiting=3000), inst("prefill-2"),
                     inst("decode-0", num_requests_running=5), inst("decode-1")], policy="prefix-affinity",
                    index=index)
    assert names(router.route(req())) == ("prefill-1", "decode-0", "disaggregated")
    assert router.picks == {"prefill:hit": 1, "decode:hit": 1}


def test_prefix_affinity_spills_over_the_balance_threshold():
    index = PrefixIndex()
    holds(index, "prefill-1", 200)
    config = RouterConfig(balance_tokens=8192, balance_requests=4)
    busy = [inst("prefill-0", num_prefill_tokens_waiting=1000), inst("prefill-1", num_prefill_tokens_waiting=9500),
            inst("decode-0"), inst("decode-1")]
    router = Router(busy, policy="prefix-affinity", config=config, index=index)
    assert router.route(req()).prefill.name == "prefill-0"
    assert router.picks["prefill:spill"] == 1
    calm = [inst("prefill-0", num_prefill_tokens_waiting=1000), inst("prefill-1", num_prefill_tokens_waiting=9000),
            inst("decode-0"), inst("decode-1")]
    router = Router(calm, policy="prefix-affinity", config=config, index=index)
    assert router.route(req()).prefill.name == "prefill-1"     # 8,000 above the least: within the threshold


def test_prefix_affinity_without_any_match_is_least_load():
    router = Router([inst("prefill-0", num_prefill_tokens_waiting=500), inst("prefill-1"), inst("decode-0")],
                    policy="prefix-affinity")
    assert router.route(req()).prefill.name == "prefill-1"
    assert router.picks["prefill:miss"] == 1


def test_prefix_affinity_takes_a_short_shared_prefix_for_a_miss():
    # The bug: every chat prompt shares its template's first block, and prefix-affinity sent them all to the
    # one instance holding it until its queue was 8,192 tokens above the others.
    index = PrefixIndex()
    holds(index, "prefill-1", 2)                       # 32 of 4,096 tokens
    router = Router([inst("prefill-0"), inst("prefill-1", num_prefill_tokens_waiting=4000), inst("decode-0")],
                    policy="prefix-affinity", index=index)
    assert router.route(req()).prefill.name == "prefill-0"
    assert router.picks["prefill:miss"] == 1
    holds(index, "prefill-1", 130)                     # more than half of it: a hit, queue and all
    assert router.route(req()).prefill.name == "prefill-1"
    with pytest.raises(ValueError, match="affinity_min_cached"):
        RouterConfig(affinity_min_cached=1.5)


def test_the_routers_predictions_steer_the_next_request_to_the_same_instance():
    router = Router([inst("prefill-0"), inst("prefill-1"), inst("prefill-2"), inst("decode-0"), inst("decode-1")],
                    policy="prefix-affinity")
    first = router.route(req(), now=0.0)
    for instance in (first.prefill, first.decode):
        router.end(instance, router.begin(instance, req(), now=0.0, computes_prompt=instance is first.prefill))
    for _ in range(3):
        again = router.route(req(), now=1.0)
        assert (again.prefill, again.decode) == (first.prefill, first.decode)
    # ... until the prediction expires without an event confirming it
    later = router.route(req(), now=1000.0)
    assert router.picks["prefill:miss"] == 2 and later is not None


# --- cost -----------------------------------------------------------------------------------------------------

def test_cost_takes_the_cached_prefix_when_it_saves_more_than_the_queue_costs():
    index = PrefixIndex()
    holds(index, "prefill-1", 240)                    # 3,840 of 4,096 tokens cached
    rate = {"num_prompt_tokens_computed_total": 0, "busy_seconds_total": 0.0}
    cluster = [inst("prefill-0", **rate), inst("prefill-1", num_prefill_tokens_waiting=2000, **rate), inst("decode-0")]
    router = Router(cluster, policy="cost", index=index)
    # idle P: 4,096 tokens; P with the prefix: 2,000 queued + 256 → at the same rate, the latter
    assert router.route(req()).prefill.name == "prefill-1"


def test_cost_takes_the_idle_instance_when_the_queue_is_long():
    index = PrefixIndex()
    holds(index, "prefill-1", 240)
    router = Router([inst("prefill-0"), inst("prefill-1", num_prefill_tokens_waiting=8000), inst("decode-0")],
                    policy="cost", index=index)
    assert router.route(req()).prefill.name == "prefill-0"   # 8,256 tokens of queue and prompt > 4,096


def test_cost_uses_the_learned_prefill_rate():
    zero = {"num_prompt_tokens_computed_total": 0, "busy_seconds_total": 0.0}
    fast, slow = inst("prefill-0", **zero), inst("prefill-1", **zero)
    fast.update({"boot_id": "b", "num_prompt_tokens_computed_total": 10000, "busy_seconds_total": 0.5,
                 "num_prefill_tokens_waiting": 20000}, now=0.1)
    slow.update({"boot_id": "b", "num_prompt_tokens_computed_total": 10000, "busy_seconds_total": 4.0}, now=0.1)
    assert fast.prefill_tokens_per_s == pytest.approx(20000) and slow.prefill_tokens_per_s == pytest.approx(2500)
    # 20,000 t/s with 20,000 queued: 1.2 s; 2,500 t/s idle: 1.6 s
    router = Router([fast, slow, inst("decode-0")], policy="cost")
    assert router.route(req()).prefill is fast


def test_cost_weighs_a_decodes_queue_against_the_kv_it_lacks():
    index = PrefixIndex()
    holds(index, "decode-0", 256)
    router = Router([inst("prefill-0"), inst("decode-0", num_requests_waiting=2), inst("decode-1")],
                    policy="cost", index=index)
    # decode-0 lacks nothing: 3 steps (0.075 s); decode-1 reads 4,096 × 128 KiB at 2 GB/s: 1 step + 0.27 s
    assert router.route(req()).decode.name == "decode-0"
    router = Router([inst("prefill-0"), inst("decode-0", num_requests_waiting=40), inst("decode-1")],
                    policy="cost", index=index)
    assert router.route(req()).decode.name == "decode-1"


def test_cost_estimates_are_seconds_of_time_to_first_token():
    policy_choice = Router([inst("prefill-0"), inst("decode-0")], policy="cost")._choice(req(), [], 0.0)
    p = inst("prefill-0", num_prefill_tokens_waiting=4000)
    d = inst("decode-0", num_requests_waiting=3, kv_bytes_per_token=1000)
    assert estimated_seconds(PREFILL, p, policy_choice) == pytest.approx((4000 + 4096) / 4000)
    # 3 waiting + its own step, each in a batch of 4 (0.025 s at 1, + half of that per extra sequence until
    # measured), then its 4,096 tokens' KV at 2 GB/s
    assert estimated_seconds(DECODE, d, policy_choice) == pytest.approx(4 * 0.0625 + 4096 * 1000 / 2e9)
    assert isinstance(Router([inst("decode-0")], policy="cost").policy, CostPolicy)


def learned_decode(name, batches_and_steps, running_now=None):
    """A D whose polls timed decode steps at these (running batch, step seconds), then a poll that finds
    running_now running (else the last batch)."""
    d = inst(name, num_output_tokens_total=0, busy_seconds_total=0.0)
    out = busy = 0.0
    now = 0.0
    for batch, step in batches_and_steps:
        # a poll that sees the new batch before it steps (an interval with no work teaches nothing), then
        # 10 steps of it: the interval's batch is the mean of the two polls around it
        for num_steps in (0, 10):
            out, busy, now = out + num_steps * batch, busy + num_steps * step, now + 0.1
            assert d.update({"boot_id": "b", "block_size": BLOCK, "num_blocks": 100000, "num_free_blocks": 100000,
                             "max_num_seqs": 64, "num_requests_running": batch, "num_output_tokens_total": int(out),
                             "busy_seconds_total": busy}, now=now)
    if running_now is not None:
        assert d.update({**dataclasses.asdict(d.report), "num_requests_running": running_now}, now=now + 0.1)
    return d


def test_cost_spreads_over_equal_decodes_by_their_running_batch():
    # The bug: a D's part was its queue × its step time, blind to the streams it runs, so two equal Ds whose
    # step times differed by noise got every request on the faster-measured one.
    busy = learned_decode("decode-0", [(8, 0.070)] * 3, running_now=8)
    idle = learned_decode("decode-1", [(8, 0.075)] * 3, running_now=0)
    assert busy.decode_step_s < idle.decode_step_s
    router = Router([inst("prefill-0"), busy, idle], policy="cost")
    assert router.route(req()).decode is idle
    # and with none running anywhere, unrelated prompts alternate as the router's own count of them grows
    router = Router([inst("prefill-0"), inst("decode-0"), inst("decode-1")], policy="cost")
    picks = []
    for i in range(6):
        prompt = RouteRequest.from_token_ids([10000 * (i + 1) + t for t in range(256)], 16, BLOCK)
        route = router.route(prompt)
        router.begin(route.decode, prompt, 0.0, computes_prompt=False)
        picks.append(route.decode.name)
    assert picks.count("decode-0") == picks.count("decode-1") == 3


def test_cost_takes_turns_between_instances_whose_estimates_differ_by_noise():
    # The bug: two idle Ps whose learned rates differed by 10 % got every prompt on the faster-measured one
    # (CPU, mixed workload: 1.18x round-robin's TTFT). Within cost_tolerance they now take turns; a
    # difference beyond it (a queue, a cached prefix) still decides.
    def learned_prefill(name, seconds_per_10k):
        p = inst(name, num_prompt_tokens_computed_total=0, busy_seconds_total=0.0)
        p.update({"boot_id": "b", "num_prompt_tokens_computed_total": 10000, "busy_seconds_total": seconds_per_10k},
                 now=0.1)
        return p
    fast, slow = learned_prefill("prefill-0", 1.0), learned_prefill("prefill-1", 1.1)
    router = Router([fast, slow, inst("decode-0")], policy="cost")
    picks = [router.route(req()).prefill.name for _ in range(4)]
    assert picks == ["prefill-0", "prefill-1", "prefill-0", "prefill-1"]
    exact = Router([fast, slow, inst("decode-0")], policy="cost", config=RouterConfig(cost_tolerance=0.0))
    assert {exact.route(req()).prefill.name for _ in range(4)} == {"prefill-0"}
    far = learned_prefill("prefill-1", 1.5)
    router = Router([fast, far, inst("decode-0")], policy="cost")
    assert {router.route(req()).prefill.name for _ in range(4)} == {"prefill-0"}
    with pytest.raises(ValueError, match="cost_tolerance"):
        RouterConfig(cost_tolerance=1.5)


def test_among_tied_estimates_the_longest_cached_prefix_wins_every_time():
    # The bug: a P holding a conversation's history, tied with an idle one within the tolerance (its queue
    # costs about what the prefix saves), got only every other turn of it (CPU, multi-turn: 0.64x
    # round-robin's TTFT against 0.48x without the tolerance).
    index = PrefixIndex()
    holds(index, "prefill-1", 64)                   # 1,024 of 4,096 tokens cached
    rate = {"num_prompt_tokens_computed_total": 0, "busy_seconds_total": 0.0}
    cluster = [inst("prefill-0", **rate), inst("prefill-1", num_prefill_tokens_waiting=1000, **rate),
               inst("decode-0")]
    # prefill-0: 4,096 tokens; prefill-1: 1,000 queued + 3,072 uncached = 4,072: a tie
    router = Router(cluster, policy="cost", index=index)
    assert [router.route(req()).prefill.name for _ in range(4)] == ["prefill-1"] * 4


def test_the_step_time_of_a_decode_grows_with_its_batch_as_measured():
    d = learned_decode("decode-0", [(2, 0.020)] * 3 + [(10, 0.060)] * 3 + [(2, 0.020)] * 3)
    assert d.decode_step_s_at(10) > d.decode_step_s_at(2) > 0
    slope = (d.decode_step_s_at(10) - d.decode_step_s_at(2)) / 8
    assert slope == pytest.approx(0.005)                # 40 ms over 8 sequences
    flat = learned_decode("decode-1", [(2, 0.010)] * 3 + [(10, 0.010)] * 3 + [(2, 0.010)] * 3)
    assert flat.decode_step_s_at(20) == pytest.approx(flat.decode_step_s_at(1))   # weight-bound
    noisy = learned_decode("decode-2", [(2, 0.050)] * 3 + [(10, 0.010)] * 3 + [(2, 0.050)] * 3)
    assert noisy.decode_step_s_at(30) >= noisy.decode_step_s_at(1) >= 0    # never a negative slope


# --- hard caps ------------------------------------------------------------------------------------------------

def test_max_per_instance_excludes_busy_instances():
    router = Router([inst("prefill-0"), inst("decode-0", num_requests_running=4), inst("decode-1")],
                    config=RouterConfig(max_per_instance=4))
    assert {router.route(req()).decode.name for _ in range(3)} == {"decode-1"}
    for _ in range(4):
        router.by_name["decode-1"].begin()
    assert router.route(req()) is None and router.num_no_candidate == 1


def test_a_decode_needs_free_blocks_for_prompt_and_max_tokens():
    # 4,096 + 1,024 tokens = 320 blocks
    router = Router([inst("prefill-0"), inst("decode-0", num_free_blocks=319), inst("decode-1", num_free_blocks=320)])
    assert {router.route(req(max_tokens=1024)).decode.name for _ in range(3)} == {"decode-1"}
    router.begin(router.by_name["decode-1"], req(max_tokens=1024), now=0.0, computes_prompt=False)
    assert router.route(req(max_tokens=1024)) is None      # the blocks sent since its report count
    assert router.route(req(max_tokens=1)).decode.name == "decode-0"   # 257 blocks: decode-0 has them
    router = Router([inst("prefill-0"), inst("decode-0", num_free_blocks=300, num_blocks=300)])
    # larger than its whole cache: the instance's own 400 says so, not a 503 from the router
    assert router.route(req(max_tokens=1024)).decode.name == "decode-0"


def test_a_prefill_holding_too_much_for_transfer_takes_no_more():
    router = Router([inst("prefill-0", num_blocks=1000, num_blocks_held_for_transfer=950), inst("prefill-1"),
                     inst("decode-0")], config=RouterConfig(max_held_fraction=0.9))
    assert {router.route(req()).prefill.name for _ in range(3)} == {"prefill-1"}


def test_nothing_available_is_none():
    router = Router([inst("prefill-0"), inst("decode-0")])
    assert router.route(req(), exclude={"decode-0"}) is None
    router.by_name["decode-0"].record_failure(1)
    assert router.route(req()) is None
    assert router.num_no_candidate == 2


# --- the PD decider -------------------------------------------------------------------------------------------

def pd_router(threshold=512, policy="round-robin", index=None, **extra):
    cluster = [inst("prefill-0", **extra.pop("prefill", {})), inst("decode-0", **extra.pop("decode", {})),
               inst("decode-1")]
    return Router(cluster, policy=policy, config=RouterConfig(pd_min_prompt_tokens=threshold, **extra),
                  index=index)


def test_short_prompts_go_direct():
    router = pd_router(512)
    assert names(router.route(req(511))) == (None, "decode-0", "short_prompt")
    assert router.route(req(512)).reason == "disaggregated"
    assert router.decisions["short_prompt"] == 1 and router.decisions["disaggregated"] == 1


def test_zero_threshold_always_disaggregates():
    router = pd_router(0)
    assert router.route(req(1)).reason == "disaggregated"
    assert not router.needs_tokens


def test_a_decode_holding_the_prefix_takes_the_follow_up_turn():
    index = PrefixIndex()
    holds(index, "decode-1", 230)                  # all but 416 tokens
    router = pd_router(512, index=index)
    assert names(router.route(req())) == (None, "decode-1", "decode_has_prefix")
    holds(index, "decode-1", 200)                  # all but 896: a P computes it faster
    assert router.route(req()).reason == "disaggregated"


def test_prefill_saturated_goes_direct_while_the_decode_has_headroom():
    router = pd_router(512, prefill={"num_blocks": 100, "num_blocks_held_for_transfer": 99},
                       decode={"num_prefill_tokens_waiting": 100000})
    # no P candidate; decode-0 has 25 s of prefill queued, decode-1 none: 2,048 tokens ≈ 0.5 s at the default
    assert names(router.route(req(2048))) == (None, "decode-1", "prefill_saturated")
    router.by_name["decode-1"].update({"boot_id": "b", "num_prefill_tokens_waiting": 100000}, now=0.1)
    assert router.route(req(2048)) is None           # a P is up but full, no D has room: 503, retry
    router.by_name["prefill-0"].record_failure(1)    # every P down: any D, slower beats not at all
    assert router.route(req(2048)).reason == "prefill_saturated"
    assert router.decisions["prefill_saturated"] == 2 and router.num_no_candidate == 1


def test_a_backlogged_prefill_pool_sends_prompts_to_a_decode_with_headroom():
    """Every P with more than the headroom of prompts queued: a D that would finish this prompt within the
    headroom computes it itself; an idle P, or a D past its headroom, and the P/D route is taken."""
    router = pd_router(512, prefill={"num_prefill_tokens_waiting": 8000})   # 2 s at the default 4,000 tok/s
    assert names(router.route(req(2048))) == (None, "decode-0", "prefill_backlog")
    assert router.decisions["prefill_backlog"] == 1
    for d in ("decode-0", "decode-1"):            # both Ds past the headroom: the P queue it is
        router.by_name[d].update({"boot_id": "b", "num_prefill_tokens_waiting": 4000}, now=0.1)
    assert router.route(req(2048)).reason == "disaggregated"
    router.by_name["prefill-0"].update({"boot_id": "b", "num_prefill_tokens_waiting": 100}, now=0.1)
    router.by_name["decode-1"].update({"boot_id": "b", "num_prefill_tokens_waiting": 0}, now=0.1)
    assert router.route(req(2048)).reason == "disaggregated"   # the P is not backlogged


def test_no_backlog_rule_at_zero_headroom():
    router = pd_router(512, prefill={"num_prefill_tokens_waiting": 10 ** 6}, direct_prefill_headroom_s=0.0)
    assert router.route(req(2048)).reason == "disaggregated"
    with pytest.raises(ValueError, match="direct_prefill_headroom_s"):
        RouterConfig(direct_prefill_headroom_s=-1.0)


def test_a_decode_without_a_measured_rate_is_taken_at_the_prefills_rate():
    """A D that never prefilled has no rate of its own: the default (4,000 tokens/s) would let a slow CPU D
    take a burst's worth of prompts at once. It is taken at the P's measured rate instead."""
    router = pd_router(0, prefill={"num_prefill_tokens_waiting": 8000})
    router.by_name["prefill-0"]._prefill_tokens_per_s = 500.0       # measured: a CPU P
    # at 500 tokens/s the P's queue is 16 s: backlogged; a 256-token prompt is 0.5 s on a D at that rate
    assert router.route(req(256)).reason == "prefill_backlog"
    # 2,048 tokens would be 4 s at the P's rate (0.5 s at the default): over the headroom
    assert router.route(req(2048)).reason == "disaggregated"


def test_a_prefill_that_failed_the_request_counts_as_down():
    router = pd_router(512, decode={"num_prefill_tokens_waiting": 100000})
    router.by_name["decode-1"].update({"boot_id": "b", "num_prefill_tokens_waiting": 100000}, now=0.1)
    assert router.route(req(), exclude={"prefill-0"}).reason == "prefill_saturated"


def test_colocated_pools_count_colocated():
    router = Router([inst("colocated-0"), inst("colocated-1")], config=RouterConfig(pd_min_prompt_tokens=512))
    assert router.mode == "colocated"
    assert [names(router.route(req(n))) for n in (10, 4096)] == [(None, "colocated-0", "colocated"),
                                                                  (None, "colocated-1", "colocated")]
    assert router.decisions["colocated"] == 2


def test_a_mixed_pool_sends_short_prompts_to_colocated_and_decode_instances_alike():
    router = Router([inst("prefill-0"), inst("decode-0"), inst("colocated-0")],
                    config=RouterConfig(pd_min_prompt_tokens=512))
    assert {router.route(req(100)).decode.name for _ in range(2)} == {"decode-0", "colocated-0"}
    assert {router.route(req()).decode.name for _ in range(2)} == {"decode-0"}   # KV goes to a D only


# --- recovery -------------------------------------------------------------------------------------------------

def test_replacement_is_another_decode_or_colocated_instance():
    router = Router([inst("prefill-0"), inst("decode-0"), inst("decode-1")])
    assert router.replacement(req(), exclude={"decode-0"}).name == "decode-1"
    assert router.replacement(req(), exclude={"decode-0", "decode-1"}) is None
    assert router.num_replacements == 1 and router.num_no_replacement == 1


def test_replacement_goes_over_a_cap_rather_than_losing_the_stream():
    router = Router([inst("prefill-0"), inst("decode-0"), inst("decode-1", num_requests_running=8)],
                    config=RouterConfig(max_per_instance=8))
    assert router.replacement(req(), exclude={"decode-0"}).name == "decode-1"
    router.by_name["decode-1"].record_failure(1)
    assert router.replacement(req(), exclude={"decode-0"}) is None


# --- accounting, tokens, counters -----------------------------------------------------------------------------

def test_begin_counts_the_uncached_prompt_and_the_blocks_and_end_gives_them_back():
    index = PrefixIndex()
    holds(index, "decode-0", 100)
    holds(index, "decode-1", 100)
    router = Router([inst("prefill-0", num_free_blocks=1000), inst("decode-0", num_free_blocks=1000),
                     inst("decode-1", num_free_blocks=1000)], index=index)
    p, fed, direct = router.by_name["prefill-0"], router.by_name["decode-0"], router.by_name["decode-1"]
    tickets = [(p, router.begin(p, req(max_tokens=64), now=0.0, computes_prompt=True))]
    assert p.queued_prefill_tokens == 4096 and p.free_blocks == 1000 - 256
    tickets.append((fed, router.begin(fed, req(max_tokens=64), now=0.0, computes_prompt=False)))
    assert fed.queued_prefill_tokens == 0 and fed.free_blocks == 1000 - (260 - 100)   # its prefix is reused
    tickets.append((direct, router.begin(direct, req(max_tokens=64), now=0.0, computes_prompt=True)))
    assert direct.queued_prefill_tokens == 4096 - 1600
    # each now holds the whole prompt, as far as the router can tell
    assert index.match(HASHES, now=1.0) == {"prefill-0": 256, "decode-0": 256, "decode-1": 256}
    for instance, ticket in tickets:
        router.end(instance, ticket)
    assert all(i.num_in_flight == 0 and i.free_blocks == 1000 and i.queued_prefill_tokens == 0
               for i in (p, fed, direct))


def test_needs_tokens_and_hash_params():
    assert not Router([inst("prefill-0"), inst("decode-0")]).needs_tokens
    assert Router([inst("prefill-0"), inst("decode-0")], policy="cost").needs_tokens
    assert Router([inst("prefill-0"), inst("decode-0")], config=RouterConfig(pd_min_prompt_tokens=1)).needs_tokens
    router = Router([inst("colocated-0", block_size=32, hash_extra="m")], config=RouterConfig(pd_min_prompt_tokens=1))
    assert not router.needs_tokens and router.hash_params() == (32, "m")
    request = router.request(100, 8, TOKENS[:100])
    assert request.block_hashes == hash_prompt_blocks(TOKENS[:100], 32, "m") and request.num_prompt_tokens == 100
    assert router.request(100, 8).block_hashes is None


def test_counters_and_cluster_status():
    index = PrefixIndex()
    holds(index, "decode-0", 3)
    router = Router([inst("prefill-0"), inst("decode-0")], index=index, config=RouterConfig(pd_min_prompt_tokens=64))
    router.route(req(10))
    router.route(req())
    router.route(req(), exclude={"decode-0"})
    counters = router.counters()
    assert counters["policy"] == "round-robin"
    assert counters["decisions"] == {"short_prompt": 1, "decode_has_prefix": 0, "prefill_saturated": 0,
                                     "prefill_backlog": 0, "disaggregated": 1, "colocated": 0}
    assert counters["no_candidate"] == 1
    status = router.cluster_status()
    assert status["mode"] == "pd" and [i["name"] for i in status["instances"]] == ["prefill-0", "decode-0"]
    assert status["instances"][1]["cached_blocks"] == 3
    counters["decisions"]["short_prompt"] = 99              # a copy: /metrics cannot corrupt the router
    assert router.decisions["short_prompt"] == 1


def test_route_is_a_plain_value():
    d = inst("decode-0")
    assert Route(None, d, "colocated") == Route(None, d, "colocated")


def test_route_request_checks_its_numbers():
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        RouteRequest(-1)
    with pytest.raises(ValueError, match="pd_min_prompt_tokens"):
        RouterConfig(pd_min_prompt_tokens=-1)
    with pytest.raises(ValueError, match="max_held_fraction"):
        RouterConfig(max_held_fraction=0.0)
