"""`pdserve up`: a local cluster (prefill, decode and colocated instances, the router) on 127.0.0.1.

Lifecycle:
  1. split this machine's devices among the instances: on CUDA one GPU each (round-robin when
     there are fewer GPUs), on CPU disjoint sets of cores, each engine pinned to its own cores
     with as many torch threads as cores (two engines sharing a core halve each other's speed);
     with more instances than cores, unpinned, each with its share of threads (at least one)
  2. start each instance as `pdserve serve --kv-role producer|consumer` and the proxy in front; a fresh
     router key (or $PDSERVE_ROUTER_KEY) goes to every child through the environment: the proxy sends
     it, the instances require it (as their API key too, so that with --host 0.0.0.0 a client cannot
     go around the proxy); the client's --api-key goes to the proxy only
  3. wait until every /health answers, then print the URL
  4. serve: an instance that dies is started again with backoff (the router ejects it meanwhile and
     re-admits it when healthy); the router dying, or an instance dying too often, ends the cluster
  5. on Ctrl-C or SIGTERM stop every child, newest first

split_cores and ChildProcesses are shared with `pdserve bench compare`, which starts several such
deployments in turn.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import IO, Mapping, Sequence

from pdserve.config import API_KEY_ENV, ROUTER_KEY_ENV, TP_KV_CONNECTORS
from pdserve.stop_signals import IGNORE_SIGINT_ENV, SAME_STOP_S, claim_sigint

HEALTH_TIMEOUT_S = 600
GPU_MEMORY_FRACTION = 0.9   # of one GPU, for the instances `up` puts on it together (serve's default alone)
STOP_TIMEOUT_S = 25.0   # an instance's drain (10 s by default) and its engine's stop (5 s), and some


def threads_per_instance(num_instances: int, cores: Sequence[int] | None = None) -> int:
    """torch threads for each of `num_instances` engines sharing `cores` (default: the allowed ones)."""
    num_cores = len(os.sched_getaffinity(0) if cores is None else cores)
    return max(1, num_cores // max(1, num_instances))


def split_cores(num_instances: int, cores: Sequence[int] | None = None,
                weights: Sequence[int] | None = None, use_all: bool = False) -> list[list[int] | None]:
    """Disjoint sets of `cores` (default: the cores this process may run on), one per instance, in
    proportion to `weights` (default equal; a tensor-parallel instance weighs its number of ranks);
    None for every instance when there are fewer cores than the weights add up to. The cores past an
    equal split are left out (`bench compare` wants equal devices) unless use_all: then they go one
    each to the single-rank instances, first ones first (3 cores, 2 instances: [0, 1] and [2], where
    an equal split left core 2 to nobody)."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    weights = list(weights) if weights is not None else [1] * num_instances
    if len(cores) < sum(weights):
        return [None] * num_instances  # more ranks than cores: let the OS share them
    per = len(cores) // sum(weights)
    sizes = [per * weight for weight in weights]
    single = [i for i, weight in enumerate(weights) if weight == 1]   # a TP rank's share stays whole
    for k in range(len(cores) - sum(sizes) if use_all and single else 0):
        sizes[single[k % len(single)]] += 1
    out, start = [], 0
    for size in sizes:
        out.append(cores[start:start + size])
        start += size
    return out


def tensor_parallel_size(args: Sequence[str]) -> int:
    """The --tensor-parallel-size (or -tp) in an instance's `serve` flags, the last one winning; 1 without."""
    size = 1
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in ("--tensor-parallel-size", "-tp"):
            text = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                size = int(text)
            except ValueError:
                raise ValueError(f"{flag}: expected an integer, got {text!r}") from None
            if size < 1:
                raise ValueError(f"{flag}: must be >= 1, got {size}")
    return size


def place_on_gpus(tp_sizes: Sequence[int], gpus: Sequence[int]) -> list[list[int]]:
    """Each instance's GPUs: as many consecutive ones of `gpus` as it has ranks, taken in turn, wrapping
    round (instances then share GPUs) when they need more than there are."""
    out, start = [], 0
    for size in tp_sizes:
        if gpus:
            if start + size > len(gpus):
                start = 0
            out.append(list(gpus[start:start + size]))
            start = (start + size) % len(gpus)
        else:
            out.append([])
    return out


