"""`pdserve up`: each side can be tuned on its own (--prefill-args / --decode-args)."""
from __future__ import annotations

import os
import sys
import types

import pytest

from pdserve import cli
from pdserve.cluster.local import instance_command


@pytest.fixture(autouse=True)
def _machine_with_many_cores(monkeypatch):
    """Tests here play machines of more cores than this one (a fake sched_getaffinity); --cpu-cores is
    checked against the machine's core count, so that count plays along."""
    monkeypatch.setattr(os, "cpu_count", lambda: 1024)


def fake_children(monkeypatch) -> list:
    """`up`'s children replaced by records of (command, environment); it stops at the health wait."""
    from pdserve.cluster import local as cluster
    started = []

    class FakeChildren:
        def start(self, cmd, *, name=None, env=None, stdout=None, stderr=None):
            started.append((list(cmd), dict(env or {})))
            return types.SimpleNamespace(pid=len(started))

        def wait_healthy(self, urls, timeout):
            raise RuntimeError("stop here")

        def stop(self, timeout=0):
            pass

    monkeypatch.setattr(cluster, "ChildProcesses", FakeChildren)
    monkeypatch.setattr(cluster, "port_taken", lambda host, port: None)   # (nothing binds: a server of the
    return started                                                        # user's on the port is no matter)


def test_role_flags_come_last_so_they_win():
    cmd = instance_command("consumer", 0, 8002, model="default", host="127.0.0.1",
                           serve_args=["--max-num-seqs", "256"], role_args=["--max-num-seqs", "512"],
                           kv_connector="nixl", kv_transfer_config=None, cores=[1])
    assert cmd[:4] == [sys.executable, "-m", "pdserve", "serve"]
    assert cmd[-2:] == ["--max-num-seqs", "512"] and "--engine-id" in cmd and "decode-0" in cmd
    args = cli.build_parser().parse_args(cmd[3:])
    assert args.max_num_seqs == 512 and args.kv_role == "consumer" and args.cpu_cores == "1"


def test_up_passes_role_flags_to_their_side_and_refuses_bad_ones(monkeypatch, capsys):
    calls = {}
    monkeypatch.setattr("pdserve.cluster.local.run_cluster", lambda **kw: calls.update(kw) or 0)
    argv = ["up", "--max-num-seqs", "128", "--prefill-args", "--max-num-batched-tokens 8192",
            "--decode-args", "--max-num-seqs 512 --no-prefix-caching"]
    assert cli.main(argv) == 0
    shared = calls["serve_args"]
    assert shared[shared.index("--max-num-seqs") + 1] == "128"  # every instance
    assert calls["prefill_args"] == ["--max-num-batched-tokens", "8192"]
    assert calls["decode_args"] == ["--max-num-seqs", "512", "--no-prefix-caching"]
    assert cli.main(["up", "--prefill-args=--no-prefix-caching"]) == 0  # a lone flag, with '='
    assert calls["prefill_args"] == ["--no-prefix-caching"]
    assert cli.main(["up", "--decode-args", "--max-num-sqes 512"]) == 2
    assert "--decode-args" in capsys.readouterr().err


def test_a_pd_instance_on_a_public_address_needs_a_router_key(monkeypatch, capsys):
    monkeypatch.delenv("PDSERVE_ROUTER_KEY", raising=False)
    args = cli.build_parser().parse_args(["serve", "--kv-connector", "nixl", "--host", "0.0.0.0"])
    assert cli.serve_main(args) == 2
    assert "router_key" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["serve", "--kv-connector", "nixl", "--host", "10.1.2.3",
                                          "--router-key", "s3cret-router-key"])
    config = cli.engine_config_from_args(args)
    assert config.kv_transfer.auth_key == "s3cret-router-key" and config.kv_transfer.side_channel_host == "10.1.2.3"
    assert "s3cret" not in repr(config.kv_transfer)   # a secret stays out of logs


def test_keys_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "client-key")
    monkeypatch.setenv("PDSERVE_ROUTER_KEY", "router-key")
    args = cli.build_parser().parse_args(["serve"])
    server = cli.server_config_from_args(args)
    assert (server.api_key, server.router_key) == ("client-key", "router-key")
    proxy_args = cli.build_parser().parse_args(["proxy", "--colocated", "http://127.0.0.1:1"])
    assert (proxy_args.api_key, proxy_args.router_key) == ("client-key", "router-key")


