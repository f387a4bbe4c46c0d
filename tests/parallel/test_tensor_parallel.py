"""Tensor parallelism on CPU (gloo, one process per rank): output token-identical to one rank, refusals at
start, and the ways out (a rank killed, the engine killed). The row-parallel all-reduce sums in another
order than one rank's matmul, so where greedy output differs the test must show a near-tie: the logit gap
of the two tokens at the first difference, from transformers on the same weights."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.outputs import FinishReason
from pdserve.sampling_params import SamplingParams
from tests.helpers_models import make_tiny_hf_model

NEAR_TIE = 1e-3   # a logit gap this small (fp32 logits of order 10) can flip on summation order


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def assert_same_or_near_tie(want: list[int], got: list[int], prompt_ids: list[int], hf_model) -> None:
    """got == want, or they part at a position where the reference's two tokens are a near-tie."""
    if got == want:
        return
    first = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids + want[:first]])).logits[0, -1]
    gap = abs(float(logits[want[first]] - logits[got[first]]))
    assert gap < NEAR_TIE, f"outputs part at token {first} ({want[first]} vs {got[first]}), logit gap {gap:.3g}"


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    return {"llama": make_tiny_hf_model(root, "llama"),
            "qwen2": make_tiny_hf_model(root, "qwen2"),   # q/k/v bias, tied embeddings
            "llama-odd-vocab": make_tiny_hf_model(root, "llama", vocab_size=267)}   # 267 rows over 2 ranks


PROMPTS = [[1, 2, 3, 4, 5], list(range(40, 100)), [7] * 33]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)


