"""`pdserve bench compare`: plans, summary, and the orchestration against fake instances.

The fake: this file, run as a script in place of `python -m pdserve` (CompareConfig.launcher). Each
fake `serve` or `proxy` records its argv, CUDA_VISIBLE_DEVICES and pid under $FAKE_PDSERVE_LOG, then
serves conftest's fake streaming OpenAI API plus /health on its --port; it exits at once with code 3
when $FAKE_PDSERVE_FAIL occurs in its argv.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

FAKE_EXIT_CODE = 3


def fake_pdserve(argv: list[str]) -> None:
    record = {"argv": argv, "pid": os.getpid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    (Path(os.environ["FAKE_PDSERVE_LOG"]) / f"{os.getpid()}.json").write_text(json.dumps(record))
    from aiohttp import web

    from conftest import FakeServer   # this file's directory is sys.path[0] when run as a script
    fail = os.environ.get("FAKE_PDSERVE_FAIL")
    if fail and fail in " ".join(argv):
        print("fake: failing as asked", flush=True)
        sys.exit(FAKE_EXIT_CODE)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = FakeServer().app()
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=int(argv[argv.index("--port") + 1]), print=None)


if __name__ == "__main__":
    fake_pdserve(sys.argv[1:])
    sys.exit(0)

from pdserve.bench import compare  # noqa: E402  (the fake above needs none of this)
from pdserve.bench.cli import add_bench_subparsers, config_from_args  # noqa: E402
from pdserve.bench.compare import (CompareConfig, compare_config_from_args, compare_main,  # noqa: E402
                                   format_summary_md, plan_deployment, run_compare, split_devices, summarize)
from pdserve.bench.runner import BenchConfig  # noqa: E402

FAKE_LAUNCHER = (sys.executable, __file__)


def cpu_config(**overrides) -> CompareConfig:
    base = dict(num_devices=2, device="cpu", cores=(0, 1, 2, 3), base_port=9100,
                serve_args=("--model", "default", "--seed", "0"))
    return CompareConfig(**{**base, **overrides})


def flag(args, name):
    return args[args.index(name) + 1] if name in args else None


# ---- plans --------------------------------------------------------------------------------------

def test_each_config_gets_its_flags_roles_and_the_same_core_split():
    cc = cpu_config()
    devices = split_devices(cc)
    plans = {name: plan_deployment(name, cc, devices) for name in compare.CONFIG_NAMES}
    for plan in plans.values():   # instance i runs on the same cores in every configuration
        assert [flag(i.args, "--cpu-cores") for i in plan.instances] == ["0,1", "2,3"]
        assert [flag(i.args, "--num-threads") for i in plan.instances] == ["2", "2"]
        assert [i.port for i in plan.instances] == [9101, 9102] and plan.url == "http://127.0.0.1:9100"
        assert all(i.args[0] == "serve" and "--no-prefix-caching" in i.args and flag(i.args, "--seed") == "0"
                   and flag(i.args, "--device") == "cpu" for i in plan.instances)

    colocated, chunked, disagg = plans["colocated"], plans["colocated-chunked"], plans["disaggregated"]
    urls = ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]
    assert colocated.layout == "2 colocated"
    assert all("--no-chunked-prefill" in i.args and "--kv-connector" not in i.args for i in colocated.instances)
    assert colocated.proxy_args == ("proxy", "--host", "127.0.0.1", "--port", "9100", "--colocated", *urls)
    assert all("--no-chunked-prefill" not in i.args and flag(i.args, "--max-num-batched-tokens") == "512"
               for i in chunked.instances)
    assert chunked.proxy_args == colocated.proxy_args

    assert disagg.layout == "1P1D" and [i.name for i in disagg.instances] == ["prefill-0", "decode-0"]
    assert [(flag(i.args, "--kv-connector"), flag(i.args, "--kv-role"), flag(i.args, "--engine-id"))
            for i in disagg.instances] == [("nixl", "producer", "prefill-0"), ("nixl", "consumer", "decode-0")]
    assert disagg.proxy_args[-4:] == ("--prefill", urls[0], "--decode", urls[1])


def test_budget_prefix_caching_and_kv_transfer_config_reach_the_right_instances():
    cc = cpu_config(max_num_batched_tokens=4096, chunked_budgets=(256,), prefix_caching=True,
                    kv_connector="cuda_ipc", kv_transfer_config='{"lease_seconds": 5}')
    devices = split_devices(cc)
    budgets = {name: [flag(i.args, "--max-num-batched-tokens") for i in plan_deployment(name, cc, devices).instances]
               for name in compare.CONFIG_NAMES}
    assert budgets == {"colocated": ["4096"] * 2, "colocated-chunked": ["256"] * 2, "disaggregated": ["4096"] * 2}
    disagg = plan_deployment("disaggregated", cc, devices)
    assert all(flag(i.args, "--kv-transfer-config") == '{"lease_seconds": 5}' for i in disagg.instances)
    assert all(flag(i.args, "--kv-connector") == "cuda_ipc" for i in disagg.instances)
    assert not any("--no-prefix-caching" in i.args for i in disagg.instances)


def test_several_chunk_budgets_run_once_each_and_the_best_is_the_tuned_baseline():
    cc = cpu_config(configs=("colocated", "colocated-chunked"), chunked_budgets=(256, 1024))
    runs = compare.planned_runs(cc)
    assert runs == [("colocated", "colocated", None), ("colocated-chunked-256", "colocated-chunked", 256),
                    ("colocated-chunked-1024", "colocated-chunked", 1024)]
    devices = split_devices(cc)
    plans = [plan_deployment(config, cc, devices, name=name, chunked_budget=b) for name, config, b in runs]
    assert [p.config for p in plans] == [r[0] for r in runs]
    assert [flag(plans[i].instances[0].args, "--max-num-batched-tokens") for i in (1, 2)] == ["256", "1024"]
    assert compare.planned_runs(cpu_config(chunked_budgets=(512,)))[1] == ("colocated-chunked", "colocated-chunked", 512)

    def entry(name, rates):  # rates: attainment per swept rate 1, 2, 4
        return summarize(name, {"results": [sweep_entry(r, a, goodput=g) for r, (a, g) in zip((1.0, 2.0, 4.0), rates)]}, 2)
    configs = [entry("colocated", [(1, 1)] * 3),
               entry("colocated-chunked-256", [(1, 1.0), (0.95, 1.5), (0.5, 1.0)]),
               entry("colocated-chunked-1024", [(1, 1.0), (0.95, 1.9), (0.2, 0.5)]),   # same rate, more goodput
               entry("colocated-chunked-2048", [(0.5, 0.5), (1, 2.0), (1, 3.0)])]      # misses at the lowest rate
    assert compare.tuned_chunked(configs) == "colocated-chunked-1024"
    assert compare.tuned_chunked(configs[:2]) is None  # one budget: nothing was tuned
    args = parse(["bench", "compare", "--chunked-budget", "1024,256,1024"])
    assert compare_config_from_args(args).chunked_budgets == (1024, 256)
    with pytest.raises(SystemExit):
        parse(["bench", "compare", "--chunked-budget", "512,0"])


@pytest.mark.parametrize("num_devices,share,num_prefill", [(2, "0.5", 1), (4, "0.5", 2), (4, "0.25", 1),
                                                           (4, "0.9", 3), (4, "1:3", 1), (3, "2:1", 2)])
def test_prefill_share_splits_the_devices(num_devices, share, num_prefill):
    cc = CompareConfig(num_devices=num_devices, prefill_share=share)
    assert cc.num_prefill() == num_prefill


@pytest.mark.parametrize("overrides,field", [
    (dict(num_devices=1), "num_devices"), (dict(num_devices=4, prefill_share="2:3"), "prefill_share"),
    (dict(prefill_share="1.5"), "prefill_share"), (dict(prefill_share="1P1D"), "prefill_share"),
    (dict(configs=("colocated", "pd")), "configs"),
    (dict(chunked_budgets=(0,)), "chunked_budgets"), (dict(chunked_budgets=()), "chunked_budgets"),
    (dict(kv_connector="loopback"), "kv_connector")])
def test_bad_compare_configs_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        CompareConfig(**overrides).validate()
    # one device is fine when disaggregated is not asked for
    CompareConfig(num_devices=1, configs=("colocated",)).validate()


def test_cuda_gives_one_gpu_each_and_never_shares():
    cc = CompareConfig(num_devices=2, device="cuda", gpus=("4", "5", "6"))
    devices = split_devices(cc)
    assert [d.env() for d in devices] == [{"CUDA_VISIBLE_DEVICES": "4"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    plan = plan_deployment("disaggregated", cc, devices)
    assert all("--cpu-cores" not in i.args for i in plan.instances)
    with pytest.raises(ValueError, match="need 4 GPUs, found 3"):
        split_devices(replace(cc, num_devices=4))
    with pytest.raises(ValueError, match="need 3 disjoint core sets"):
        split_devices(CompareConfig(num_devices=3, device="cpu", cores=(0, 1)))


def test_compare_loads_no_torch_and_only_leaf_modules():
    # MEASURE speaks HTTP; it starts servers only as `pdserve` child processes (pdserve.cluster: stdlib)
    code = ("import sys, pdserve.bench.compare as c; c.split_devices(c.CompareConfig(num_devices=1)); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('pdserve')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    loaded = eval(out)
    assert "torch" not in loaded
    assert all(m == "pdserve" or m.startswith(("pdserve.bench", "pdserve.cli_types", "pdserve.config",
                                               "pdserve.protocol", "pdserve.help_format", "pdserve.stop_signals",
                                               "pdserve.cluster"))
               for m in loaded), loaded


# ---- summary ------------------------------------------------------------------------------------

def sweep_entry(rate, attainment, goodput=1.0, ttft=100.0, tpot=20.0):
    return {"request_rate": rate, "metrics": {
        "num_completed": 10, "num_failed": 0, "ttft_ms": {"p90": ttft}, "tpot_ms": {"p90": tpot},
        "slo_attainment": attainment, "goodput": goodput, "output_token_throughput": 50.0, "errors": {}}}


def test_summary_takes_the_highest_rate_that_every_lower_rate_sustains():
    sweep = {"results": [sweep_entry(1.0, 1.0), sweep_entry(2.0, 0.95, goodput=1.8), sweep_entry(4.0, 0.5),
                         sweep_entry("inf", 1.0)]}
    entry = summarize("colocated", sweep, num_devices=2, target_attainment=0.9)
    assert entry["max_rate_meeting_slo"] == 2.0          # not inf: 4 req/s fell below the target first
    assert entry["max_rate_per_device"] == 1.0
    assert entry["goodput_per_device_at_max"] == pytest.approx(0.9)
    assert [r["slo_attainment"] for r in entry["rates"]] == [1.0, 0.95, 0.5, 1.0]

    missed = summarize("disaggregated", {"results": [sweep_entry(1.0, 0.5), sweep_entry(2.0, 1.0)]}, 2)
    assert missed["max_rate_meeting_slo"] is None and missed["max_rate_per_device"] is None
    everything = summarize("colocated-chunked", {"results": [sweep_entry("inf", 1.0)]}, 2)
    assert everything["max_rate_meeting_slo"] == "inf" and everything["max_rate_per_device"] == "inf"

    summary = {"model": "default", "num_devices": 2, "device": "cpu", "devices": ["cores 0", "cores 1"],
               "workload": BenchConfig(num_prompts=10, slo_ttft_ms=500).to_dict(), "request_rates": [1.0, 2.0],
               "target_attainment": 0.9,
               "configs": [entry, missed, summarize("x", None, 2, status="failed", error="decode-0 exited | 3")]}
    md = format_summary_md(summary)
    assert "| colocated | - | 2 | 1 | 0.90 | ok |" in md
    assert "| disaggregated | - | - | - | - | ok |" in md
    assert "| x | - | - | - | - | failed: decode-0 exited / 3 |" in md
    assert "| colocated | 4 | 10/0 | 100.0 | 20.0 | 50% | 1.00 |" in md
    assert "TTFT ≤ 500 ms" in md


def test_each_config_and_rate_is_one_row_of_the_per_rate_table():
    # a GPU run's report (--configs colocated,disaggregated --request-rates 10,14: rows seen twice), not
    # reproduced: formatted from its shape, each (config, rate) is one row
    configs = [summarize(name, {"results": [sweep_entry(10.0, 1.0, ttft=400.0), sweep_entry(14.0, 0.5, ttft=900.0)]},
                         2, target_attainment=0.9) for name in ("colocated", "disaggregated")]
    summary = {"model": "llama-3.1-8b", "num_devices": 2, "device": "cuda", "devices": ["GPU 0", "GPU 1"],
               "workload": BenchConfig(num_prompts=60).to_dict(), "request_rates": [10.0, 14.0],
               "target_attainment": 0.9, "configs": configs, "tuned_chunked": compare.tuned_chunked(configs)}
    md = format_summary_md(summary)
    per_rate = md.split("| config | rate (req/s) |")[1].splitlines()[2:]
    rows = [line for line in per_rate if line.startswith("| ")]
    assert [tuple(cell.strip() for cell in row.split("|")[1:3]) for row in rows] == \
        [("colocated", "10"), ("colocated", "14"), ("disaggregated", "10"), ("disaggregated", "14")]


def test_summary_describes_the_multi_turn_and_mixed_workloads():
    base = {"model": "default", "num_devices": 2, "device": "cpu", "devices": ["cores 0", "cores 1"],
            "request_rates": [1.0], "target_attainment": 0.9, "configs": []}
    md = format_summary_md({**base, "workload": BenchConfig(dataset="multi-turn", endpoint="chat").to_dict()})
    assert "- workload: 16 users x 4 turns, multi-turn (4 system prompts of 256 words, turns of 64), chat, " \
           "output 128, seed 0;" in md
    md = format_summary_md({**base, "workload": BenchConfig(dataset="mixed", num_prompts=50).to_dict()})
    assert "- workload: 50 prompts, mixed (80% of 32-128 tokens, the rest 1024-2048), completions, output 128" in md


def test_warm_up_of_a_multi_turn_sweep_is_num_warmup_requests(fake_server):
    import asyncio
    bench = BenchConfig(base_url=fake_server.base_url, dataset="multi-turn", num_users=2, num_turns=3,
                        prefix_len=8, turn_len=4, output_len=2)
    sweep = asyncio.run(compare._warm_up_and_sweep(bench, [math.inf], 2, 0.9, False))
    assert len(fake_server.bodies) == 2 + 6
    assert sweep.results[0].metrics["num_completed"] == 6


# ---- orchestration against fake instances ---------------------------------------------------------

def free_base_port(num_ports: int) -> int:
    """A port p such that p .. p + num_ports - 1 are free now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + num_ports < 65536 and all(compare.port_taken("127.0.0.1", base + i) is None for i in range(num_ports)):
            return base
    raise RuntimeError("no free port range")


