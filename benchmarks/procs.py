"""Process plumbing shared by the CPU benchmarks: start a server in its own process group, wait for it
to answer, stop it (the whole group) with a deadline."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path


def refuse_if_answering(url: str) -> None:
    """A server left on the port would answer for the one the benchmark starts."""
    try:
        urllib.request.urlopen(url + "/health", timeout=2)
    except OSError:
        return
    raise RuntimeError(f"something already answers on {url}: stop it first")


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """env: variables set for the child on top of this process's environment."""
    with open(log, "w") as out:   # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=None if env is None else {**os.environ, **env})


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + path, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not ready within {timeout:.0f} s")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM to the process group (its children too), SIGKILL after `timeout`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
