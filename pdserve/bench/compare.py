"""`pdserve bench compare`: colocated, chunked-prefill colocated and disaggregated serving on equal devices.

Seed 004 (二.5, 五.3): compare at least plain colocated, tuned chunked-prefill colocated and P/D
disaggregated serving on the same total devices, model, weights and workload, by goodput under an SLO
across arrival rates, so that no configuration wins by having more hardware. The configurations:
  colocated          N × `pdserve serve --no-chunked-prefill`, behind `pdserve proxy --colocated` (round-robin)
  colocated-chunked  N × `pdserve serve --max-num-batched-tokens B` (chunked prefill on), behind the same
  disaggregated      P × `serve --kv-connector K --kv-role producer` + (N - P) × `--kv-role consumer`,
                     behind `pdserve proxy --prefill ... --decode ...` (K: --kv-connector, nixl, nixl-push or cuda_ipc; --router-args its router flags)
Equal devices: instance i of every configuration gets device i of N: on CPU the i-th of N equal,
disjoint core sets (`--cpu-cores`, `--num-threads`), on CUDA one GPU (CUDA_VISIBLE_DEVICES). The
proxy and this client are not pinned; they share the machine alike in every configuration.

Lifecycle, one configuration at a time:
  1. plan every command line and port (plan_deployment); the ports must be free;
  2. start the instances, each logging to <out-dir>/logs/<config>/<instance>.log; wait for /health;
     start the proxy; wait for its /health;
  3. warm up: a few requests of another seed, not measured (first-request and handshake costs);
  4. sweep: the same prompts, seed and rates for every configuration (run_sweep);
  5. stop every child by PID, newest first, also after a failure or Ctrl-C; write <config>.json
     (the sweep JSON plus the deployment).
Then summary.json, summary.md and compare.png. A configuration that fails (an instance that does not
start, a warm-up with no success) is a row with its error, and the next configuration still runs.

This module speaks HTTP to what it measures; it starts servers only as `pdserve` child processes.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import signal
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from pdserve.bench.cli import _add_workload_args, _positive_int, _write_json, config_from_args
from pdserve.bench.metrics import format_rate, max_rate_meeting_slo, parse_rate
from pdserve.bench.plots import plot_sweeps, require_matplotlib
from pdserve.bench.runner import BenchConfig, run_benchmark, run_sweep
from pdserve.cli_types import byte_size, port as port_type
from pdserve.cluster.local import ChildProcesses, port_taken, split_cores
from pdserve.help_format import HelpFormatter

CONFIG_NAMES = ("colocated", "colocated-chunked", "disaggregated")
KV_CONNECTORS = ("nixl", "nixl-push", "cuda_ipc")
PROXY_START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0           # an instance shuts its engine process down before it exits


@dataclass(frozen=True)
class Device:
    """One of the N equal devices: a set of CPU cores, or one GPU (an entry of CUDA_VISIBLE_DEVICES)."""
    cores: tuple[int, ...] | None = None
    gpu: str | None = None

    def serve_args(self) -> list[str]:
        if not self.cores:
            return []
        return ["--cpu-cores", ",".join(map(str, self.cores)), "--num-threads", str(len(self.cores))]

    def env(self) -> dict[str, str]:
        return {} if self.gpu is None else {"CUDA_VISIBLE_DEVICES": self.gpu}

    def describe(self) -> str:
        return f"GPU {self.gpu}" if self.gpu is not None else f"cores {','.join(map(str, self.cores or ()))}"


@dataclass(frozen=True)
class InstanceSpec:
    name: str                    # colocated-0, prefill-0, decode-0
    role: str                    # colocated | prefill | decode
    port: int
    args: tuple[str, ...]        # the `pdserve` arguments, from `serve` on
    device: Device


@dataclass(frozen=True)
class Deployment:
    """One configuration laid out on the devices: its instances and the proxy in front of them."""
    config: str
    layout: str                  # "2 colocated", "1P1D"
    host: str
    instances: tuple[InstanceSpec, ...]
    proxy_port: int
    proxy_args: tuple[str, ...]  # the `pdserve` arguments, from `proxy` on

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.proxy_port}"

    def instance_url(self, instance: InstanceSpec) -> str:
        return f"http://{self.host}:{instance.port}"

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "layout": self.layout, "url": self.url,
                "proxy": ["pdserve", *self.proxy_args],
                "instances": [{"name": i.name, "role": i.role, "url": self.instance_url(i),
                               "device": i.device.describe(), "command": ["pdserve", *i.args]}
                              for i in self.instances]}


@dataclass
class CompareConfig:
    configs: tuple[str, ...] = CONFIG_NAMES
    num_devices: int = 2
    prefill_share: str = "0.5"   # a fraction of the devices (rounded, at least 1 each side) or "P:D"
    chunked_budgets: tuple[int, ...] = (512,)  # colocated-chunked: --max-num-batched-tokens; several: one run each
    max_num_batched_tokens: int | None = None  # colocated and disaggregated; None: the instance default
    prefix_caching: bool = False  # off: a sweep repeats its prompts at every rate, which would hit the cache
    serve_args: tuple[str, ...] = ()  # model flags for every instance (--model, --dtype, --seed, ...)
    kv_connector: str = "nixl"    # disaggregated: --kv-connector (nixl | cuda_ipc)
    kv_transfer_config: str | None = None  # disaggregated: --kv-transfer-config JSON
    router_args: tuple[str, ...] = ()  # disaggregated: the router's own flags (--policy, --pd-min-prompt-tokens, ...)
    device: str = "auto"         # auto | cpu | cuda
    host: str = "127.0.0.1"
    base_port: int = 8100        # the proxy; instance i listens on base_port + 1 + i
    start_timeout_s: float = 600.0
    num_warmup: int = 2
    launcher: tuple[str, ...] = (sys.executable, "-m", "pdserve")  # tests put a fake server here
    cores: tuple[int, ...] | None = None  # CPU cores to split (None: those this process may use)
    gpus: tuple[str, ...] | None = None   # CUDA devices to use (None: detected)

    def validate(self) -> None:
        unknown = [c for c in self.configs if c not in CONFIG_NAMES]
        if not self.configs or unknown:
            raise ValueError(f"configs: expected a subset of {','.join(CONFIG_NAMES)}, got {','.join(self.configs)}")
        if self.num_devices < 1:
            raise ValueError(f"num_devices: must be >= 1, got {self.num_devices}")
        if "disaggregated" in self.configs:
            self.num_prefill()
        if not self.chunked_budgets or min(self.chunked_budgets) < 1:
            raise ValueError(f"chunked_budgets: one or more budgets >= 1, got {self.chunked_budgets}")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector: expected one of {', '.join(KV_CONNECTORS)}, got {self.kv_connector!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: expected auto, cpu or cuda, got {self.device!r}")
        if not (0 < self.base_port and self.base_port + self.num_devices < 65536):
            raise ValueError(f"base_port: ports {self.base_port}..{self.base_port + self.num_devices} are not valid")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup: must be >= 0, got {self.num_warmup}")

    def num_prefill(self) -> int:
        """Prefill instances of the disaggregated configuration; ValueError naming prefill_share."""
        n = self.num_devices
        if n < 2:
            raise ValueError(f"num_devices: disaggregated needs at least 2 devices (1P1D), got {n}")
        try:
            if ":" in self.prefill_share:
                p, d = (int(x) for x in self.prefill_share.split(":"))
            else:
                share = float(self.prefill_share)
                p = min(max(round(n * share), 1), n - 1) if 0.0 < share < 1.0 else 0
                d = n - p
        except ValueError:
            p = d = 0
        if p < 1 or d < 1 or p + d != n:
            raise ValueError(f"prefill_share: a fraction in (0, 1), or P:D with P, D >= 1 and P + D = "
                             f"num_devices ({n}); got {self.prefill_share!r}")
        return p


def visible_gpus() -> tuple[str, ...]:
    """CUDA_VISIBLE_DEVICES' entries, else one index per `nvidia-smi -L` line; torch stays out of bench."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return tuple(g.strip() for g in visible.split(",") if g.strip())
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    num_gpus = sum(line.startswith("GPU ") for line in listing.splitlines())  # "GPU 0: NVIDIA H200 (UUID: ...)"
    return tuple(str(i) for i in range(num_gpus))