def test_up_hands_keys_to_children_through_the_environment_only(monkeypatch):
    from pdserve.cluster import local as cluster
    started = fake_children(monkeypatch)
    monkeypatch.delenv("PDSERVE_ROUTER_KEY", raising=False)
    assert cluster.run_cluster(model="default", num_prefill=1, num_decode=1, host="127.0.0.1", port=9000,
                               serve_args=[], kv_transfer_config=None, device="cpu", api_key="client-key") == 1
    (p_cmd, p_env), (d_cmd, d_env) = started
    router_key = p_env["PDSERVE_ROUTER_KEY"]
    assert len(router_key) >= 32 and d_env["PDSERVE_ROUTER_KEY"] == router_key
    assert p_env["PDSERVE_API_KEY"] == router_key      # instances: only the router gets in
    assert all(router_key not in arg and "client-key" not in arg for arg in p_cmd + d_cmd)


def test_a_colocated_instance_has_no_kv_connector():
    cmd = instance_command("colocated", 1, 8005, model="default", host="127.0.0.1", serve_args=[],
                           role_args=["--max-num-seqs", "8"], kv_connector="nixl", kv_transfer_config='{"a": 1}',
                           cores=None)
    args = cli.build_parser().parse_args(cmd[3:])
    assert args.kv_connector is None and args.kv_transfer_config is None and args.engine_id == "colocated-1"
    assert args.max_num_seqs == 8


def test_up_checks_its_pools_gpus_and_proxy_flags(monkeypatch, capsys):
    calls = {}
    monkeypatch.setattr("pdserve.cluster.local.run_cluster", lambda **kw: calls.update(kw) or 0)
    assert cli.main(["up", "--num-colocated", "2", "--policy", "cost", "--pd-min-prompt-tokens", "64",
                     "--cost-tolerance", "0.1", "--direct-prefill-headroom", "0.5", "--gpus", "0,1",
                     "--proxy-args=--max-per-instance 8"]) == 0
    assert calls["num_colocated"] == 2 and calls["gpus"] == [0, 1]
    assert calls["proxy_args"] == ["--policy", "cost", "--cost-tolerance", "0.1", "--direct-prefill-headroom", "0.5",
                                   "--pd-min-prompt-tokens", "64", "--max-per-instance", "8"]
    assert cli.main(["up", "--proxy-args=--max-per-instnace 8"]) == 2
    assert "--proxy-args" in capsys.readouterr().err
    assert cli.main(["up", "--gpus", "0,0"]) == 2
    assert "--gpus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["up", "--policy", "fastest"])
    assert "fastest" in capsys.readouterr().err


@pytest.mark.parametrize("counts", [(1, 0, 0), (0, 1, 0), (0, 0, 0), (-1, 1, 0)])
def test_up_refuses_pools_that_cannot_serve(counts, capsys):
    from pdserve.cluster import local as cluster
    num_prefill, num_decode, num_colocated = counts
    assert cluster.run_cluster(model="default", num_prefill=num_prefill, num_decode=num_decode,
                               num_colocated=num_colocated, host="127.0.0.1", port=9000, serve_args=[],
                               kv_transfer_config=None, device="cpu") == 2
    assert "pdserve up" in capsys.readouterr().err


def test_the_supervisor_restarts_a_dead_instance_with_backoff_and_gives_up_on_the_router(monkeypatch):
    from pdserve.cluster import local as cluster

    class Proc:
        def __init__(self, pid):
            self.pid, self.returncode = pid, None

        def poll(self):
            return self.returncode

    class Children:
        def __init__(self):
            self.procs, self.names, self.started = [], {}, []

        def start(self, cmd, *, name=None, env=None):
            proc = Proc(100 + len(self.started))
            self.procs.append(proc)
            self.started.append((name, list(cmd)))
            return proc

    children = Children()
    instance, router = children.start(["serve"], name="decode-0"), children.start(["proxy"], name="the router")
    supervisor = cluster.Supervisor(children, {instance.pid: ("decode-0", ["serve"], {})})
    children.names[router.pid] = "the router"
    instance.returncode = -9
    assert supervisor.check(now=0.0) is None and len(children.started) == 2    # waits for the backoff
    assert supervisor.check(now=cluster.RESTART_BACKOFF_S[0]) is None
    assert children.started[-1] == ("decode-0", ["serve"])                    # the same command again
    for n in range(cluster.MAX_RESTARTS):                                       # dies again and again
        children.procs[-1].returncode = 1
        reason = supervisor.check(now=100.0 + 40 * n)
        supervisor.check(now=100.0 + 40 * n + 35)
    assert reason is not None and "decode-0" in reason
    router.returncode = 0
    assert "the router" in cluster.Supervisor(children, {}).check(now=0.0)


