import pytest

from pdserve.core.batch import PLACEHOLDER_TOKEN_ID
from pdserve.core.request import Request, RequestStatus
from pdserve.sampling_params import SamplingParams

from tests.core.helpers import FakeRunner, assert_no_leaks, fake_token, make_scheduler, run_to_completion


def expected(prompt_len: int, n: int) -> list[int]:
    return [fake_token(prompt_len - 1 + i) for i in range(n)]


def req(rid, n_prompt, max_tokens=5, base=0, **kw):
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, **kw))


def test_single_request_lifecycle():
    s = make_scheduler()
    s.add_request(req("a", 10))
    out = s.schedule()
    assert [(r.request_id, len(r.token_ids), r.do_sample) for r in out.scheduled] == [("a", 10, True)]
    runner = FakeRunner(64)
    updates = s.update_from_output(out, runner.execute(out))
    assert updates[0].new_token_ids == [fake_token(9)]
    results, statuses = run_to_completion(s, runner)
    assert [fake_token(9)] + results["a"] == expected(10, 5)
    assert statuses["a"][0] == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_no_leaks(s)


def test_chunked_prefill_under_tiny_budget():
    s = make_scheduler(max_num_batched_tokens=3)
    s.add_request(req("a", 10))
    s.add_request(req("b", 7, base=100))
    results, _ = run_to_completion(s, FakeRunner(64))
    assert results["a"] == expected(10, 5) and results["b"] == expected(7, 5)
    assert_no_leaks(s)


def test_no_chunked_prefill_waits_for_budget():
    s = make_scheduler(max_num_batched_tokens=10, chunked=False)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10, base=50))
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["a"]
    s.update_from_output(out, FakeRunner(64).execute(out))
    results, _ = run_to_completion(s, FakeRunner(64))
    assert len(results["b"]) == 5
    assert_no_leaks(s)


def test_decodes_scheduled_before_new_prompts():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(req("a", 4))
    runner = FakeRunner(64)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    s.add_request(req("b", 20, base=30))
    out = s.schedule()
    assert out.scheduled[0].request_id == "a" and len(out.scheduled[0].token_ids) == 1
    assert out.scheduled[1].request_id == "b" and len(out.scheduled[1].token_ids) == 7
    s.update_from_output(out, runner.execute(out))  # a scheduled step always lands before the next
    run_to_completion(s, runner)
    assert_no_leaks(s)


def test_prefix_cache_hit_counts_and_identical_output():
    s = make_scheduler()
    s.add_request(req("a", 13))
    results_a, _ = run_to_completion(s, FakeRunner(64))
    s.add_request(req("b", 13))
    out = s.schedule()
    assert out.scheduled[0].num_computed_tokens == 12  # 3 full blocks hit, last token recomputed
    runner = FakeRunner(64)
    s.update_from_output(out, runner.execute(out))
    run_to_completion(s, runner)
    assert s.kv.prefix_cache_hits == 12
    assert_no_leaks(s)


def test_preemption_by_recompute_gives_same_tokens():
    s = make_scheduler(num_blocks=8, block_size=4)
    reqs = [req(f"r{i}", 6, max_tokens=8, base=10 * i) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    results, _ = run_to_completion(s, FakeRunner(8))
    for i in range(4):
        assert results[f"r{i}"] == expected(6, 8)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert_no_leaks(s)


def test_abort_waiting_and_running():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(req("a", 5, max_tokens=50))
    s.add_request(req("b", 5, max_tokens=50))
    runner = FakeRunner(64)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    s.abort_requests(["a", "b", "unknown"])
    out = s.schedule()
    updates = s.update_from_output(out, runner.execute(out))
    assert {u.request.request_id for u in updates if u.finished} == {"a", "b"}
    assert all(u.request.status == RequestStatus.FINISHED_ABORTED for u in updates)
    assert_no_leaks(s)


def test_eos_and_stop_token_ids_and_ignore_eos():
    s = make_scheduler()
    eos = fake_token(5 - 1 + 2)  # the third generated token
    s.add_request(Request("a", list(range(5)), SamplingParams(max_tokens=10), eos_token_ids=(eos,)))
    s.add_request(Request("b", list(range(5)), SamplingParams(max_tokens=10, ignore_eos=True),
                          eos_token_ids=(eos,)))
    s.add_request(Request("c", list(range(5)), SamplingParams(max_tokens=10, stop_token_ids=[eos])))
    results, statuses = run_to_completion(s, FakeRunner(64))
    assert len(results["a"]) == 3 and statuses["a"][0] == RequestStatus.FINISHED_STOPPED
    assert len(results["b"]) == 10
    assert len(results["c"]) == 3
    assert_no_leaks(s)


def test_request_too_big_for_cache_is_refused_and_max_tokens_capped():
    s = make_scheduler(num_blocks=4, block_size=4)
    try:
        s.add_request(req("big", 16))
        raise AssertionError("expected ValueError")
    except ValueError as e:
        assert "KV cache" in str(e)
    r = req("ok", 10, max_tokens=100)
    s.add_request(r)
    assert r.max_tokens == 6
    results, _ = run_to_completion(s, FakeRunner(4))
    assert len(results["ok"]) == 6
    assert_no_leaks(s)


def test_many_concurrent_mixed_lengths():
    s = make_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=16, max_num_seqs=6)
    for i in range(32):
        s.add_request(req(f"r{i}", 1 + (i * 5) % 23, max_tokens=1 + i % 7, base=i))
    results, _ = run_to_completion(s, FakeRunner(40))
    for i in range(32):
        assert results[f"r{i}"] == expected(1 + (i * 5) % 23, 1 + i % 7)
    assert_no_leaks(s)