def split_devices(cc: CompareConfig) -> list[Device]:
    """N equal devices, or ValueError when this machine has fewer than N (no sharing: not fair)."""
    n = cc.num_devices
    gpus = cc.gpus
    if gpus is None and cc.device != "cpu":
        gpus = visible_gpus()
    if cc.device == "cuda" or (cc.device == "auto" and gpus):
        if len(gpus or ()) < n:
            raise ValueError(f"num_devices: {n} instances need {n} GPUs, found {len(gpus or ())}")
        return [Device(gpu=g) for g in gpus[:n]]
    cores = sorted(cc.cores if cc.cores is not None else os.sched_getaffinity(0))
    if len(cores) < n:
        raise ValueError(f"num_devices: {n} instances need {n} disjoint core sets, this process has "
                         f"{len(cores)} cores")
    return [Device(cores=tuple(c)) for c in split_cores(n, cores)]


def planned_runs(cc: CompareConfig) -> list[tuple[str, str, int | None]]:
    """(run name, configuration, chunk budget) in order: with several --chunked-budget values the
    chunked configuration runs once per budget, as colocated-chunked-<budget>."""
    runs: list[tuple[str, str, int | None]] = []
    for config in cc.configs:
        if config != "colocated-chunked":
            runs.append((config, config, None))
        elif len(cc.chunked_budgets) == 1:
            runs.append((config, config, cc.chunked_budgets[0]))
        else:
            runs += [(f"{config}-{budget}", config, budget) for budget in cc.chunked_budgets]
    return runs


