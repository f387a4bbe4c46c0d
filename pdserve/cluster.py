"""`pdserve up`: a local P/D cluster (prefill instances, decode instances, the proxy) on 127.0.0.1.

Lifecycle:
  1. split this machine's devices among the instances: on CUDA one GPU each (round-robin when
     there are fewer GPUs), on CPU disjoint sets of cores, each engine pinned to its own cores
     with as many torch threads as cores (two engines sharing a core halve each other's speed)
  2. start each instance as `pdserve serve --kv-role producer|consumer` and the proxy in front
  3. wait until every /health answers, then print the URL
  4. on Ctrl-C or SIGTERM (or when a child dies) stop every child, newest first
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

HEALTH_TIMEOUT_S = 600


def _split_cores(num_instances: int) -> list[list[int] | None]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < num_instances:
        return [None] * num_instances  # more instances than cores: let the OS share them
    per = len(cores) // num_instances
    return [cores[i * per:(i + 1) * per] for i in range(num_instances)]


def _num_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


def _wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{' '.join(p.args[2:6])}... exited with code {p.returncode}")
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


def run_cluster(*, model: str, num_prefill: int, num_decode: int, host: str, port: int,
                serve_args: list[str], kv_transfer_config: str | None, device: str) -> int:
    instances = [("producer", i) for i in range(num_prefill)] + [("consumer", i) for i in range(num_decode)]
    use_cuda = device == "cuda" or (device == "auto" and _num_gpus() > 0)
    cores = [None] * len(instances) if use_cuda else _split_cores(len(instances))
    num_gpus = _num_gpus() if use_cuda else 0
    procs: list[subprocess.Popen] = []

    def stop(*_args) -> None:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()

    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    prefill_urls, decode_urls = [], []
    try:
        for n, (role, i) in enumerate(instances):
            inst_port = port + 1 + n
            cmd = [sys.executable, "-m", "pdserve", "serve", "--model", model, "--host", host,
                   "--port", str(inst_port), "--kv-connector", "nixl", "--kv-role", role,
                   "--engine-id", f"{'prefill' if role == 'producer' else 'decode'}-{i}", *serve_args]
            if kv_transfer_config:
                cmd += ["--kv-transfer-config", kv_transfer_config]
            env = dict(os.environ)
            if use_cuda and num_gpus:
                env["CUDA_VISIBLE_DEVICES"] = str(n % num_gpus)
            if cores[n]:
                cmd += ["--cpu-cores", ",".join(map(str, cores[n])), "--num-threads", str(len(cores[n]))]
            procs.append(subprocess.Popen(cmd, env=env))
            (prefill_urls if role == "producer" else decode_urls).append(f"http://{host}:{inst_port}")
        _wait_healthy(prefill_urls + decode_urls, procs, HEALTH_TIMEOUT_S)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pdserve", "proxy", "--host", host, "--port", str(port),
             "--prefill", *prefill_urls, "--decode", *decode_urls]))
        url = f"http://{host}:{port}"
        _wait_healthy([url], procs, 60)
        print(f"pdserve cluster ready: {url}/v1  (prefill: {' '.join(prefill_urls)}; "
              f"decode: {' '.join(decode_urls)}). Ctrl-C stops it.", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        dead = [p for p in procs if p.poll() is not None]
        print(f"a child exited (code {dead[0].returncode}); stopping the cluster", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 1
    finally:
        stop()
