"""`pdserve up` stopped as users stop it: Ctrl-C at a terminal (SIGINT to the whole foreground process
group), also when it was started with SIGINT ignored (`pdserve up &` from a script), and killed outright
(its children must not outlive it). Found by a new-user check: the instances got the terminal's SIGINT
too, so `up`'s SIGTERM was their second signal and cut the streams in flight without the drain; `up`
started with SIGINT ignored ignored `kill -INT`; a killed `up` left its instances running."""
from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.cluster import free_port_run
from tests.e2e.test_server_shutdown import _events, long_stream


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                found += kids
                todo += kids
        except OSError:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"pdserve up exited with {proc.returncode}"
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError("the cluster did not become healthy")


def _lending_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("pdserve-cores-")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("how", ["ctrl-c", "ctrl-c, started with SIGINT ignored", "ctrl-c twice",
                                 "sigterm to every process", "sighup to every process"])
def test_the_cluster_drains_however_it_is_stopped(tmp_path, how):
    """Ctrl-C (SIGINT to the whole foreground group), also when `up` started with SIGINT ignored (as a
    shell leaves a background job) and pressed twice 0.2 s apart; systemd's stop (SIGTERM to every
    process of the service at once, the router included: aiohttp took the second as an abort)."""
    port = free_port_run(3)   # a 1P1D cluster: the router's port and the next two
    log = open(tmp_path / "up.log", "w")
    lending_before = _lending_files()
    # Its own session, so that the test can signal its whole group as a terminal does.
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--host", "127.0.0.1", "--port", str(port), "--drain-timeout", "2",
         "--kv-cache-memory", str(128 << 20)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if "ignored" in how else None)
    children: list[int] = []
    try:
        _wait_healthy(port, proc)
        children = _descendants(proc.pid)
        assert len(children) >= 3   # P, D, the router, and their engines
        resp = long_stream(port)
        if how.endswith("to every process"):   # systemd's stop; a closed terminal (SIGHUP) (review)
            for pid in [proc.pid, *children]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM if how.startswith("sigterm") else signal.SIGHUP)
        else:
            os.killpg(proc.pid, signal.SIGINT)   # Ctrl-C: the terminal signals the foreground group
            if how == "ctrl-c twice":
                time.sleep(0.2)
                os.killpg(proc.pid, signal.SIGINT)
        events = _events(resp)
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert errors and "shutting down" in errors[0]["error"]["message"], events[-3:]
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [c for c in children if _alive(c)]
        assert _lending_files() <= lending_before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for c in children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)
        log.close()


CHILD = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], "w").write("term"), sys.exit(0)))
open(sys.argv[1], "w").write("ready")
time.sleep(60)
"""

LAUNCHER = """
import sys, time
from pdserve.cluster.local import ChildProcesses
child = ChildProcesses().start([sys.executable, "-c", sys.argv[1], sys.argv[2]], name="child")
print(child.pid, flush=True)
time.sleep(60)
"""


def _ignores_sigint(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask >> (signal.SIGINT - 1) & 1)


def test_a_child_ignores_sigint_and_gets_sigterm_when_its_launcher_is_killed(tmp_path):
    marker = tmp_path / "term"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, CHILD, str(marker)], stdout=subprocess.PIPE,
                                text=True)
    child = None
    try:
        child = int(launcher.stdout.readline())
        assert _ignores_sigint(child) and os.getpgid(child) == os.getpgid(launcher.pid)   # job control intact
        deadline = time.monotonic() + 30
        while not (marker.exists() and marker.read_text() == "ready") and time.monotonic() < deadline:
            time.sleep(0.05)   # until the child's handler is set
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
        assert marker.read_text() == "term"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_up_refuses_ports_already_taken_before_it_starts_anything(capsys):
    """A second `up` on a running cluster's ports reported itself ready (the first cluster answered its
    /health) while its own instances failed to bind, five restarts each (review)."""
    import socket
    from pdserve import cli
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["up", "--host", "127.0.0.1", "--port", str(port - 1)]) == 2
    assert f"127.0.0.1:{port}: address already in use" in capsys.readouterr().err