def tuned_chunked(configs: Sequence[Mapping[str, Any]]) -> str | None:
    """The best of several chunked runs (the tuned chunked-prefill baseline the seed asks for): the
    highest max rate meeting the SLO, then the most goodput there. None with fewer than two."""
    runs = [c for c in configs if c["config"].startswith("colocated-chunked-") and c["status"] == "ok"]
    if len(runs) < 2:
        return None
    best = max(runs, key=lambda c: (-1.0 if c["max_rate_meeting_slo"] is None else parse_rate(c["max_rate_meeting_slo"]),
                                    c["goodput_per_device_at_max"] or 0.0))
    return best["config"]


def plan_deployment(config: str, cc: CompareConfig, devices: Sequence[Device], *, name: str | None = None,
                    chunked_budget: int | None = None) -> Deployment:
    """Every command line and port of one configuration; instance i runs on devices[i]. name: the
    run's name (default: config); chunked_budget: colocated-chunked's budget (default: the first)."""
    common = [*cc.serve_args, "--device", cc.device]
    if not cc.prefix_caching:
        common.append("--no-prefix-caching")
    budget = [] if cc.max_num_batched_tokens is None else ["--max-num-batched-tokens", str(cc.max_num_batched_tokens)]
    if config == "disaggregated":
        num_prefill = cc.num_prefill()
        roles = [("prefill", i) for i in range(num_prefill)] + \
                [("decode", i) for i in range(cc.num_devices - num_prefill)]
        layout = f"{num_prefill}P{cc.num_devices - num_prefill}D"
    else:
        roles = [("colocated", i) for i in range(cc.num_devices)]
        layout = f"{cc.num_devices} colocated"

    instances = []
    for n, ((role, i), device) in enumerate(zip(roles, devices)):
        port = cc.base_port + 1 + n
        args = ["serve", "--host", cc.host, "--port", str(port), *common]
        if config == "colocated":
            args += ["--no-chunked-prefill", *budget]
        elif config == "colocated-chunked":
            args += ["--max-num-batched-tokens", str(chunked_budget or cc.chunked_budgets[0])]
        else:
            args += ["--kv-connector", cc.kv_connector, "--kv-role", "producer" if role == "prefill" else "consumer",
                     "--engine-id", f"{role}-{i}", *budget]
            if cc.kv_transfer_config:
                args += ["--kv-transfer-config", cc.kv_transfer_config]
        instances.append(InstanceSpec(f"{role}-{i}", role, port, tuple(args + device.serve_args()), device))

    urls = {role: [f"http://{cc.host}:{s.port}" for s in instances if s.role == role]
            for role in ("colocated", "prefill", "decode")}
    proxy_args = ["proxy", "--host", cc.host, "--port", str(cc.base_port)]
    if config == "disaggregated":
        proxy_args += ["--prefill", *urls["prefill"], "--decode", *urls["decode"], *cc.router_args]
    else:
        proxy_args += ["--colocated", *urls["colocated"]]
    return Deployment(name or config, layout, cc.host, tuple(instances), cc.base_port, tuple(proxy_args))


