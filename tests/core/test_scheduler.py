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
