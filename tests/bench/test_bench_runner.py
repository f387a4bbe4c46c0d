"""run_benchmark, run_sweep and the CLI against the fake server: pacing, concurrency, failures, output."""
import argparse
import asyncio
import io
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.cli import add_bench_subparsers
from pdserve.bench.runner import BenchConfig, ProgressBar, run_benchmark, run_sweep


def config(server, **overrides):
    base = dict(base_url=server.base_url, num_prompts=6, input_len=8, output_len=3, seed=0)
    return BenchConfig(**{**base, **overrides})


def test_inf_rate_sends_everything_at_once_and_finds_the_model(fake_server):
    result = asyncio.run(run_benchmark(config(fake_server, num_prompts=8)))
    assert result.config.model == fake_server.model_id
    assert result.metrics["num_completed"] == 8 and result.metrics["num_failed"] == 0
    assert max(r.start_time for r in result.records) < 0.1
    assert fake_server.max_in_flight == 8
    assert result.metrics["total_output_tokens"] == 24 and result.metrics["total_prompt_tokens"] == 64
    assert [r.index for r in result.records] == list(range(8))


def test_finite_rate_sends_each_request_at_its_arrival_time(fake_server):
    result = asyncio.run(run_benchmark(config(fake_server, request_rate=25.0)))
    scheduled = [r.scheduled_time for r in result.records]
    assert scheduled[0] == 0.0 and scheduled == sorted(scheduled) and scheduled[-1] > 0.05
    assert all(abs(r.start_time - r.scheduled_time) < 0.05 for r in result.records)
    assert result.metrics["duration_s"] >= scheduled[-1] + fake_server.first_delay_s


def test_max_concurrency_caps_requests_in_flight(fake_server):
    result = asyncio.run(run_benchmark(config(fake_server, max_concurrency=2)))
    assert result.metrics["num_completed"] == 6, result.metrics["errors"]
    assert fake_server.max_in_flight == 2
    # a queued request's clock starts when it is sent, not when it arrived
    assert max(r.start_time for r in result.records) > 2 * fake_server.first_delay_s


def test_failed_requests_are_kept_and_miss_the_slo(fake_server):
    cfg = config(fake_server, num_prompts=3, extra_body={"fake_mode": "http500"}, slo_ttft_ms=1000)
    result = asyncio.run(run_benchmark(cfg))
    m = result.metrics
    assert (m["num_failed"], m["slo_attainment"], m["goodput"]) == (3, 0.0, 0.0)
    assert all(r.error.startswith("HTTP 500") for r in result.records)
    assert len(result.to_dict()["requests"]) == 3


def test_sweep_over_two_rates(fake_server):
    cfg = config(fake_server, num_prompts=4, slo_ttft_ms=5000, slo_tpot_ms=1000, api_key="secret")
    sweep = asyncio.run(run_sweep(cfg, [50.0, float("inf")]))
    data = json.loads(json.dumps(sweep.to_dict(), allow_nan=False))   # strict JSON: inf is "inf"
    assert data["request_rates"] == [50.0, "inf"]
    assert [e["request_rate"] for e in data["results"]] == [50.0, "inf"]
    assert all(e["metrics"]["num_completed"] == 4 and len(e["requests"]) == 4 for e in data["results"])
    assert data["max_rate_meeting_slo"] == "inf"
    assert data["config"]["model"] == fake_server.model_id and "api_key" not in data["config"]
    # same workload at each rate: the same prompts were sent twice
    assert fake_server.bodies[:4] == fake_server.bodies[4:]


def parse(argv):
    parser = argparse.ArgumentParser(prog="pdserve")
    add_bench_subparsers(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_serve_writes_json_and_plot(fake_server, tmp_path, capsys):
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    args = parse(["bench", "serve", "--base-url", fake_server.base_url, "--num-prompts", "3",
                  "--input-len", "4", "--output-len", "3", "--request-rate", "inf", "--slo-ttft-ms", "2000",
                  "--endpoint", "chat", "--out", str(out), "--no-progress"]
                 + (["--plot", str(plot)] if _has_matplotlib() else []))
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"config", "started_at", "metrics", "requests"}
    assert data["config"]["request_rate"] == "inf" and data["config"]["endpoint"] == "chat"
    assert data["metrics"]["slo_attainment"] == 1.0
    assert {"ttft", "e2e", "itls", "prompt_tokens", "output_tokens", "error"} <= set(data["requests"][0])
    assert "TTFT" in capsys.readouterr().out
    if _has_matplotlib():
        assert plot.stat().st_size > 0


