"""`pdserve serve --tensor-parallel-size 3` on the default model: the same tokens as one rank, over HTTP;
a rank killed ends the instance (exit code 1, for its supervisor), with no request needed to notice;
no rank outlives it."""
from __future__ import annotations

import os
import signal
import time

import pytest

from pdserve.sampling_params import SamplingParams
from tests.e2e.cluster import serve, wait_until
from tests.parallel.test_tensor_parallel import alive, assert_same_or_near_tie


@pytest.fixture(scope="module")
def tp_server():
    proc = serve("tp3", "--tensor-parallel-size", "3")
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


def test_three_ranks_answer_with_one_ranks_tokens(tp_server, default_llm, hf_default_model):
    prompt = "Write a short story about a lighthouse keeper."
    want, = default_llm.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    status, body = tp_server.post("/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 48,
                                                      "temperature": 0, "ignore_eos": True,
                                                      "return_token_ids": True})
    assert status == 200
    assert_same_or_near_tie(want.token_ids, body["choices"][0]["token_ids"], want.prompt_token_ids,
                            hf_default_model)


def test_a_rank_killed_while_idle_ends_the_instance_with_exit_code_1(tp_server):
    """Before, an idle instance noticed a dead rank only when a request failed on it, and `serve` then
    exited with 0, which a supervisor restarting only on failure would take for a clean stop."""
    pids = tp_server.pids()
    ranks = [p for p in pids if "pdserve.worker.tp_executor" in open(f"/proc/{p}/cmdline").read()]
    assert len(ranks) == 2
    os.kill(ranks[0], signal.SIGKILL)
    assert wait_until(lambda: tp_server.proc.poll() is not None, timeout=30)   # no request needed
    assert tp_server.proc.returncode == 1
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_sigterm_with_a_rank_stopped_ends_streams_with_an_error_and_leaves_no_rank():
    """A SIGTERM while a rank is stopped (SIGSTOP: its step's collective never completes) used to wait out
    the 120 s collective timeout, cut the streams without an error event, and leave the stopped rank
    behind (its parent watch cannot run). Now the drain ends the stream with an error event, the hung
    engine process is terminated, and its ranks are killed by pid."""
    import http.client
    import json

    proc = serve("tp3-drain", "--tensor-parallel-size", "3", "--drain-timeout", "2").wait_healthy()
    try:
        pids = proc.pids()
        ranks = [p for p in pids if "pdserve.worker.tp_executor" in open(f"/proc/{p}/cmdline").read()]
        conn = http.client.HTTPConnection("127.0.0.1", proc.port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": "default", "prompt": "Tell me a story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")
        os.kill(ranks[0], signal.SIGSTOP)
        time.sleep(0.5)
        start = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        events = [raw.decode() for raw in resp if raw.startswith(b"data: ")]
        assert any('"error"' in e and "shutting down" in e for e in events), events[-3:]
        assert time.monotonic() - start < 2 + 10
        proc.proc.wait(timeout=40)
        assert wait_until(lambda: not any(alive(p) for p in pids), timeout=10)
    finally:
        for pid in proc.pids():
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        proc.stop()