def generate(path: str, tp: int, load_format: str = "auto") -> list[list[int]]:
    llm = LLM(path, tensor_parallel_size=tp, load_format=load_format, kv_cache_memory=16 << 20,
              max_num_batched_tokens=32)   # chunked prompts: steps that mix prefill and decode
    try:
        return [r.token_ids for r in llm.generate(PROMPTS, GREEDY) + llm.generate(PROMPTS, SEEDED)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-odd-vocab"])
def test_two_ranks_give_one_ranks_tokens(tiny_paths, name):
    want = generate(tiny_paths[name], 1)
    got = generate(tiny_paths[name], 2)
    assert got == want


def test_dummy_weights_are_the_same_whatever_the_number_of_ranks(tiny_paths):
    assert generate(tiny_paths["llama"], 2, "dummy") == generate(tiny_paths["llama"], 1, "dummy")


def test_the_default_model_at_three_ranks(default_llm, hf_default_model):
    prompts = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = default_llm.generate(prompts, params)
    llm = LLM("default", tensor_parallel_size=3, kv_cache_memory=256 << 20)
    try:
        got = llm.generate(prompts, params)
        seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
        assert [r.token_ids for r in llm.generate(prompts, seeded)] == \
            [r.token_ids for r in default_llm.generate(prompts, seeded)]
    finally:
        llm.shutdown()
    for w, g in zip(want, got):
        assert_same_or_near_tie(w.token_ids, g.token_ids, w.prompt_token_ids, hf_default_model)


def test_a_size_that_does_not_divide_the_heads_is_refused_and_leaves_no_process():
    before = set(os.listdir("/proc"))
    with pytest.raises(ValueError, match=r"9 query heads, 3 KV heads .*sizes that do: 1, 3"):
        LLM("default", tensor_parallel_size=2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = [p for p in set(os.listdir("/proc")) - before if p.isdigit() and alive(int(p))
                    and "pdserve.worker.tp_executor" in open(f"/proc/{p}/cmdline").read().replace("\0", " ")]
        if not children:
            break
        time.sleep(0.2)
    assert not children


def test_a_killed_rank_fails_the_step_and_breaks_the_engine(tiny_paths):
    llm = LLM(tiny_paths["llama"], tensor_parallel_size=2, kv_cache_memory=16 << 20)
    try:
        rank1 = llm.engine.runner.workers[0]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.wait(10)
        result, = llm.generate([[1, 2, 3]], GREEDY)
        assert result.finish_reason == FinishReason.ERROR and "engine step failed" in result.error
        assert llm.engine.broken is not None and "rank 1" in llm.engine.broken
    finally:
        llm.shutdown()
    assert not llm.engine.runner.workers


def test_the_ranks_end_with_the_engine_process_even_a_sigkilled_one(tiny_paths):
    script = textwrap.dedent(f"""
        from pdserve.engine.llm import LLM
        llm = LLM({tiny_paths['llama']!r}, tensor_parallel_size=2, kv_cache_memory=16 << 20)
        print(*[w.pid for w in llm.engine.runner.workers], flush=True)
        import time; time.sleep(600)
    """)
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
        assert pids and all(alive(p) for p in pids)
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_a_hung_rank_breaks_the_engine_at_the_collective_timeout(tiny_paths, monkeypatch):
    """gloo's timeout is a plain RuntimeError and the stopped rank has not exited: before, the step failed
    as an ordinary one and every later step failed too, with the engine never broken (review, 2026-12-04)."""
    monkeypatch.setenv("PDSERVE_TP_COLLECTIVE_TIMEOUT_S", "3")   # read by every rank at start
    import pdserve.parallel.group as group
    import pdserve.worker.tp_executor as executor
    monkeypatch.setattr(group, "COLLECTIVE_TIMEOUT_S", 3.0)
    monkeypatch.setattr(executor, "COLLECTIVE_TIMEOUT_S", 3.0)
    llm = LLM(tiny_paths["llama"], tensor_parallel_size=2, kv_cache_memory=16 << 20)
    rank1 = llm.engine.runner.workers[0]
    try:
        os.kill(rank1.pid, signal.SIGSTOP)
        start = time.monotonic()
        result, = llm.generate([[1, 2, 3]], GREEDY)
        assert time.monotonic() - start < 60
        assert result.finish_reason == FinishReason.ERROR
        assert llm.engine.broken is not None and "collective failed" in llm.engine.broken
    finally:
        os.kill(rank1.pid, signal.SIGCONT)
        llm.shutdown()


def test_a_second_tensor_parallel_instance_in_a_process_is_refused_and_the_first_serves_on(tiny_paths):
    llm = LLM(tiny_paths["llama"], tensor_parallel_size=2, kv_cache_memory=16 << 20)
    try:
        want = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
        with pytest.raises(ValueError, match="one tensor-parallel instance per process"):
            LLM(tiny_paths["llama"], tensor_parallel_size=2, kv_cache_memory=16 << 20)
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == want
    finally:
        llm.shutdown()


def test_ranks_outlive_the_thread_that_started_them(tiny_paths):
    """PR_SET_PDEATHSIG fired when the creating thread ended: an LLM built in a thread lost its ranks."""
    box = []
    thread = threading.Thread(target=lambda: box.append(LLM(tiny_paths["llama"], tensor_parallel_size=2,
                                                            kv_cache_memory=16 << 20)))
    thread.start()
    thread.join()
    llm, = box
    try:
        time.sleep(2)
        assert all(w.poll() is None for w in llm.engine.runner.workers)
        assert all(r.finish_reason != FinishReason.ERROR for r in llm.generate(PROMPTS, GREEDY))
    finally:
        llm.shutdown()


def test_an_interrupt_mid_step_breaks_the_engine_instead_of_leaving_the_ranks_out_of_step(tiny_paths):
    llm = LLM(tiny_paths["llama"], tensor_parallel_size=2, kv_cache_memory=16 << 20)
    try:
        runner = llm.engine.runner.runner
        real_launch = runner.launch

        def interrupted(out):
            runner.launch = real_launch
            raise KeyboardInterrupt
        runner.launch = interrupted
        llm.add(PROMPTS[0], GREEDY)
        with pytest.raises(KeyboardInterrupt):
            llm.engine.step()
        result, = llm.generate([[1, 2, 3]], GREEDY)
        assert result.finish_reason == FinishReason.ERROR and "out of step" in llm.engine.broken
    finally:
        llm.shutdown()


def test_a_rank_that_died_while_idle_breaks_the_engine_before_a_request_meets_it(tiny_paths):
    llm = LLM(tiny_paths["llama"], tensor_parallel_size=2, kv_cache_memory=16 << 20)
    try:
        llm.engine.check_ranks()
        assert llm.engine.broken is None
        rank1 = llm.engine.runner.workers[0]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.wait(10)
        llm.engine.check_ranks()
        assert llm.engine.broken is not None and "rank 1" in llm.engine.broken
    finally:
        llm.shutdown()


def test_the_load_report_counts_every_ranks_kv_bytes(tiny_paths):
    one = LLM(tiny_paths["llama"], kv_cache_memory=16 << 20)
    two = LLM(tiny_paths["llama"], tensor_parallel_size=2, kv_cache_memory=16 << 20)
    try:
        assert two.engine.kv_bytes_per_token == one.engine.kv_bytes_per_token
    finally:
        two.shutdown()
        one.shutdown()


def test_a_pd_instance_with_a_stopped_rank_shuts_down_and_leaves_no_rank(tiny_paths, monkeypatch):
    """Before, the connector's shutdown raised RankLost (its call to the stopped rank timed out) and the
    ranks' own shutdown, which SIGKILLs a rank that does not exit, never ran: the rank stayed, stopped."""
    import pdserve.worker.tp_executor as executor
    from pdserve.config import KVTransferConfig
    monkeypatch.setattr(executor, "CALL_TIMEOUT_S", 3.0)
    llm = LLM(tiny_paths["llama"], tensor_parallel_size=2, kv_cache_memory=16 << 20,
              kv_transfer_config=KVTransferConfig(kv_connector="nixl", kv_role="consumer", engine_id="tp-d"))
    rank1 = llm.engine.runner.workers[0]
    try:
        os.kill(rank1.pid, signal.SIGSTOP)
        llm.shutdown()
        assert rank1.wait(15) is not None
    finally:
        if rank1.poll() is None:
            os.kill(rank1.pid, signal.SIGKILL)


def test_a_start_up_that_times_out_says_the_ranks_were_still_running(tiny_paths, monkeypatch):
    """Seen once on a loaded machine: the rendezvous timed out and the error named no rank."""
    import pdserve.worker.tp_executor as executor

    def stuck_join(rank, size, store, device):
        raise TimeoutError("wait timeout after 120000ms")
    monkeypatch.setattr(executor, "_join_group", stuck_join)
    with pytest.raises(RuntimeError, match=r"tensor parallel start-up failed: TimeoutError with every rank "
                                           r"still running \(pids \d+"):
        LLM(tiny_paths["llama"], tensor_parallel_size=2, kv_cache_memory=16 << 20)