def test_cli_sweep_writes_one_entry_per_rate_and_a_plot(fake_server, tmp_path, capsys):
    out, plot = tmp_path / "s.json", tmp_path / "s.png"
    args = parse(["bench", "sweep", "--base-url", fake_server.base_url, "--num-prompts", "2",
                  "--input-len", "4", "--output-len", "2", "--request-rates", "40,inf", "--out", str(out),
                  "--no-progress"] + (["--plot", str(plot)] if _has_matplotlib() else []))
    assert args.func(args) == 0
    assert [e["request_rate"] for e in json.loads(out.read_text())["results"]] == [40.0, "inf"]
    assert "max rate" in capsys.readouterr().out
    if _has_matplotlib():
        assert plot.stat().st_size > 0


def test_cli_rejects_bad_values_and_explains_itself(fake_server, capsys):
    args = parse(["bench", "serve", "--base-url", fake_server.base_url, "--range-ratio", "1.5"])
    assert args.func(args) == 2
    assert "range_ratio" in capsys.readouterr().err
    args = parse(["bench", "serve", "--base-url", "localhost:8000"])
    assert args.func(args) == 2
    assert "base_url" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["bench", "sweep", "--request-rates", "1,0"])
    with pytest.raises(SystemExit):
        parse(["bench", "serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--request-rate", "--burstiness", "--slo-ttft-ms", "--dataset", "goodput", "TPOT"):
        assert flag in text


def test_cli_with_no_server_reports_no_model(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                                 # free once closed: nothing listens
    args = parse(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--no-progress"])
    assert args.func(args) == 2
    assert "model" in capsys.readouterr().err


def test_bench_imports_only_leaf_modules():
    # MEASURE speaks HTTP only: no torch, engine, server or router behind `pdserve bench`
    code = ("import sys, pdserve.bench.cli, pdserve.bench.plots; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('pdserve')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    loaded = eval(out)
    assert "torch" not in loaded
    assert all(m == "pdserve" or m.startswith(("pdserve.bench", "pdserve.config", "pdserve.protocol",
                                               "pdserve.help_format")) for m in loaded), loaded


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_progress_bar_writes_one_line_per_update_off_a_terminal():
    stream = io.StringIO()
    bar = ProgressBar(2, label="rate 4", stream=stream)
    bar.update(True)
    bar.update(False)          # the last one is always drawn
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[rate 4] |###############---------------| 1/2 ok 1 failed 0")
    assert lines[-1].startswith("[rate 4] |##############################| 2/2 ok 1 failed 1")
    quiet = io.StringIO()
    ProgressBar(1, enabled=False, stream=quiet).update(True)
    assert quiet.getvalue() == ""


# ---- dependent requests: multi-turn conversations -------------------------------------------------

def multi_turn(server, **overrides):
    base = dict(dataset="multi-turn", num_users=3, num_turns=3, num_groups=2, prefix_len=10, turn_len=5,
                output_len=3)
    return config(server, **{**base, **overrides})


def by_conversation(records):
    chains = {}
    for r in records:
        chains.setdefault(r.conversation, []).append(r)
    return [sorted(chain, key=lambda r: r.turn) for _, chain in sorted(chains.items())]


def test_multi_turn_sends_each_turn_after_the_previous_one_with_its_streamed_answer(fake_server):
    result = asyncio.run(run_benchmark(multi_turn(fake_server)))
    records = result.records
    assert result.metrics["num_requests"] == 9 and result.metrics["num_completed"] == 9
    assert [r.index for r in records] == list(range(9))
    assert [(r.conversation, r.turn) for r in records] == [(u, k) for u in range(3) for k in range(3)]
    for chain in by_conversation(records):
        for before, after in zip(chain, chain[1:]):     # a conversation is sequential
            assert after.start_time >= before.start_time + before.e2e - 1e-3
            assert after.scheduled_time >= before.start_time + before.e2e - 1e-3
    assert fake_server.max_in_flight == 3               # the users run side by side
    # every prompt is the previous turn's prompt, the answer the fake streamed (" tok" per token), more
    prompts = [b["prompt"] for b in fake_server.bodies]
    assert len(prompts) == 9
    for first in (p for p in prompts if p.count("User:") == 1):
        chain = sorted((p for p in prompts if p.startswith(first[:first.index("Assistant:")])), key=len)
        assert len(chain) == 3
        for before, after in zip(chain, chain[1:]):
            assert after.startswith(before + " tok tok tok\n\nUser: ")
    per_turn = result.metrics["per_turn"]
    assert [t["turn"] for t in per_turn] == [0, 1, 2] and all(t["num_completed"] == 3 for t in per_turn)
    assert all(t["ttft_ms_p50"] > 0 for t in per_turn)
    assert per_turn[0]["prompt_tokens_mean"] < per_turn[1]["prompt_tokens_mean"] < per_turn[2]["prompt_tokens_mean"]
    request = result.to_dict()["requests"][4]
    assert (request["conversation"], request["turn"]) == (1, 1) and "output_text" not in request


def test_multi_turn_chat_resends_the_answers_as_assistant_messages(fake_server):
    asyncio.run(run_benchmark(multi_turn(fake_server, endpoint="chat", num_users=2, num_turns=2)))
    last_turns = [b["messages"] for b in fake_server.bodies if len(b["messages"]) == 4]
    assert len(last_turns) == 2
    for messages in last_turns:
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
        assert messages[2]["content"] == " tok tok tok"


def test_multi_turn_conversations_arrive_at_the_rate_and_a_failed_turn_is_followed_by_the_next(fake_server):
    from pdserve.bench.workloads import arrival_times
    cfg = multi_turn(fake_server, num_turns=2, request_rate=20.0, extra_body={"fake_mode": "http500"})
    result = asyncio.run(run_benchmark(cfg))
    assert result.metrics["num_failed"] == 6 and result.metrics["per_turn"][1]["ttft_ms_p50"] is None
    assert [r.scheduled_time for r in result.records if r.turn == 0] == arrival_times(3, 20.0, 1.0, 0)
    # no answer came back: the next turn carries the placeholder answer, so the load stays the same
    from pdserve.bench.runner import build_conversations
    conv = build_conversations(cfg)[0]
    assert conv.request(1, conv.placeholder_answers, endpoint="completions").prompt in \
        [b["prompt"] for b in fake_server.bodies]


def test_independent_requests_keep_their_json(fake_server):
    result = asyncio.run(run_benchmark(config(fake_server, num_prompts=2)))
    data = result.to_dict()
    assert "per_turn" not in data["metrics"]
    assert not {"conversation", "turn", "output_text"} & set(data["requests"][0])


def test_cli_mixed_and_multi_turn(fake_server, capsys):
    args = parse(["bench", "serve", "--base-url", fake_server.base_url, "--dataset", "mixed", "--num-prompts", "10",
                  "--short-fraction", "0.5", "--short-len", "4", "8", "--long-len", "40", "50", "--output-len", "2",
                  "--no-progress"])
    assert args.func(args) == 0
    lengths = sorted(len(b["prompt"]) for b in fake_server.bodies)
    assert all(4 <= n <= 8 for n in lengths[:5]) and all(40 <= n <= 50 for n in lengths[5:])

    fake_server.reset()
    args = parse(["bench", "serve", "--base-url", fake_server.base_url, "--dataset", "multi-turn", "--num-users", "2",
                  "--num-turns", "3", "--num-groups", "1", "--prefix-len", "12", "--turn-len", "4",
                  "--output-len", "2", "--endpoint", "chat", "--no-progress"])
    assert args.func(args) == 0
    assert len(fake_server.bodies) == 6
    assert len({b["messages"][0]["content"] for b in fake_server.bodies}) == 1     # one group, one system prompt
    out = capsys.readouterr().out
    assert "TTFT p50" in out and "prompt tok" in out
    for bad, field in ((["--short-fraction", "1.5"], "short_fraction"), (["--long-len", "9", "3"], "long_len")):
        args = parse(["bench", "serve", "--base-url", fake_server.base_url, "--dataset", "mixed", *bad])
        assert args.func(args) == 2
        assert field in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["bench", "serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("multi-turn", "mixed", "--num-users", "--num-turns", "--num-groups", "--turn-len",
                 "--short-fraction", "--short-len", "--long-len"):
        assert flag in text