# ---- run one configuration ------------------------------------------------------------------------

def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


async def _warm_up_and_sweep(bench: BenchConfig, rates: list[float], num_warmup: int,
                             target_attainment: float, progress: bool):
    if num_warmup:
        # multi-turn counts users and turns, not prompts: num_warmup one-turn conversations
        warm = await run_benchmark(replace(bench, num_prompts=num_warmup, num_users=num_warmup, num_turns=1,
                                           request_rate=math.inf, seed=bench.seed + 1, max_concurrency=None))
        if not warm.metrics["num_completed"]:
            first_error = next(iter(warm.metrics["errors"]), "unknown error")
            raise RuntimeError(f"warm-up: all {num_warmup} requests failed ({first_error})")
    return await run_sweep(bench, rates, progress=progress, target_attainment=target_attainment)


def run_deployment(deployment: Deployment, cc: CompareConfig, bench: BenchConfig, rates: list[float], *,
                   target_attainment: float, log_dir: Path, progress: bool = False) -> dict[str, Any]:
    """Start, warm up, sweep, stop. The sweep's JSON dict; RuntimeError (with the failed instance's
    last log line) when the deployment does not come up or every warm-up request fails."""
    log_dir.mkdir(parents=True, exist_ok=True)
    children = ChildProcesses()
    logs: dict[str, Path] = {}
    with ExitStack() as files:

        def start(name: str, args: Sequence[str], device_env: Mapping[str, str]) -> None:
            logs[name] = log_dir / f"{name}.log"
            log = files.enter_context(open(logs[name], "wb"))
            children.start([*cc.launcher, *args], name=name, env={**os.environ, **device_env},
                           stdout=log, stderr=subprocess.STDOUT)

        try:
            busy = [p for p in [deployment.proxy_port, *(i.port for i in deployment.instances)]
                    if port_taken(deployment.host, p) is not None]
            if busy:
                raise RuntimeError(f"port {busy[0]} on {deployment.host} is in use (choose another --base-port)")
            for spec in deployment.instances:
                start(spec.name, spec.args, spec.device.env())
            children.wait_healthy([deployment.instance_url(i) for i in deployment.instances], cc.start_timeout_s)
            start("proxy", deployment.proxy_args, {})
            children.wait_healthy([deployment.url], PROXY_START_TIMEOUT_S)
            sweep = asyncio.run(_warm_up_and_sweep(replace(bench, base_url=deployment.url), rates,
                                                   cc.num_warmup, target_attainment, progress))
        except RuntimeError as e:
            dead = children.first_dead()
            if dead is not None:  # name the instance that died and its last words
                name = children.names[dead.pid]
                raise RuntimeError(f"{e}; {logs[name]}: {_last_line(logs[name])}") from None
            raise
        finally:
            children.stop(STOP_TIMEOUT_S)
    return sweep.to_dict()


