"""`pdserve up`: a local P/D cluster (prefill instances, decode instances, the proxy) on 127.0.0.1.

Lifecycle:
  1. split this machine's devices among the instances: on CUDA one GPU each (round-robin when
     there are fewer GPUs), on CPU disjoint sets of cores, each engine pinned to its own cores
     with as many torch threads as cores (two engines sharing a core halve each other's speed)
  2. start each instance as `pdserve serve --kv-role producer|consumer` and the proxy in front; a fresh
     router key (or $PDSERVE_ROUTER_KEY) goes to every child through the environment: the proxy sends
     it, the instances require it (as their API key too, so that with --host 0.0.0.0 a client cannot
     go around the proxy); the client's --api-key goes to the proxy only
  3. wait until every /health answers, then print the URL
  4. on Ctrl-C or SIGTERM (or when a child dies) stop every child, newest first

split_cores and ChildProcesses are shared with `pdserve bench compare`, which starts several such
deployments in turn.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from typing import IO, Mapping, Sequence

from pdserve.config import API_KEY_ENV, ROUTER_KEY_ENV

HEALTH_TIMEOUT_S = 600
STOP_TIMEOUT_S = 15.0


def split_cores(num_instances: int, cores: Sequence[int] | None = None) -> list[list[int] | None]:
    """Equal, disjoint sets of `cores` (default: the cores this process may run on), one per
    instance; None for every instance when there are fewer cores than instances."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if len(cores) < num_instances:
        return [None] * num_instances  # more instances than cores: let the OS share them
    per = len(cores) // num_instances
    return [cores[i * per:(i + 1) * per] for i in range(num_instances)]


def num_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


class ChildProcesses:
    """The children one launcher started; stop() ends each by its PID, newest first."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.names: dict[int, str] = {}  # pid → what error messages call the child

    def start(self, cmd: Sequence[str], *, name: str | None = None, env: Mapping[str, str] | None = None,
              stdout: IO | int | None = None, stderr: IO | int | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(list(cmd), env=None if env is None else dict(env), stdout=stdout, stderr=stderr)
        self.procs.append(proc)
        self.names[proc.pid] = name or f"{' '.join(cmd[2:6])}..."  # the subcommand and its first flags
        return proc

    def first_dead(self) -> subprocess.Popen | None:
        return next((p for p in self.procs if p.poll() is not None), None)

    def wait_healthy(self, urls: Sequence[str], timeout: float) -> None:
        """Until GET url/health answers 200 for every url; RuntimeError when a child exits first or
        the timeout passes."""
        deadline = time.monotonic() + timeout
        pending = list(urls)
        while pending:
            dead = self.first_dead()
            if dead is not None:
                raise RuntimeError(f"{self.names[dead.pid]} exited with code {dead.returncode}")
            url = pending[0]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        pending.pop(0)
                        continue
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not become healthy within {timeout:.0f} s")
            time.sleep(0.5)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to every child still running, newest first; SIGKILL to any still running after
        `timeout` s of waiting for it."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def instance_command(role: str, index: int, port: int, *, model: str, host: str, serve_args: Sequence[str],
                     role_args: Sequence[str], kv_connector: str, kv_transfer_config: str | None,
                     cores: Sequence[int] | None) -> list[str]:
    """`pdserve serve` for one instance: the shared flags, then the role's own (later flags win, so
    --prefill-args / --decode-args override what every instance gets)."""
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", model, "--host", host,
           "--port", str(port), "--kv-connector", kv_connector, "--kv-role", role,
           "--engine-id", f"{'prefill' if role == 'producer' else 'decode'}-{index}", *serve_args]
    if kv_transfer_config:
        cmd += ["--kv-transfer-config", kv_transfer_config]
    if cores:
        cmd += ["--cpu-cores", ",".join(map(str, cores)), "--num-threads", str(len(cores))]
    return cmd + list(role_args)


def run_cluster(*, model: str, num_prefill: int, num_decode: int, host: str, port: int,
                serve_args: list[str], kv_transfer_config: str | None, device: str,
                kv_connector: str = "nixl", prefill_args: Sequence[str] = (),
                decode_args: Sequence[str] = (), api_key: str | None = None) -> int:
    instances = [("producer", i) for i in range(num_prefill)] + [("consumer", i) for i in range(num_decode)]
    use_cuda = device == "cuda" or (device == "auto" and num_gpus() > 0)
    cores = [None] * len(instances) if use_cuda else split_cores(len(instances))
    num_cuda_devices = num_gpus() if use_cuda else 0
    children = ChildProcesses()

    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    router_key = os.environ.get(ROUTER_KEY_ENV) or secrets.token_urlsafe(32)
    instance_env = {**os.environ, ROUTER_KEY_ENV: router_key, API_KEY_ENV: router_key}
    proxy_env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    proxy_env[ROUTER_KEY_ENV] = router_key
    if api_key is not None:
        proxy_env[API_KEY_ENV] = api_key
    prefill_urls, decode_urls = [], []
    try:
        for n, (role, i) in enumerate(instances):
            inst_port = port + 1 + n
            cmd = instance_command(role, i, inst_port, model=model, host=host, serve_args=serve_args,
                                   role_args=prefill_args if role == "producer" else decode_args,
                                   kv_connector=kv_connector, kv_transfer_config=kv_transfer_config,
                                   cores=cores[n])
            env = dict(instance_env)
            if use_cuda and num_cuda_devices:
                env["CUDA_VISIBLE_DEVICES"] = str(n % num_cuda_devices)
            children.start(cmd, env=env)
            (prefill_urls if role == "producer" else decode_urls).append(f"http://{host}:{inst_port}")
        children.wait_healthy(prefill_urls + decode_urls, HEALTH_TIMEOUT_S)
        children.start([sys.executable, "-m", "pdserve", "proxy", "--host", host, "--port", str(port),
                        "--prefill", *prefill_urls, "--decode", *decode_urls], env=proxy_env)
        url = f"http://{host}:{port}"
        children.wait_healthy([url], 60)
        served = next((a for f, a in zip(serve_args, serve_args[1:]) if f == "--served-model-name"), model)
        auth_header = '-H "Authorization: Bearer $KEY" ' if api_key else ""
        print(f"pdserve cluster ready: {url}/v1  (prefill: {' '.join(prefill_urls)}; "
              f"decode: {' '.join(decode_urls)}). Ctrl-C stops it.\nTry:\n"
              f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
              f"{auth_header}-d "
              f"'{{\"model\": \"{served}\", \"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"What is the capital of France?\"}}], \"max_tokens\": 32}}'", flush=True)
        while children.first_dead() is None:
            time.sleep(0.5)
        print(f"a child exited (code {children.first_dead().returncode}); stopping the cluster", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 1
    finally:
        children.stop()