def test_instances_outnumbering_cores_share_them_with_their_share_of_threads():
    """Four instances on two cores: unpinned, one thread each (issue 15: no timing race decides it)."""
    from pdserve.cluster.local import split_cores, threads_per_instance
    assert split_cores(4, [0, 1]) == [None] * 4 and threads_per_instance(4, [0, 1]) == 1
    assert split_cores(2, [0, 1, 2, 3]) == [[0, 1], [2, 3]] and threads_per_instance(3, range(8)) == 2
    cmd = instance_command("producer", 0, 8001, model="default", host="127.0.0.1", serve_args=[], role_args=[],
                           kv_connector="nixl", kv_transfer_config=None, cores=None, num_threads=1)
    args = cli.build_parser().parse_args(cmd[3:])
    assert args.num_threads == 1 and args.cpu_cores is None


def test_an_engine_uses_one_thread_per_allowed_core_unless_told(monkeypatch):
    import os

    import torch

    from pdserve.worker.cpu_threads import set_num_threads
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
        assert set_num_threads(None) == 3 and torch.get_num_threads() == 3
        assert set_num_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_threads_past_the_cores_are_warned_of_and_fewer_than_one_refused(monkeypatch, caplog):
    """--num-threads 64 on 2 cores ran 4.5x slower without a word; -1 failed inside torch without naming
    the flag."""
    import logging
    import os

    import pytest
    import torch

    from pdserve.config import EngineConfig
    from pdserve.worker.cpu_threads import set_num_threads
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
        with caplog.at_level(logging.WARNING, logger="pdserve.worker.cpu_threads"):
            assert set_num_threads(3) == 3
            assert set_num_threads(2) == 2
        assert [r.getMessage().split(";")[0] for r in caplog.records] == [
            "CPU threads: 3 asked for, but this process may run on 2 cores"]
    finally:
        torch.set_num_threads(before)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="--num-threads"):
            EngineConfig(num_threads=bad).validate()


def test_instances_sharing_a_gpu_each_get_their_part_of_its_memory(monkeypatch):
    """Three instances on two GPUs: the two on GPU 0 get 0.45 each (before, each asked for the default 0.9
    and the second found no room), the one alone on GPU 1 keeps serve's default; a role's own flag wins."""
    from pdserve.cluster import local as cluster
    started = fake_children(monkeypatch)
    assert cluster.run_cluster(model="default", num_prefill=2, num_decode=1, host="127.0.0.1", port=9000,
                               serve_args=[], kv_transfer_config=None, device="cuda", gpus=[0, 1],
                               decode_args=["--gpu-memory-utilization", "0.3"]) == 1
    parsed = [(env["CUDA_VISIBLE_DEVICES"], cli.build_parser().parse_args(cmd[3:])) for cmd, env in started]
    assert [(gpu, args.kv_role, args.gpu_memory_utilization) for gpu, args in parsed] == [
        ("0", "producer", 0.45), ("1", "producer", 0.9), ("0", "consumer", 0.3)]


def test_the_store_flags_are_checked_at_start(monkeypatch, capsys):
    for argv, why in ((["serve", "--kv-connector", "store"], "needs the store's HOST:PORT"),
                      (["serve", "--kv-connector", "store", "--kv-store", "nowhere"], "expected HOST:PORT"),
                      (["serve", "--kv-store", "127.0.0.1:8700"], "only for kv_connector store")):
        assert cli.serve_main(cli.build_parser().parse_args(argv)) == 2, argv
        assert why in capsys.readouterr().err, argv
    monkeypatch.delenv("PDSERVE_ROUTER_KEY", raising=False)
    assert cli.main(["kv-store", "--host", "10.1.2.3"]) == 2   # a public store without a key
    assert "PDSERVE_ROUTER_KEY" in capsys.readouterr().err