# ---- the summary ----------------------------------------------------------------------------------

def summarize(config: str, sweep: Mapping[str, Any] | None, num_devices: int, *,
              target_attainment: float = 0.9, deployment: Deployment | None = None,
              status: str = "ok", error: str | None = None) -> dict[str, Any]:
    """One configuration's summary: the highest rate meeting the target attainment (every lower rate
    meeting it too), that rate per device, the goodput measured there per device, and per rate the
    TTFT p90, TPOT p90 and attainment."""
    entry: dict[str, Any] = {"config": config, "status": status, "error": error,
                             "layout": deployment.layout if deployment else None,
                             "deployment": deployment.to_dict() if deployment else None,
                             "max_rate_meeting_slo": None, "max_rate_per_device": None,
                             "goodput_per_device_at_max": None, "rates": []}
    if sweep is None:
        return entry
    results = sweep["results"]
    entry["rates"] = [{"request_rate": e["request_rate"], "num_completed": e["metrics"]["num_completed"],
                       "num_failed": e["metrics"]["num_failed"], "ttft_p90_ms": e["metrics"]["ttft_ms"]["p90"],
                       "tpot_p90_ms": e["metrics"]["tpot_ms"]["p90"],
                       "slo_attainment": e["metrics"]["slo_attainment"], "goodput": e["metrics"]["goodput"],
                       "output_token_throughput": e["metrics"]["output_token_throughput"],
                       "errors": e["metrics"]["errors"]} for e in results]
    best = max_rate_meeting_slo(results, target_attainment)
    if best is not None:
        at_best = next(e for e in results if parse_rate(e["request_rate"]) == best)
        entry["max_rate_meeting_slo"] = format_rate(best)
        entry["max_rate_per_device"] = format_rate(best / num_devices)
        entry["goodput_per_device_at_max"] = at_best["metrics"]["goodput"] / num_devices
    if status == "ok" and results and not any(e["metrics"]["num_completed"] for e in results):
        errors = [m for e in results for m in e["metrics"]["errors"]]
        entry.update(status="failed", error=f"every request failed ({errors[0] if errors else 'unknown error'})")
    return entry


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rate(value: float | str | None) -> str:
    return "-" if value is None else f"{parse_rate(value):g}"


def _describe_workload(work: Mapping[str, Any]) -> str:
    if work["dataset"] == "multi-turn":
        return (f"{work['num_users']} users x {work['num_turns']} turns, multi-turn ({work['num_groups']} system "
                f"prompts of {work['prefix_len']} words, turns of {work['turn_len']}), {work['endpoint']}, "
                f"output {work['output_len']}")
    if work["dataset"] == "mixed":
        (short_low, short_high), (long_low, long_high) = work["short_len"], work["long_len"]
        return (f"{work['num_prompts']} prompts, mixed ({work['short_fraction']:.0%} of {short_low}-{short_high} "
                f"tokens, the rest {long_low}-{long_high}), {work['endpoint']}, output {work['output_len']}")
    return (f"{work['num_prompts']} prompts, {work['dataset']}, {work['endpoint']}, "
            f"input {work['input_len']}, output {work['output_len']}")


