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
    assert all(m == "pdserve" or m.startswith(("pdserve.bench", "pdserve.config", "pdserve.protocol"))
               for m in loaded), loaded


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