def test_up_with_the_store_starts_it_and_points_every_instance_at_it(monkeypatch):
    from pdserve.cluster import local as cluster
    started = fake_children(monkeypatch)
    monkeypatch.setattr(cluster, "wait_listening", lambda *a: None)
    assert cli.main(["up", "--kv-connector", "store", "--num-colocated", "1", "--port", "8100",
                     "--kv-store-capacity", "2GiB"]) == 1
    store_cmd, store_env = started[0]
    assert store_cmd[2:4] == ["pdserve", "kv-store"] and store_cmd[store_cmd.index("--capacity") + 1] == "2GiB"
    assert store_env["PDSERVE_ROUTER_KEY"]                       # it checks the cluster's key
    address = f"127.0.0.1:{store_cmd[store_cmd.index('--port') + 1]}"
    for cmd, _ in started[1:]:
        args = cli.build_parser().parse_args(cmd[3:])
        assert args.kv_connector == "store" and args.kv_store == address
    assert [cli.build_parser().parse_args(c[3:]).kv_role for c, _ in started[1:]] == ["producer", "consumer", "both"]


def test_a_tensor_parallel_instance_gets_consecutive_gpus_and_a_core_share_per_rank(monkeypatch):
    from pdserve.cluster import local as cluster
    assert cluster.tensor_parallel_size(["--tensor-parallel-size", "2", "-tp=4"]) == 4
    assert cluster.tensor_parallel_size(["--max-num-seqs", "8"]) == 1
    assert cluster.place_on_gpus([2, 1, 1, 2], [0, 1, 2, 3]) == [[0, 1], [2], [3], [0, 1]]
    assert cluster.split_cores(2, list(range(6)), weights=[2, 1]) == [[0, 1, 2, 3], [4, 5]]
    assert cluster.split_cores(2, [0, 1], weights=[2, 1]) == [None, None]
    started = fake_children(monkeypatch)
    assert cluster.run_cluster(model="default", num_prefill=0, num_decode=0, num_colocated=2, host="127.0.0.1",
                               port=9000, serve_args=[], kv_transfer_config=None, device="cuda", gpus=[4, 5, 6],
                               colocated_args=["--tensor-parallel-size", "2"]) == 1
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in started] == ["4,5", "4,5"]
    started.clear()
    monkeypatch.setattr(cluster.os, "sched_getaffinity", lambda pid: set(range(6)))
    assert cluster.run_cluster(model="default", num_prefill=0, num_decode=0, num_colocated=2, host="127.0.0.1",
                               port=9000, serve_args=["-tp", "3"], kv_transfer_config=None, device="cpu") == 1
    parsed = [cli.build_parser().parse_args(cmd[3:]) for cmd, _ in started]
    assert [(a.cpu_cores, a.num_threads, a.tensor_parallel_size) for a in parsed] == [("0,1,2", 1, 3),
                                                                                       ("3,4,5", 1, 3)]


def test_up_gives_every_instance_its_tensor_parallel_size(monkeypatch):
    calls = {}
    monkeypatch.setattr("pdserve.cluster.local.run_cluster", lambda **kw: calls.update(kw) or 0)
    assert cli.main(["up", "-tp", "2"]) == 0
    assert calls["serve_args"][-2:] == ["--tensor-parallel-size", "2"]