def test_abort_of_the_last_request_still_counts_as_work_until_reported():
    s = make_scheduler()
    s.add_request(req("a", 5, max_tokens=50))
    runner = FakeRunner(64)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    s.abort_requests(["a"])
    assert s.has_unfinished()  # the abort's final output and the runner's cleanup are pending
    out = s.schedule()
    assert "a" in out.finished_request_ids
    updates = s.update_from_output(out, runner.execute(out))
    assert [u.request.status for u in updates] == [RequestStatus.FINISHED_ABORTED]
    assert not s.has_unfinished()
    assert_no_leaks(s)


def test_prefix_cache_counters_count_each_admitted_request_once():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4)
    s.add_request(req("a", 16, max_tokens=4))          # holds 4-5 of the 6 blocks
    s.add_request(req("b", 12, max_tokens=1, base=50))  # cannot be admitted until a finishes
    runner = FakeRunner(6)
    for _ in range(3):
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
    run_to_completion(s, runner)
    assert s.kv.prefix_cache_queries == 16 + 12
    assert_no_leaks(s)


def _mixed_workload(s):
    # chunked prompts, different lengths, and stop tokens that end requests unpredictably
    for i in range(6):
        stop = [fake_token(5 + 7 * i - 1 + 2)] if i % 2 else []  # the third output token
        s.add_request(req(f"r{i}", 5 + 7 * i, max_tokens=3 + 4 * i, base=20 * i, stop_token_ids=stop))


def test_async_scheduling_same_tokens_as_sync_with_placeholders_filled():
    sync_s, async_s = make_scheduler(max_num_batched_tokens=16), make_scheduler(max_num_batched_tokens=16)
    _mixed_workload(sync_s)
    _mixed_workload(async_s)
    sync_results, sync_statuses = run_to_completion(sync_s, FakeRunner(64), async_scheduling=False)
    runner = FakeRunner(64)
    async_results, async_statuses = run_to_completion(async_s, runner, async_scheduling=True)
    assert async_results == sync_results
    assert {k: v[0] for k, v in async_statuses.items()} == {k: v[0] for k, v in sync_statuses.items()}
    assert RequestStatus.FINISHED_STOPPED in {v[0] for v in async_statuses.values()}
    assert runner.num_placeholders > 0  # decodes were scheduled before their input token was known
    assert_no_leaks(async_s)


def test_async_scheduling_never_schedules_past_max_tokens():
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=2))
    out1 = s.schedule()                          # the prompt; samples token 1
    out2 = s.schedule()                          # step 1 in flight: the decode of token 2
    assert [len(i.token_ids) for i in out2.scheduled] == [1] and out2.scheduled[0].token_ids == [PLACEHOLDER_TOKEN_ID]
    out3 = s.schedule()                          # token 2 is the last: nothing more to run
    assert out3.is_empty
    runner = FakeRunner(64)
    r1, r2 = runner.execute(out1), runner.execute(out2)
    assert [u.new_token_ids for u in s.update_from_output(out1, r1)] == [[fake_token(3)]]
    updates = s.update_from_output(out2, r2)
    assert updates[0].new_token_ids == [fake_token(4)] and updates[0].finished
    s.update_from_output(out3, runner.execute(out3))
    assert_no_leaks(s)