@pytest.fixture
def fake_log(tmp_path, monkeypatch):
    log = tmp_path / "fake-log"
    log.mkdir()
    monkeypatch.setenv("FAKE_PDSERVE_LOG", str(log))
    monkeypatch.delenv("FAKE_PDSERVE_FAIL", raising=False)

    def records() -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(log.glob("*.json"))]
    return records


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def parse(argv):
    parser = argparse.ArgumentParser(prog="pdserve")
    add_bench_subparsers(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_runs_every_config_against_fake_instances_and_stops_them(fake_log, tmp_path, capsys):
    base_port = free_base_port(3)
    out = tmp_path / "cmp"
    args = parse(["bench", "compare", "--num-prompts", "4", "--input-len", "8", "--output-len", "3",
                  "--request-rates", "50,inf", "--slo-ttft-ms", "5000", "--num-warmup", "1",
                  "--base-port", str(base_port), "--out-dir", str(out), "--device", "cpu", "--no-progress"])
    cc = replace(compare_config_from_args(args), launcher=FAKE_LAUNCHER, cores=(0, 1, 2, 3))
    assert compare_main(args, cc) == 0

    summary = json.loads((out / "summary.json").read_text())
    assert [c["config"] for c in summary["configs"]] == list(compare.CONFIG_NAMES)
    for c in summary["configs"]:
        assert c["status"] == "ok" and c["error"] is None
        assert c["max_rate_meeting_slo"] == "inf" and c["max_rate_per_device"] == "inf"
        assert [r["num_completed"] for r in c["rates"]] == [4, 4]
    assert summary["devices"] == ["cores 0,1", "cores 2,3"] and summary["workload"]["model"] is None
    for name in compare.CONFIG_NAMES:
        sweep = json.loads((out / f"{name}.json").read_text())
        assert sweep["config"]["model"] == "fake-model" and sweep["deployment"]["config"] == name
        assert (out / "logs" / name / "proxy.log").exists()
    assert (out / "compare.png").stat().st_size > 0
    assert "| disaggregated | 1P1D | inf | inf |" in capsys.readouterr().out

    records = fake_log()
    commands = [r["argv"] for r in records]
    assert len(records) == 9   # 3 configurations x (2 instances + the proxy)
    assert sum(a[0] == "proxy" and "--colocated" in a for a in commands) == 2
    assert sum(a[0] == "proxy" and "--prefill" in a for a in commands) == 1
    assert sorted(flag(a, "--kv-role") for a in commands if "--kv-role" in a) == ["consumer", "producer"]
    assert sorted(flag(a, "--cpu-cores") for a in commands if a[0] == "serve") == ["0,1"] * 3 + ["2,3"] * 3
    assert not any(is_running(r["pid"]) for r in records)


def test_several_chunk_budgets_against_fake_instances(fake_log, tmp_path):
    cc = cpu_config(configs=("colocated-chunked",), chunked_budgets=(256, 512), base_port=free_base_port(3),
                    launcher=FAKE_LAUNCHER, num_warmup=0)
    bench = BenchConfig(num_prompts=2, input_len=8, output_len=2)
    summary = run_compare(cc, bench, [math.inf], out_dir=tmp_path / "cmp", plot=False)
    assert [c["config"] for c in summary["configs"]] == ["colocated-chunked-256", "colocated-chunked-512"]
    assert summary["tuned_chunked"] in ("colocated-chunked-256", "colocated-chunked-512")
    assert "tuned chunked-prefill baseline: colocated-chunked-" in (tmp_path / "cmp" / "summary.md").read_text()
    budgets = sorted(flag(r["argv"], "--max-num-batched-tokens") for r in fake_log() if r["argv"][0] == "serve")
    assert budgets == ["256", "256", "512", "512"]


def test_a_config_that_does_not_start_is_reported_and_the_next_one_runs(fake_log, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PDSERVE_FAIL", "--kv-role consumer")
    cc = cpu_config(configs=("disaggregated", "colocated"), base_port=free_base_port(3), launcher=FAKE_LAUNCHER,
                    num_warmup=0)
    bench = BenchConfig(num_prompts=2, input_len=8, output_len=2)
    summary = run_compare(cc, bench, [float("inf")], out_dir=tmp_path / "cmp", plot=False)

    disagg, colocated = summary["configs"]
    assert disagg["status"] == "failed" and disagg["rates"] == []
    assert f"decode-0 exited with code {FAKE_EXIT_CODE}" in disagg["error"]
    assert "fake: failing as asked" in disagg["error"]       # the instance's last log line
    assert colocated["status"] == "ok" and colocated["rates"][0]["num_completed"] == 2
    assert not (tmp_path / "cmp" / "disaggregated.json").exists()
    assert "failed: decode-0 exited" in (tmp_path / "cmp" / "summary.md").read_text()
    records = fake_log()
    # decode-0, then the colocated pair and its proxy; prefill-0 too unless decode-0's exit stopped it
    # before its interpreter got as far as recording itself (seen on a loaded CI machine)
    commands = [r["argv"] for r in records]
    assert sum("--kv-role" in a and flag(a, "--kv-role") == "consumer" for a in commands) == 1
    assert sum("--kv-role" in a and flag(a, "--kv-role") == "producer" for a in commands) <= 1
    assert sum(a[0] == "serve" and "--kv-role" not in a for a in commands) == 2
    assert sum(a[0] == "proxy" for a in commands) == 1   # the failed config never started its proxy
    assert not any(is_running(r["pid"]) for r in records)


def test_interrupt_stops_every_child_and_keeps_the_summary(fake_log, tmp_path, monkeypatch):
    async def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "run_sweep", interrupted)
    cc = cpu_config(configs=("colocated", "disaggregated"), base_port=free_base_port(3), launcher=FAKE_LAUNCHER,
                    num_warmup=0)
    with pytest.raises(KeyboardInterrupt):
        run_compare(cc, BenchConfig(num_prompts=2), [1.0], out_dir=tmp_path / "cmp", plot=False)
    records = fake_log()
    assert len(records) == 3 and not any(is_running(r["pid"]) for r in records)
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert [(c["config"], c["status"]) for c in summary["configs"]] == [("colocated", "interrupted")]


def test_a_busy_port_fails_the_config_before_anything_starts(fake_log, tmp_path):
    base_port = free_base_port(3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", base_port + 2))
        s.listen()
        cc = cpu_config(configs=("colocated",), base_port=base_port, launcher=FAKE_LAUNCHER)
        summary = run_compare(cc, BenchConfig(num_prompts=2), [1.0], out_dir=tmp_path / "cmp", plot=False)
    assert summary["configs"][0]["error"] == f"port {base_port + 2} on 127.0.0.1 is in use (choose another --base-port)"
    assert fake_log() == []


def test_cli_flags_reach_the_instances_and_the_workload():
    args = parse(["bench", "compare", "--configs", "disaggregated,colocated", "--num-devices", "4",
                  "--prefill-share", "1:3", "--chunked-budget", "256", "--model", "m.gguf", "--load-format", "dummy",
                  "--seed", "7", "--max-model-len", "1024", "--kv-cache-memory", "1000000", "--num-prompts", "8",
                  "--request-rates", "1,inf", "--base-port", "9000", "--max-num-seqs", "512"])
    cc, bench = compare_config_from_args(args), config_from_args(args)
    assert cc.configs == ("disaggregated", "colocated") and cc.num_prefill() == 1 and cc.base_port == 9000
    assert cc.serve_args == ("--model", "m.gguf", "--load-format", "dummy", "--dtype", "auto", "--seed", "7",
                             "--max-model-len", "1024", "--kv-cache-memory", "1000000", "--max-num-seqs", "512")
    assert bench.model is None and bench.seed == 7 and bench.num_prompts == 8   # the model comes from /v1/models
    assert args.request_rates == [1.0, float("inf")]
    with pytest.raises(SystemExit):
        parse(["bench", "compare", "--configs", "colocated,pd"])


def test_router_args_reach_the_disaggregated_router_only():
    args = parse(["bench", "compare", "--configs", "disaggregated,colocated", "--kv-connector", "nixl-push",
                  "--router-args", "--policy cost --pd-min-prompt-tokens 256"])
    cc = replace(compare_config_from_args(args), cores=(0, 1))   # whatever cores this process may use
    devices = split_devices(cc)
    disagg, colocated = (plan_deployment(name, cc, devices) for name in ("disaggregated", "colocated"))
    assert disagg.proxy_args[-4:] == ("--policy", "cost", "--pd-min-prompt-tokens", "256")
    assert "--policy" not in colocated.proxy_args
    assert all(flag(i.args, "--kv-connector") == "nixl-push" for i in disagg.instances)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PDSERVE_SLOW_TESTS") != "1", reason="set PDSERVE_SLOW_TESTS=1")
def test_real_default_model_colocated_chunked_smoke(tmp_path):
    """The real default model, one configuration on one device: every request completes."""
    args = parse(["bench", "compare", "--configs", "colocated-chunked", "--num-devices", "1", "--device", "cpu",
                  "--num-prompts", "4", "--input-len", "32", "--output-len", "8", "--request-rates", "2",
                  "--num-warmup", "1", "--kv-cache-memory", str(64 << 20), "--base-port", str(free_base_port(2)),
                  "--out-dir", str(tmp_path), "--no-plot", "--no-progress"])
    assert compare_main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["configs"][0]["rates"][0]["num_completed"] == 4