def test_up_refuses_tensor_parallel_instances_it_cannot_pair(capsys):
    from pdserve.cluster import local as cluster
    assert cluster.run_cluster(model="default", num_prefill=1, num_decode=1, host="127.0.0.1", port=9000,
                               serve_args=["-tp", "2"], kv_transfer_config=None, device="cpu",
                               decode_args=["--tensor-parallel-size", "3"]) == 2
    assert "--tensor-parallel-size [2, 3]: of two sizes one must divide the other" in capsys.readouterr().err
    assert cluster.run_cluster(model="default", num_prefill=1, num_decode=1, host="127.0.0.1", port=9000,
                               serve_args=["-tp", "3"], kv_transfer_config=None, device="cpu",
                               kv_connector="cuda_ipc") == 2
    assert "colocated instances only" in capsys.readouterr().err
    # the store's pool holds the whole model's layout: any sizes pair (refused here only for want of GPUs)
    assert cluster.run_cluster(model="default", num_prefill=1, num_decode=1, host="127.0.0.1", port=9000,
                               serve_args=["-tp", "2"], kv_transfer_config=None, device="cuda", gpus=[0],
                               kv_connector="store", decode_args=["-tp", "3"]) == 2
    assert "needs as many GPUs, 1 listed" in capsys.readouterr().err
    assert cluster.run_cluster(model="default", num_prefill=1, num_decode=1, host="127.0.0.1", port=9000,
                               serve_args=["-tp", "2"], kv_transfer_config=None, device="cpu",
                               kv_connector="nixl-push", decode_args=["-tp", "3"]) == 2
    assert "of two sizes one must divide the other" in capsys.readouterr().err
    assert cluster.run_cluster(model="default", num_prefill=0, num_decode=0, num_colocated=1, host="127.0.0.1",
                               port=9000, serve_args=["-tp", "x"], kv_transfer_config=None, device="cpu") == 2
    assert "expected an integer" in capsys.readouterr().err
    assert cluster.run_cluster(model="default", num_prefill=0, num_decode=0, num_colocated=1, host="127.0.0.1",
                               port=9000, serve_args=["-tp", "4"], kv_transfer_config=None, device="cuda",
                               gpus=[0, 1]) == 2
    assert "needs as many GPUs, 2 listed" in capsys.readouterr().err
    # a size below 1, and abbreviated flags (which `serve` took for -tp while `up` did not), are refused
    assert cli.main(["up", "--decode-args=-tp 0"]) == 2
    assert "-tp: must be >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["up", "--num-colocated", "1", "--colocated-args=--tensor 3"]) == 2
    assert "unrecognized arguments: --tensor 3" in capsys.readouterr().err


def test_up_ray_builds_the_pool_spec_and_refuses_bad_ray_flags(monkeypatch, capsys):
    calls = {}
    monkeypatch.setattr("pdserve.cluster.ray.run_ray_cluster", lambda spec, **kw: calls.update(spec=spec, **kw) or 0)
    argv = ["up", "--ray", "--num-decode", "2", "--policy", "cost", "--pd-min-prompt-tokens", "32",
            "--ray-cpus-per-instance", "2", "--ray-resources", 'decode={"h200": 1}',
            "--decode-args", "--max-num-seqs 64", "--proxy-args", "--max-per-instance 8", "--port", "8123"]
    assert cli.main(argv) == 0
    spec = calls["spec"]
    assert calls["address"] is None and (calls["num_prefill"], calls["num_decode"]) == (1, 2)
    assert spec.cpus_per_instance == 2 and spec.extra_resources == {"decode": {"h200": 1.0}}
    assert spec.role_args["decode"] == ["--max-num-seqs", "64"] and spec.router_port == 8123
    kwargs = spec.router_kwargs
    assert kwargs["policy"] == "cost" and kwargs["router_key"] == spec.router_key
    assert kwargs["router_config"].pd_min_prompt_tokens == 32 and kwargs["router_config"].max_per_instance == 8
    assert cli.main(["up", "--ray", "auto"]) == 0 and calls["address"] == "auto"
    for bad in (["--ray-resources", "decoder={}"], ["--ray-resources", 'decode={"x": -1}'],
                ["--ray-resources", "decode=[1]"], ["--ray-cpus-per-instance", "0"], ["--ray-instance-host", "0.0.0.0"],
                ["--kv-connector", "store"], ["--proxy-args", "--max-per-instance 0"]):
        assert cli.main(["up", "--ray", *bad]) == 2, bad
        assert capsys.readouterr().err.startswith("pdserve up"), bad