def test_async_scheduling_drops_the_step_of_a_request_preempted_while_in_flight():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8, base=50))
    runner = FakeRunner(4)
    out1 = s.schedule()                          # both prompts: 4 blocks, all of them
    r1 = runner.execute(out1)
    out2 = s.schedule()                          # decodes at position 8 need a third block each: b gives way
    assert [i.request_id for i in out2.scheduled] == ["a"] and s.num_preemptions == 1
    r2 = runner.execute(out2)
    updates = s.update_from_output(out1, r1)     # b's prompt step landed after b was preempted: dropped
    assert [u.request.request_id for u in updates] == ["a"]
    s.update_from_output(out2, r2)
    results, _ = run_to_completion(s, runner, async_scheduling=True)
    assert [fake_token(7), fake_token(8)] + results["a"] == expected(8, 8)
    assert results["b"] == expected(8, 8)        # recomputed from scratch, same tokens
    assert_no_leaks(s)


def test_async_scheduling_frees_a_stopped_request_only_after_its_inflight_step_lands():
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=8, stop_token_ids=[fake_token(3)]))  # stops on its first token
    runner = FakeRunner(64)
    out1 = s.schedule()
    r1 = runner.execute(out1)
    out2 = s.schedule()                  # a's next decode, already on the device
    r2 = runner.execute(out2)
    updates = s.update_from_output(out1, r1)
    assert updates[0].finished and updates[0].request.status == RequestStatus.FINISHED_STOPPED
    free_before = s.kv.num_free_blocks
    assert s.kv.num_blocks_of("a") == 2 and s.has_unfinished()  # step 2 still writes into the second
    assert s.update_from_output(out2, r2) == []                  # step 2's token is dropped
    assert s.kv.num_free_blocks == free_before + 2
    out3 = s.schedule()
    s.update_from_output(out3, runner.execute(out3))  # the runner forgets a
    assert out3.finished_request_ids == {"a"} and not s.has_unfinished()
    assert_no_leaks(s)


def test_request_id_of_a_request_freed_after_landing_cannot_be_reused_until_it_lands():
    """Blocks are keyed by request id: a new request under the id of one whose blocks still wait for
    its in-flight step would take them over (and that step's token)."""
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=8))
    runner = FakeRunner(64)
    out1 = s.schedule()
    r1 = runner.execute(out1)
    out2 = s.schedule()                      # a's decode in flight
    r2 = runner.execute(out2)
    s.update_from_output(out1, r1)
    s.abort_requests(["a"])                  # freed only when step 2 lands
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", 4, max_tokens=8))
    s.update_from_output(out2, r2)
    s.add_request(req("a", 4, max_tokens=3))  # now it may
    results, _ = run_to_completion(s, runner)
    assert results["a"] == expected(4, 3)
    assert_no_leaks(s)


def test_async_scheduling_does_not_preempt_a_request_whose_last_token_is_in_flight():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    s.add_request(req("a", 8, max_tokens=8))            # needs a third block at position 8
    s.add_request(req("b", 8, max_tokens=8, base=50))
    s.add_request(req("c", 7, max_tokens=1, base=80))   # the newest; its only token is sampled by step 1
    runner = FakeRunner(6)
    out1 = s.schedule()                                  # all 6 blocks in use
    r1 = runner.execute(out1)
    out2 = s.schedule()                                  # a's and b's decodes need blocks: someone gives way
    assert "c" not in {i.request_id for i in out2.scheduled}
    assert s.requests["c"].status == RequestStatus.RUNNING  # not preempted: it finishes when step 1 lands
    assert s.requests["b"].status == RequestStatus.PREEMPTED and out2.dropped_sample_ids == {"b"}
    finished = {u.request.request_id: u.request.status for u in s.update_from_output(out1, r1) if u.finished}
    assert finished == {"c": RequestStatus.FINISHED_LENGTH_CAPPED}
    s.update_from_output(out2, runner.execute(out2))
    results, _ = run_to_completion(s, runner)
    assert results["b"] == expected(8, 8)
    assert_no_leaks(s)