def num_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


PR_SET_PDEATHSIG = 1
_LIBC = None


def _child_setup(parent_pid: int, die_with_parent: bool) -> None:
    """In each child, between fork and exec. SIGINT ignored from the start (the child's server keeps it so,
    IGNORE_SIGINT_ENV): a Ctrl-C at the terminal reaches the whole group, and the launcher stops each child
    with one SIGTERM, so that they drain; had they taken the SIGINT, the launcher's SIGTERM would have been
    their second signal, which stops at once. SIGTERM when the launcher dies, however it dies (SIGKILL too),
    so no instance outlives it unattended."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)   # a closed terminal: the launcher stops them (SIGTERM)
    if die_with_parent and _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:   # it died before the prctl: no signal will come
            os._exit(1)


def port_taken(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on (taken, or no such address), or None. Bound as aiohttp binds
    (SO_REUSEADDR), then let go: a check, not a reservation, so that a start fails at once and not only
    after a model has loaded."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot resolve the address: {e}"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as e:
                return "address already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
    return None


class ChildProcesses:
    """The children one launcher started; stop() ends each by its PID, newest first. Each child ignores
    SIGINT and gets SIGTERM if the launcher dies (_child_setup)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.names: dict[int, str] = {}  # pid → what error messages call the child

    def start(self, cmd: Sequence[str], *, name: str | None = None, env: Mapping[str, str] | None = None,
              stdout: IO | int | None = None, stderr: IO | int | None = None) -> subprocess.Popen:
        global _LIBC
        if _LIBC is None and sys.platform.startswith("linux"):
            # loaded here, before the fork: between fork and exec nothing may take a lock another thread held
            _LIBC = ctypes.CDLL(None, use_errno=True)
        # The parent-death signal follows the thread that forked, not the process: only the main thread's
        # children get it (a worker thread that ends would take its children with it).
        main = threading.current_thread() is threading.main_thread()
        parent = os.getpid()
        proc = subprocess.Popen(list(cmd), env={**(os.environ if env is None else env), IGNORE_SIGINT_ENV: "1"},
                                stdout=stdout, stderr=stderr, preexec_fn=lambda: _child_setup(parent, main))
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
        `timeout` s of waiting for it. A Ctrl-C or SIGTERM meanwhile (in the main thread) does not cut this
        short, which would leave the children to the parent-death signal: within SAME_STOP_S of the start
        it is the same stop, later it sends each child a second SIGTERM (stop at once, without the drain)."""
        def again(*_: object) -> None:
            if time.monotonic() - started > SAME_STOP_S:
                self._signal_all(signal.SIGTERM)
        started = time.monotonic()
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, again) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._signal_all(signal.SIGTERM)
            for p in reversed(self.procs):
                try:
                    p.wait(timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _signal_all(self, sig: int) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)


ROLE_NAMES = {"producer": "prefill", "consumer": "decode", "colocated": "colocated"}
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)   # after the 1st, 2nd, ... death in a row
MAX_RESTARTS = 5          # deaths within RESTART_WINDOW_S before `up` gives up on the cluster
RESTART_WINDOW_S = 600.0


def instance_command(role: str, index: int, port: int, *, model: str, host: str, serve_args: Sequence[str],
                     role_args: Sequence[str], kv_connector: str, kv_transfer_config: str | None,
                     cores: Sequence[int] | None, num_threads: int | None = None,
                     gpu_memory_utilization: float | None = None, kv_store: str | None = None,
                     tp_size: int = 1, core_lending: str | None = None) -> list[str]:
    """`pdserve serve` for one instance: the shared flags, then the role's own (later flags win, so
    --prefill-args / --decode-args override what every instance gets). role: producer, consumer or
    colocated (no KV handoff: it prefills and decodes its requests itself; with the store connector it
    still inserts and loads prompts there, kv-role both)."""
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", model, "--host", host, "--port", str(port)]
    if role != "colocated" or kv_store:
        cmd += ["--kv-connector", kv_connector, "--kv-role", "both" if role == "colocated" else role]
        if kv_store:
            cmd += ["--kv-store", kv_store]
        if kv_transfer_config:
            cmd += ["--kv-transfer-config", kv_transfer_config]
    cmd += ["--engine-id", f"{ROLE_NAMES[role]}-{index}", *serve_args]
    # --num-threads (and num_threads here) is per tensor-parallel rank: each rank gets its share of the cores.
    if cores:
        cmd += ["--cpu-cores", ",".join(map(str, cores)), "--num-threads", str(max(1, len(cores) // tp_size))]
        if core_lending and tp_size == 1:   # a TP instance's ranks keep their own cores
            cmd += ["--cpu-core-lending", core_lending]
    elif num_threads:
        cmd += ["--num-threads", str(num_threads)]
    if gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", f"{gpu_memory_utilization:.3f}"]
    return cmd + list(role_args)


class Supervisor:
    """After start-up: an instance that dies is started again (with backoff), and the router re-admits it
    once its /health answers; the cluster serves on with the others meanwhile. An instance that dies
    MAX_RESTARTS times within RESTART_WINDOW_S, or the router itself dying, ends the cluster."""

    def __init__(self, children: "ChildProcesses", commands: dict[int, tuple[str, list[str], dict]]) -> None:
        self.children = children
        self.commands = commands            # pid → (name, argv, env) of each instance
        self.deaths: dict[str, list[float]] = {}
        self.pending: list[tuple[float, str, list[str], dict]] = []   # (when, name, argv, env) to restart

    def check(self, now: float) -> str | None:
        """Restart what is due; None while the cluster can go on, else why it cannot."""
        for proc in list(self.children.procs):
            if proc.poll() is None:
                continue
            self.children.procs.remove(proc)
            if proc.pid not in self.commands:
                return f"{self.children.names.get(proc.pid, 'the router')} exited (code {proc.returncode})"
            name, argv, env = self.commands.pop(proc.pid)
            deaths = [t for t in self.deaths.get(name, []) if now - t < RESTART_WINDOW_S] + [now]
            self.deaths[name] = deaths
            if len(deaths) > MAX_RESTARTS:
                return f"{name} exited {len(deaths)} times within {RESTART_WINDOW_S:.0f} s (last code {proc.returncode})"
            delay = RESTART_BACKOFF_S[min(len(deaths), len(RESTART_BACKOFF_S)) - 1]
            print(f"pdserve up: {name} exited (code {proc.returncode}); restarting it in {delay:g} s",
                  file=sys.stderr, flush=True)
            self.pending.append((now + delay, name, argv, env))
        for item in [p for p in self.pending if p[0] <= now]:
            self.pending.remove(item)
            _, name, argv, env = item
            proc = self.children.start(argv, name=name, env=env)
            self.commands[proc.pid] = (name, argv, env)
        return None


def wait_listening(children: "ChildProcesses", host: str, port: int, timeout: float) -> None:
    """Until host:port accepts a TCP connection; RuntimeError when a child exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        dead = children.first_dead()
        if dead is not None:
            raise RuntimeError(f"{children.names[dead.pid]} exited with code {dead.returncode}")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on {host}:{port} after {timeout:.0f} s") from None
            time.sleep(0.2)


