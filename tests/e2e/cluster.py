"""Real pdserve processes on 127.0.0.1 for end-to-end tests, stopped by PID."""
from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports (for `pdserve up`: the router's, then one per instance),
    below the kernel's ephemeral range, so that no free_port() of a test beside it, and no client
    connection's source port, can take one of them between this check and `up`'s bind."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_start = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, ephemeral_start - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no run of {count} free ports below {ephemeral_start}")


# Every Process started and not yet stopped: a module that leaves one running fails (tests/e2e/conftest.py),
# since a leftover server keeps a core busy (and its ports taken) for every test after it.
LIVE: set["Process"] = set()


class Process:
    """`python -m pdserve ARGS --port FREE_PORT`, its output in LOG_DIR/pdserve-NAME-PORT.log; `env`
    adds variables (e.g. CUDA_VISIBLE_DEVICES)."""

    def __init__(self, args: list[str], name: str, env: dict[str, str] | None = None,
                 log_dir: str = "/tmp", port: int | None = None) -> None:
        self.name, self.args, self.extra_env, self.log_dir = name, args, env, log_dir
        self.port_is_ours = port is None   # a free port we picked: another may take it before the bind
        self.rebinds = 0
        self._launch(port or free_port())

    def _launch(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(self.log_dir, f"pdserve-{self.name}-{self.port}.log"), "a")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(self.extra_env or {}))
        self.router_key = env.get("PDSERVE_ROUTER_KEY")   # the test plays the router: it sends the key
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve", *self.args, "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        LIVE.add(self)

    def _lost_its_port(self) -> bool:
        """Exited because the port it was given had been taken between free_port() and its bind (on a
        loaded machine another test's server or a NIXL agent can take it): the test's race, not the server's."""
        with open(self.log.name, errors="replace") as f:
            return self.port_is_ours and "address already in use" in f.read()[-4000:]

    def wait_healthy(self, timeout: float = 240) -> "Process":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self.rebinds < 3 and self._lost_its_port():
                    self.rebinds += 1
                    self.log.close()
                    self._launch(free_port())
                    continue
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)  # a frozen test subject would not see the SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        LIVE.discard(self)

    def pids(self) -> list[int]:
        """The server's PID and its descendants' (the engine process holds the KV cache, NIXL and the
        side channel: a fault that hits "the instance" hits them all)."""
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        todo.extend(int(child) for child in f.read().split())
            except OSError:  # gone meanwhile
                pass
        return found

    def signal(self, sig: int) -> None:
        """Send sig to the server and each of its descendants, by PID (SIGKILL, SIGSTOP, SIGCONT)."""
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL:
            self.proc.wait()

    def restart(self) -> "Process":
        """The same command on the same port (a supervisor's restart); the old one must be gone."""
        self.stop()
        return Process(self.args, self.name, self.extra_env, self.log_dir, port=self.port)

    def health(self) -> int:
        """GET /health's status; 0 when nothing answers."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
            text = r.read().decode()
        values = {}
        for line in text.splitlines():
            m = re.match(r"pdserve:(\w+) ([-0-9.e+]+)$", line)
            if m:
                values[m.group(1)] = float(m.group(2))
        return values

    def post(self, path: str, body: dict, timeout: float = 120, *, as_router: bool = True) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if as_router and self.router_key is not None:
            headers["X-PDServe-Router-Key"] = self.router_key
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


ROUTER_KEY = "e2e-router-key"


# The model and device flags of every instance: on CPU the default model; the GPU fault matrix
# (benchmarks/gpu_fault_matrix.sh) replaces them with a GPU instance's through the environment.
INSTANCE_ARGS = shlex.split(os.environ.get(
    "PDSERVE_E2E_INSTANCE_ARGS", f"--model default --kv-cache-memory {128 << 20} --num-threads 1"))
# Stopped instances drain for 1 s, not 10: a P holding KV for a D that a test killed would otherwise wait
# out the whole drain at every stop. The drain's own tests pass their --drain-timeout after these.
INSTANCE_ARGS += ["--drain-timeout", "1"]
# The P/D transport the fault matrix runs over: nixl (DRAM on CPU, VRAM on a GPU) or cuda_ipc.
KV_CONNECTOR = os.environ.get("PDSERVE_E2E_KV_CONNECTOR", "nixl")


def serve(name: str, *extra: str, router_key: str | None = ROUTER_KEY) -> Process:
    """An instance that, like every instance `pdserve up` starts, takes KV params only with the router key."""
    return Process(["serve", *INSTANCE_ARGS, *extra], name,
                   env={"PDSERVE_ROUTER_KEY": router_key} if router_key else None)


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