def test_up_ray_autoscale_flags_reach_the_spec_and_bad_ones_are_refused(monkeypatch, capsys):
    calls = {}
    monkeypatch.setattr("pdserve.cluster.ray.run_ray_cluster", lambda spec, **kw: calls.update(spec=spec, **kw) or 0)
    assert cli.main(["up", "--ray"]) == 0 and calls["spec"].autoscale is None
    assert cli.main(["up", "--ray", "--autoscale", "--max-instances", "6", "--slo-ttft-ms", "500",
                     "--slo-tpot-ms", "20"]) == 0
    cfg = calls["spec"].autoscale
    assert (cfg.max_instances, cfg.slo_ttft_s, cfg.slo_tpot_s) == (6, 0.5, 0.02)
    for bad in (["--max-instances", "1"], ["--slo-tpot-ms", "0"], ["--num-prefill", "0", "--num-colocated", "1"]):
        assert cli.main(["up", "--ray", "--autoscale", *bad]) == 2, bad
        assert "--autoscale" in capsys.readouterr().err, bad


def test_up_on_cpu_lets_its_instances_lend_each_other_their_cores(monkeypatch):
    """Disjoint cores, one group file for every single-rank instance; --no-core-lending keeps them apart."""
    from pdserve.cluster import local as cluster
    from pdserve.worker.core_lending import default_group_dir
    started = fake_children(monkeypatch)
    monkeypatch.setattr(cluster.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cli.main(["up", "--device", "cpu", "--port", "8200", "--num-colocated", "1"]) == 1
    parsed = [cli.build_parser().parse_args(cmd[3:]) for cmd, _ in started]
    assert [(a.cpu_cores, a.num_threads) for a in parsed] == [("0,1", 2), ("2", 1), ("3", 1)]  # no core idle
    files = {a.cpu_core_lending for a in parsed}
    assert len(files) == 1 and None not in files
    path = files.pop()
    assert os.path.basename(path).startswith("pdserve-cores-") and os.path.dirname(path) == default_group_dir()
    assert not os.path.exists(path)               # made for the cluster, removed with it
    started.clear()
    assert cli.main(["up", "--device", "cpu", "--port", "8200", "--no-core-lending"]) == 1
    assert all(cli.build_parser().parse_args(c[3:]).cpu_core_lending is None for c, _ in started)
    started.clear()   # a tensor-parallel instance keeps its cores; the other one has nobody to share with
    assert cluster.run_cluster(model="default", num_prefill=1, num_decode=1, host="127.0.0.1", port=9000,
                               serve_args=[], kv_transfer_config=None, device="cpu",
                               prefill_args=["-tp", "2"]) == 1
    assert len(started) == 2
    assert all(cli.build_parser().parse_args(c[3:]).cpu_core_lending is None for c, _ in started)


@pytest.mark.parametrize("cores, message", [("5", "not a core of this machine"), ("-1", "not a core of this machine"),
                                            ("a,b", "expected core numbers"), ("0,,1", "expected core numbers"),
                                            ("", "expected core numbers")])
def test_cpu_cores_outside_the_allowed_ones_are_a_usage_error(monkeypatch, capsys, cores, message):
    """`serve --cpu-cores 5` on 2 cores loaded the model, then died in sched_setaffinity with a bare EINVAL
    traceback; the engine's config refuses them too (LLM(cpu_affinity=...) never parses flags)."""
    from pdserve.config import EngineConfig
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["serve", "--cpu-cores", cores])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--cpu-cores" in err and message in err
    assert cli.build_parser().parse_args(["serve", "--cpu-cores", "1,0"]).cpu_cores == "1,0"
    for bad in ([5], [-1], [], [True]):
        with pytest.raises(ValueError, match=r"--cpu-cores"):
            EngineConfig(cpu_affinity=bad).validate()
    EngineConfig(cpu_affinity=[0, 1]).validate()


def test_up_gives_the_cores_past_an_equal_split_to_its_instances():
    """On 3 cores, 1P1D left core 2 to nobody; `bench compare` keeps its equal devices."""
    from pdserve.cluster.local import split_cores
    assert split_cores(2, [0, 1, 2]) == [[0], [1]]
    assert split_cores(2, [0, 1, 2], use_all=True) == [[0, 1], [2]]
    assert split_cores(3, list(range(8)), use_all=True) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert split_cores(2, list(range(7)), weights=[2, 1], use_all=True) == [[0, 1, 2, 3], [4, 5, 6]]
    assert split_cores(1, list(range(5)), weights=[2], use_all=True) == [[0, 1, 2, 3]]   # ranks keep equal shares
    assert split_cores(4, [0, 1], use_all=True) == [None] * 4