def parse_gpus(spec: str | None) -> list[int] | None:
    """--gpus 0,2,3 → [0, 2, 3]; None: every GPU torch sees."""
    if spec is None:
        return None
    try:
        gpus = [int(g) for g in spec.split(",") if g.strip()]
    except ValueError:
        raise ValueError(f"--gpus: a comma-separated list of GPU indices, got {spec!r}") from None
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus: distinct non-negative GPU indices, got {spec!r}")
    return gpus


def run_cluster(*, model: str, num_prefill: int, num_decode: int, host: str, port: int,
                serve_args: list[str], kv_transfer_config: str | None, device: str,
                kv_connector: str = "nixl", prefill_args: Sequence[str] = (),
                decode_args: Sequence[str] = (), api_key: str | None = None, num_colocated: int = 0,
                colocated_args: Sequence[str] = (), gpus: Sequence[int] | None = None,
                proxy_args: Sequence[str] = (), kv_store_capacity: str = "1GiB", core_lending: bool = True) -> int:
    if min(num_prefill, num_decode, num_colocated) < 0:
        print("pdserve up: --num-prefill, --num-decode and --num-colocated must be >= 0", file=sys.stderr)
        return 2
    if num_colocated == 0 and (num_prefill == 0 or num_decode == 0):
        print("pdserve up: P/D needs --num-prefill >= 1 and --num-decode >= 1 (or give --num-colocated)",
              file=sys.stderr)
        return 2
    if num_prefill + num_decode and not (num_prefill and num_decode):
        print("pdserve up: prefill instances need decode instances and the reverse", file=sys.stderr)
        return 2
    instances = ([("producer", i) for i in range(num_prefill)] + [("consumer", i) for i in range(num_decode)]
                 + [("colocated", i) for i in range(num_colocated)])
    role_args = {"producer": prefill_args, "consumer": decode_args, "colocated": colocated_args}
    try:
        tp_sizes = [tensor_parallel_size([*serve_args, *role_args[role]]) for role, _ in instances]
    except ValueError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    handing_over = [t for (role, _), t in zip(instances, tp_sizes) if role != "colocated" or kv_connector == "store"]
    if kv_connector not in TP_KV_CONNECTORS and any(t > 1 for t in handing_over):
        print(f"pdserve up: --tensor-parallel-size > 1 with --kv-connector {kv_connector} is for colocated "
              f"instances only for now ({', '.join(TP_KV_CONNECTORS)} hands over a tensor-parallel instance's KV)",
              file=sys.stderr)
        return 2
    if handing_over and kv_connector != "store" and any(max(a, b) % min(a, b) for a in handing_over
                                                        for b in handing_over):   # (the store: any sizes)
        print(f"pdserve up: prefill and decode instances of --tensor-parallel-size {sorted(set(handing_over))}: "
              f"of two sizes one must divide the other (a D rank's KV heads come from whole P ranks)",
              file=sys.stderr)
        return 2
    # Every port first: a cluster already on them answers /health, and this one would report itself
    # ready while its own instances failed to bind (review).
    ports = list(range(port, port + 1 + len(instances) + (kv_connector == "store")))
    if ports[-1] > 65535:
        print(f"pdserve up: the cluster takes ports {ports[0]}-{ports[-1]} (the router's, then one per instance"
              f"{' and the KV store' if kv_connector == 'store' else ''}), past 65535: lower --port", file=sys.stderr)
        return 2
    for p in ports:
        if (why := port_taken(host, p)) is not None:
            print(f"pdserve up: {host}:{p}: {why} (the cluster takes ports {ports[0]}-{ports[-1]}: the router's, "
                  f"then one per instance{' and the KV store' if kv_connector == 'store' else ''}; --port moves "
                  f"them)", file=sys.stderr)
            return 2
    use_cuda = device == "cuda" or (device == "auto" and (gpus is not None or num_gpus() > 0))
    cores = [None] * len(instances) if use_cuda else split_cores(len(instances), weights=tp_sizes, use_all=True)
    # More ranks than cores: the OS shares the cores, and each engine gets its share of threads.
    threads = None if use_cuda or cores[0] is not None else threads_per_instance(sum(tp_sizes))
    cuda_devices = (list(gpus) if gpus is not None else list(range(num_gpus()))) if use_cuda else []
    if cuda_devices and max(tp_sizes) > len(cuda_devices):
        print(f"pdserve up: an instance with --tensor-parallel-size {max(tp_sizes)} needs as many GPUs, "
              f"{len(cuda_devices)} listed", file=sys.stderr)
        return 2
    # Disjoint cores, lent step by step to whichever instance is busy (worker/core_lending.py).
    lending_file = None
    lenders = sum(t == 1 for t in tp_sizes)
    if core_lending and cores[0] is not None and lenders > 1:
        # here, not at the top: what imports pdserve.cluster (bench compare) stays off the engine's modules
        from pdserve.worker.core_lending import MAX_CORES, MAX_SLOTS, create_group_file
        top_core = max(c for cs in cores for c in cs)
        if lenders > MAX_SLOTS or top_core >= MAX_CORES:
            print(f"pdserve up: no core lending for {lenders} instances on cores up to {top_core} (it takes "
                  f"{MAX_SLOTS} and cores below {MAX_CORES})", file=sys.stderr)
        else:
            lending_file = create_group_file()
    gpu_sets = place_on_gpus(tp_sizes, cuda_devices)
    children = ChildProcesses()

    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:   # not under nohup
        # the terminal closed: stop as on SIGTERM (the children ignore SIGHUP), so they drain
        signal.signal(signal.SIGHUP, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    # Also when started with SIGINT ignored (`pdserve up &` from a script): `kill -INT` stops it as Ctrl-C
    # does, as it stops `pdserve serve`; unless its own launcher stops it (stop_signals.py).
    claim_sigint()
    router_key = os.environ.get(ROUTER_KEY_ENV) or secrets.token_urlsafe(32)
    instance_env = {**os.environ, ROUTER_KEY_ENV: router_key, API_KEY_ENV: router_key}
    proxy_env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    proxy_env[ROUTER_KEY_ENV] = router_key
    if api_key is not None:
        proxy_env[API_KEY_ENV] = api_key
    urls: dict[str, list[str]] = {"producer": [], "consumer": [], "colocated": []}
    commands: dict[int, tuple[str, list[str], dict]] = {}
    kv_store = None
    try:
        if kv_connector == "store":   # the pool first (restarted like an instance: it is a cache)
            store_port = port + 1 + len(instances)
            kv_store = f"{host}:{store_port}"
            cmd = [sys.executable, "-m", "pdserve", "kv-store", "--host", host, "--port", str(store_port),
                   "--capacity", kv_store_capacity]
            proc = children.start(cmd, name="kv-store", env=instance_env)
            commands[proc.pid] = ("kv-store", cmd, instance_env)
            wait_listening(children, host, store_port, 60)
        for n, (role, i) in enumerate(instances):
            inst_port = port + 1 + n
            env = dict(instance_env)
            fraction = None
            if cuda_devices:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_sets[n]))
                sharing = max(sum(g in other for other in gpu_sets) for g in gpu_sets[n])
                if sharing > 1:   # each its part of the default fraction; a role's own flag (later) wins
                    fraction = GPU_MEMORY_FRACTION / sharing
            cmd = instance_command(role, i, inst_port, model=model, host=host, serve_args=serve_args,
                                   role_args=role_args[role], kv_connector=kv_connector,
                                   kv_transfer_config=kv_transfer_config, cores=cores[n], num_threads=threads,
                                   gpu_memory_utilization=fraction, kv_store=kv_store, tp_size=tp_sizes[n],
                                   core_lending=lending_file)
            name = f"{ROLE_NAMES[role]}-{i}"
            proc = children.start(cmd, name=name, env=env)
            commands[proc.pid] = (name, cmd, env)
            urls[role].append(f"http://{host}:{inst_port}")
        children.wait_healthy([u for role_urls in urls.values() for u in role_urls], HEALTH_TIMEOUT_S)
        proxy_cmd = [sys.executable, "-m", "pdserve", "proxy", "--host", host, "--port", str(port),
                     "--model", model]
        for flag, role in (("--prefill", "producer"), ("--decode", "consumer"), ("--colocated", "colocated")):
            if urls[role]:
                proxy_cmd += [flag, *urls[role]]
        children.start(proxy_cmd + list(proxy_args), name="the router", env=proxy_env)
        url = f"http://{host}:{port}"
        children.wait_healthy([url], 60)
        served = next((a for f, a in zip(serve_args, serve_args[1:]) if f == "--served-model-name"), model)
        auth_header = '-H "Authorization: Bearer $KEY" ' if api_key else ""
        pools = "; ".join(f"{ROLE_NAMES[role]}: {' '.join(u)}" for role, u in urls.items() if u)
        pools += f"; kv-store: {kv_store}" if kv_store else ""
        print(f"pdserve cluster ready: {url}/v1  ({pools}). `pdserve status {url}` shows it; Ctrl-C stops "
              f"it.\nTry:\n"
              f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
              f"{auth_header}-d "
              f"'{{\"model\": \"{served}\", \"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"What is the capital of France?\"}}], \"max_tokens\": 32}}'", flush=True)
        supervisor = Supervisor(children, commands)
        while (reason := supervisor.check(time.monotonic())) is None:
            time.sleep(0.5)
        print(f"pdserve up: {reason}; stopping the cluster", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 1
    finally:
        try:
            children.stop()
        finally:
            if lending_file is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lending_file)