def format_summary_md(summary: Mapping[str, Any]) -> str:
    work = summary["workload"]
    slo = " and ".join(f"{label} ≤ {work[key]:g} ms"
                       for label, key in (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms"))
                       if work.get(key) is not None) or "none (attainment = success rate)"
    rates = ", ".join(_rate(r) for r in summary["request_rates"])
    target = summary["target_attainment"]
    lines = [
        "# pdserve bench compare", "",
        f"- model: {summary['model']}; {summary['num_devices']} devices ({summary['device']}: "
        f"{' | '.join(summary['devices'])}) for every configuration",
        f"- workload: {_describe_workload(work)}, seed {work['seed']}; rates {rates} req/s",
        f"- SLO: {slo}; target attainment {target:.0%}",
        *([f"- tuned chunked-prefill baseline: {summary['tuned_chunked']} (of the chunked budgets run, the "
           "highest max rate, then the most goodput there)"] if summary.get("tuned_chunked") else []), "",
        f"| config | deployment | max rate ≥ {target:.0%} (req/s) | per device | goodput/device there | status |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in summary["configs"]:
        status = c["status"] if not c["error"] else f"{c['status']}: {c['error']}"
        status = " ".join(status.replace("|", "/").split())  # one table cell
        lines.append(f"| {c['config']} | {c['layout'] or '-'} | {_rate(c['max_rate_meeting_slo'])} | "
                     f"{_rate(c['max_rate_per_device'])} | {_num(c['goodput_per_device_at_max'], 2)} | {status} |")
    lines += ["", "| config | rate (req/s) | ok/failed | TTFT p90 (ms) | TPOT p90 (ms) | attainment | "
                  "goodput (req/s) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in summary["configs"]:
        for r in c["rates"]:
            lines.append(f"| {c['config']} | {_rate(r['request_rate'])} | {r['num_completed']}/{r['num_failed']} | "
                         f"{_num(r['ttft_p90_ms'])} | {_num(r['tpot_p90_ms'])} | {r['slo_attainment']:.0%} | "
                         f"{_num(r['goodput'], 2)} |")
    errors = [f"- {c['config']} at {_rate(r['request_rate'])} req/s: {n} × {message}"
              for c in summary["configs"] for r in c["rates"] for message, n in r["errors"].items()]
    if errors:
        lines += ["", "Errors:", *errors]
    return "\n".join(lines) + "\n"


# ---- the whole comparison -------------------------------------------------------------------------

def _flag_value(args: Sequence[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def run_compare(cc: CompareConfig, bench: BenchConfig, rates: list[float], *, out_dir: str | Path,
                target_attainment: float = 0.9, progress: bool = False, plot: bool = True,
                command: Sequence[str] | None = None) -> dict[str, Any]:
    """Every configuration of `cc` in turn (see the module docstring); writes <config>.json,
    summary.json, summary.md and compare.png under out_dir and returns the summary. ValueError for a
    bad config or too few devices, before anything starts. On KeyboardInterrupt the summary of what
    ran is written and the interrupt goes on."""
    cc.validate()
    bench.validate()
    if not rates:
        raise ValueError("request_rates: give at least one rate")
    devices = split_devices(cc)
    if plot:
        require_matplotlib()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workload = bench.to_dict()
    del workload["request_rate"], workload["base_url"]
    summary: dict[str, Any] = {
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": list(command) if command else None,
        "model": _flag_value(cc.serve_args, "--model") or "default",
        "num_devices": cc.num_devices, "device": "cuda" if devices[0].gpu is not None else "cpu",
        "devices": [d.describe() for d in devices], "workload": workload,
        "request_rates": [format_rate(r) for r in rates], "target_attainment": target_attainment,
        "configs": []}
    sweeps: list[tuple[str, dict[str, Any]]] = []
    try:
        for name, config, budget in planned_runs(cc):
            deployment = plan_deployment(config, cc, devices, name=name, chunked_budget=budget)
            print(f"[compare] {name}: {deployment.layout} on {', '.join(summary['devices'])}", file=sys.stderr,
                  flush=True)
            try:
                sweep = run_deployment(deployment, cc, bench, rates, target_attainment=target_attainment,
                                       log_dir=out / "logs" / name, progress=progress)
            except (RuntimeError, ValueError, OSError) as e:
                print(f"[compare] {name} failed: {e}", file=sys.stderr, flush=True)
                summary["configs"].append(summarize(name, None, cc.num_devices, deployment=deployment,
                                                    status="failed", error=str(e)))
                continue
            except KeyboardInterrupt:
                summary["configs"].append(summarize(name, None, cc.num_devices, deployment=deployment,
                                                    status="interrupted"))
                raise
            sweep["deployment"] = deployment.to_dict()
            _write_json(str(out / f"{name}.json"), sweep)
            sweeps.append((name, sweep))
            summary["configs"].append(summarize(name, sweep, cc.num_devices, target_attainment=target_attainment,
                                                deployment=deployment))
    finally:
        summary["tuned_chunked"] = tuned_chunked(summary["configs"])
        _write_json(str(out / "summary.json"), summary)
        (out / "summary.md").write_text(format_summary_md(summary), encoding="utf-8")
        if plot and sweeps:
            plot_sweeps(sweeps, out / "compare.png")
    return summary


# ---- CLI ------------------------------------------------------------------------------------------

COMPARE_HELP = """\
Compare colocated, chunked-prefill colocated and P/D disaggregated serving on the same N devices.

Each configuration is started here in turn (instances pinned to the same devices: on CPU N disjoint
core sets, on CUDA one GPU each; a proxy in front on --base-port), warmed up, swept with the same
workload at every --request-rates (same prompts and seed), and stopped:
  colocated          N x `pdserve serve --no-chunked-prefill` behind `pdserve proxy --colocated`
  colocated-chunked  N x `pdserve serve --max-num-batched-tokens <--chunked-budget>` behind the same
                     (several budgets: one run each; the summary names the best)
  disaggregated      P prefill + (N-P) decode instances (--kv-connector, nixl) behind the P/D proxy
Per configuration the summary gives the highest rate whose SLO attainment (and every lower rate's)
reaches --target-attainment, that rate per device, and at each rate TTFT p90, TPOT p90 and attainment.
--seed seeds the workload and the dummy weights (--load-format dummy) alike. Prefix caching is off
unless --prefix-caching: a sweep sends the same prompts at every rate (turn it on where reuse is the
point: --dataset prefix-shared or multi-turn).

Writes to --out-dir: <config>.json (the sweep), summary.json, summary.md, compare.png and
logs/<config>/<instance>.log. A configuration that cannot start is reported, not fatal.

example: pdserve bench compare --num-devices 2 --num-prompts 100 --input-len 512 --output-len 64 \\
             --request-rates 1,2,4,inf --slo-ttft-ms 2000 --slo-tpot-ms 200 --out-dir cmp
"""


def _budget_list(text: str) -> tuple[int, ...]:
    try:
        budgets = tuple(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError:
        budgets = ()
    if not budgets or min(budgets) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts separated by commas, got {text!r}")
    return budgets


def _config_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [n for n in names if n not in CONFIG_NAMES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected names from {','.join(CONFIG_NAMES)}, got {text!r}")
    return names


def add_compare_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("compare", help="colocated vs chunked vs disaggregated on equal devices",
                             description=COMPARE_HELP, formatter_class=HelpFormatter)
    g = p.add_argument_group("configurations")
    g.add_argument("--configs", type=_config_list, default=CONFIG_NAMES, metavar="NAME,...",
                   help=f"which to run, in this order (default: {','.join(CONFIG_NAMES)})")
    g.add_argument("--num-devices", type=_positive_int, default=2, help="devices (core sets or GPUs) per configuration")
    g.add_argument("--prefill-share", default="0.5",
                   help="disaggregated: share of the devices for prefill (rounded, >= 1 each side) or P:D, e.g. 1:3")
    g.add_argument("--chunked-budget", type=_budget_list, default=(512,), metavar="B[,B...]",
                   help="colocated-chunked: --max-num-batched-tokens (the chunk size); several: one run each "
                        "(colocated-chunked-<B>), and the summary names the best as the tuned baseline")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="token budget of colocated and disaggregated instances (default: the instance's, 2048); "
                        "without chunked prefill it also caps the prompt length")
    g.add_argument("--prefix-caching", action="store_true", help="keep prefix caching on in every instance")
    g.add_argument("--kv-connector", default="nixl", choices=KV_CONNECTORS,
                   help="disaggregated: the KV transport (cuda_ipc: GPUs of one host, no NIXL needed)")
    g.add_argument("--kv-transfer-config", default=None, help="disaggregated: JSON for every P and D instance")
    g.add_argument("--router-args", default="", metavar="'FLAGS'",
                   help="disaggregated: the router's own flags, e.g. '--policy cost --pd-min-prompt-tokens 256' "
                        "(conditional disaggregation: short prompts go straight to a decode instance)")

    m = p.add_argument_group("model (passed to every instance)")
    m.add_argument("--model", dest="serve_model", metavar="MODEL", default="default",
                   help="what `pdserve serve --model` takes")
    m.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    m.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    m.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    m.add_argument("--max-model-len", type=_positive_int, default=None)
    m.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help="most requests running at once, per instance (default: the instance's, 256)")
    m.add_argument("--kv-cache-memory", type=byte_size, default=None, help="bytes of KV cache per instance, e.g. 4GiB (on CUDA instead of the memory fraction)")

    r = p.add_argument_group("processes and output")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--base-port", type=port_type, default=8100, help="the proxy's port; instance i takes base-port + 1 + i")
    r.add_argument("--start-timeout", type=float, default=600.0, help="seconds for the instances to become healthy")
    r.add_argument("--num-warmup", type=int, default=2, help="unmeasured requests before each configuration's sweep")
    r.add_argument("--out-dir", default=None, help="default: compare-<UTC time> in the current directory")
    r.add_argument("--no-plot", action="store_true", help="do not draw compare.png")

    _add_workload_args(p, is_sweep=True, starts_servers=True)
    # what config_from_args reads but compare sets itself: the proxy's URL, the model from /v1/models
    p.set_defaults(base_url="http://127.0.0.1", model=None, api_key=None, out=None, plot=None, func=compare_main)


def compare_config_from_args(args: argparse.Namespace) -> CompareConfig:
    serve_args = ["--model", args.serve_model, "--load-format", args.load_format, "--dtype", args.dtype,
                  "--seed", str(args.seed)]
    for flag, value in (("--max-model-len", args.max_model_len), ("--kv-cache-memory", args.kv_cache_memory),
                        ("--max-num-seqs", args.max_num_seqs)):
        if value is not None:
            serve_args += [flag, str(value)]
    cc = CompareConfig(configs=args.configs, num_devices=args.num_devices, prefill_share=args.prefill_share,
                       chunked_budgets=args.chunked_budget, max_num_batched_tokens=args.max_num_batched_tokens,
                       prefix_caching=args.prefix_caching, serve_args=tuple(serve_args),
                       kv_connector=args.kv_connector, kv_transfer_config=args.kv_transfer_config,
                       router_args=tuple(shlex.split(args.router_args)), device=args.device, host=args.host,
                       base_port=args.base_port, start_timeout_s=args.start_timeout, num_warmup=args.num_warmup)
    cc.validate()
    return cc


def _raise_interrupt(*_args) -> None:
    raise KeyboardInterrupt


def compare_main(args: argparse.Namespace, cc: CompareConfig | None = None) -> int:
    """Exit codes: 0 some configuration completed requests, 1 none did, 2 a bad argument, 130 interrupted."""
    try:
        bench = config_from_args(args)
        cc = cc or compare_config_from_args(args)
        if not 0.0 < args.target_attainment <= 1.0:
            raise ValueError(f"target_attainment: must be in (0, 1], got {args.target_attainment}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_dir = args.out_dir or f"compare-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM stops the children like Ctrl-C
    try:
        summary = run_compare(cc, bench, args.request_rates, out_dir=out_dir,
                              target_attainment=args.target_attainment, progress=not args.no_progress,
                              plot=not args.no_plot, command=sys.argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: every child stopped; what ran is in {out_dir}/summary.md", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_summary_md(summary))
    print(f"wrote {out_dir}/summary.md, summary.json" + ("" if args.no_plot else ", compare.png"))
    return 0 if any(r["num_completed"] for c in summary["configs"] for r in c["rates"]) else 1
