"""pdserve's pools on a Ray cluster: `pdserve up --ray`, `pdserve scale` (docs/ray.md).

Three kinds of actor, all in the "pdserve" namespace:
- InstanceActor: one P, D or colocated instance. Its placement group holds the instance's CPUs (or GPUs)
  on one node; the actor starts `pdserve serve` there as a child process on the node's address (the
  engine in its own process, as with `pdserve up`), and the child dies with the actor (PR_SET_PDEATHSIG),
  so a killed actor never leaves a server behind.
- RouterActor: the router (router/proxy.py) on the head node's port, its pools followed through
  `Proxy.set_members` instead of URL lists.
- Controller (named "pdserve-controller"): the registry and the supervisor. It holds the wanted size of
  each pool; every tick it checks each instance, starts what is missing, drains what is too many, replaces
  what died, and pushes the list of serving instances to the router. An instance leaves the router's list
  first, and is told to drain (SIGTERM: serve finishes its requests, --drain-timeout) only once the router
  has acknowledged it: no request is sent to an instance that is stopping.

The controller is owned by the `pdserve up --ray` process, and the other actors by the controller: when
that process ends, Ray ends every actor, and every server with its actor.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from pdserve.cluster.autoscale import AutoscaleConfig, Autoscaler
from pdserve.cluster.local import RESTART_BACKOFF_S, ROLE_NAMES, STOP_TIMEOUT_S, instance_command
from pdserve.config import API_KEY_ENV, ROUTER_KEY_ENV

logger = logging.getLogger(__name__)

NAMESPACE = "pdserve"
CONTROLLER_NAME = "pdserve-controller"
TICK_S = 0.5                 # the controller's supervision period
STATUS_TIMEOUT_S = 5.0       # an instance actor that answers no status for this long is taken for dead
START_TIMEOUT_S = 600.0      # from placement to a healthy /health (a large model loads for minutes)
ROUTER_ACK_TIMEOUT_S = 10.0  # the router's acknowledgement of a new member list
MAX_POOL_SIZE = 1024         # instances one pool may be asked for (a typo must not start millions)
MAX_STARTS_PER_TICK = 16     # placement groups asked for per tick: the controller stays responsive
PLACEMENT_WARN_S = 10.0      # an instance not placed by then is reported as waiting for resources
UNHEALTHY_REPLACE_S = 60.0   # a serving instance whose /health fails this long (hung) is replaced
ROUTER_START_TIMEOUT_S = 300.0   # placing the router actor and loading its tokenizer
ROUTER_CHECK_S = 2.0         # the list is pushed this often even unchanged: a dead router is restarted
POOL_ROLES = ("prefill", "decode", "colocated")
KV_ROLES = {"prefill": "producer", "decode": "consumer", "colocated": "colocated"}
PR_SET_PDEATHSIG = 1


def require_ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("Ray is not installed: pip install 'pdserve[ray]' (scripts/install.sh does)") from None
    return ray


@dataclass
class PoolSpec:
    """Everything the controller needs to start instances and the router; plain data (it travels to the
    controller's process)."""
    model: str
    serve_args: list[str]
    role_args: dict[str, list[str]]          # pool → its own serve flags (override the shared ones)
    kv_connector: str = "nixl"
    kv_transfer_config: str | None = None
    cpus_per_instance: float = 1.0
    device: str = "auto"                     # auto: GPUs when the Ray cluster has any
    tp_sizes: dict[str, int] = field(default_factory=dict)   # pool → tensor-parallel ranks (default 1)
    use_gpus: bool = False                   # set on connecting (device auto: GPUs when the cluster has any)
    extra_resources: dict[str, dict[str, float]] = field(default_factory=dict)   # pool → resources
    instance_host: str | None = None         # None: each instance's node address (Ray's view of the node)
    router_host: str = "127.0.0.1"
    router_port: int = 8000
    router_kwargs: dict[str, Any] = field(default_factory=dict)   # build_proxy_app's keyword arguments
    router_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    drain_timeout: float = 10.0
    autoscale: AutoscaleConfig | None = None  # None: the sizes change only by `pdserve scale`
    autoscale_interval_s: float = 5.0


# --- the instance ---------------------------------------------------------------------------------------

_LIBC = None


def _die_with_parent() -> None:
    """In the child, between fork and exec: SIGKILL when the actor that started it dies. Not SIGTERM: a
    hung server could outlive its actor, and its GPU or port would be taken when a replacement lands there
    (a drain is the controller's to ask for, with SIGTERM, before it lets an actor go)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class InstanceActor:
    """One instance's server process on this actor's node. Every method returns at once (the controller
    polls), so the actor's one thread is the one that started the child: PR_SET_PDEATHSIG follows the
    thread that forked."""

    def __init__(self, name: str, role: str, index: int, spec: PoolSpec) -> None:
        self.name, self.role, self.index, self.spec = name, role, index, spec
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self) -> dict:
        ray = require_ray()
        spec = self.spec
        host = spec.instance_host or ray.util.get_node_ip_address()
        port = free_port(host)
        tp = spec.tp_sizes.get(self.role, 1)
        cmd = instance_command(KV_ROLES[self.role], self.index, port, model=spec.model, host=host,
                               serve_args=[*spec.serve_args, "--drain-timeout", str(spec.drain_timeout)],
                               role_args=spec.role_args.get(self.role, []), kv_connector=spec.kv_connector,
                               kv_transfer_config=spec.kv_transfer_config, cores=None,
                               num_threads=None if spec.use_gpus else max(1, int(spec.cpus_per_instance) // tp),
                               tp_size=tp)
        cmd[cmd.index("--engine-id") + 1] = self.name   # unique over the cluster's life, replacements too
        env = {**os.environ, ROUTER_KEY_ENV: spec.router_key, API_KEY_ENV: spec.router_key}
        global _LIBC
        # Loaded before the fork: between fork and exec nothing may take a lock another thread held.
        _LIBC = _LIBC or ctypes.CDLL("libc.so.6", use_errno=True)
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
        self.url = f"http://{host}:{port}"
        return {"url": self.url, "node": ray.get_runtime_context().get_node_id(), "pid": self.proc.pid}

    def status(self) -> dict:
        """{"returncode": None while running, "healthy": its /health answered 200}."""
        if self.proc is None:
            return {"returncode": None, "healthy": False}
        returncode = self.proc.poll()
        healthy = False
        if returncode is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0) as resp:
                    healthy = resp.status == 200
            except OSError:
                pass
        return {"returncode": returncode, "healthy": healthy}

    def drain(self, timeout: float) -> int | None:
        """SIGTERM (serve finishes what it serves, then exits), SIGKILL after `timeout` s; the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# --- the router -----------------------------------------------------------------------------------------

class RouterActor:
    """The router's HTTP server on this actor's event loop (an async actor: set_members runs on the same
    loop as the requests, so a member list is applied between two of them, never during one)."""

    def __init__(self) -> None:
        self.runner = None
        self.proxy = None

    async def start(self, host: str, port: int, kwargs: dict, model: str | None) -> str:
        from aiohttp import web

        from pdserve.http_guard import runner_args
        from pdserve.router.proxy import PROXY_KEY, build_proxy_app
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        tokenizer = None
        if model is not None:
            from pdserve.model.loader import load_tokenizer
            tokenizer = load_tokenizer(model)
        app = build_proxy_app([], [], [], dynamic=True, tokenizer=tokenizer, **kwargs)
        self.runner = web.AppRunner(app, access_log=None, **runner_args())
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port).start()
        self.proxy = app[PROXY_KEY]
        return f"http://{host}:{port}"

    async def set_members(self, members: list[tuple[str, str, str]]) -> tuple[list[str], list[str]]:
        return self.proxy.set_members(members)

    async def in_flight(self, names: list[str]) -> dict[str, int]:
        """Hops still open on instances that left the list (their drain waits for these)."""
        return {name: self.proxy.num_in_flight_on(name) for name in names}

    async def cluster_status(self) -> dict:
        """GET /cluster's instances and counters (what the autoscaler reads)."""
        return self.proxy.router.cluster_status()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


# --- the controller -------------------------------------------------------------------------------------

STARTING, SERVING, DRAINING = "starting", "serving", "draining"


@dataclass
class Member:
    name: str
    role: str
    actor: Any
    placement_group: Any
    started: float
    state: str = STARTING
    start_ref: Any = None          # InstanceActor.start, until it answered
    status_ref: Any = None         # the status call in flight
    status_since: float = 0.0
    drain_ref: Any = None
    drain_deadline: float = 0.0        # an actor that has not answered its drain by then is killed
    drain_after: float | None = None   # the router's hops on it may end until then; SIGTERM at the latest then
    warned: bool = False               # said it waits for resources
    unhealthy_since: float | None = None
    url: str | None = None
    node: str | None = None
    pid: int | None = None


class Controller:
    """The pools' wanted sizes and what runs; see the module's docstring."""

    def __init__(self, spec: PoolSpec) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.spec = spec
        self.wanted = dict.fromkeys(POOL_ROLES, 0)
        self.members: dict[str, Member] = {}
        self.counter = itertools.count()
        self.lock = threading.RLock()          # the members and the router: ticks, set_autoscale, stop
        self.scale_lock = threading.Lock()     # the wanted sizes
        self.router = None
        self.router_url: str | None = None
        self.pushed: list[tuple[str, str, str]] | None = None
        self.last_push = 0.0
        self.router_start_ref = None   # a new router actor starting (the old one died) ...
        self.router_start_deadline = 0.0   # ... killed and started again if it does not serve by then
        self.deaths: dict[str, list[float]] = {role: [] for role in POOL_ROLES}
        self.not_before = dict.fromkeys(POOL_ROLES, 0.0)   # restart backoff per pool
        self.events: list[str] = []    # what happened, newest last (status shows the tail)
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.autoscaler = Autoscaler(spec.autoscale) if spec.autoscale is not None else None
        self.next_decision = 0.0

    def start(self, num_prefill: int, num_decode: int, num_colocated: int) -> str:
        """The router on the head node, then the pools; returns the router's URL at once (instances join
        it as they become healthy)."""
        self.start_router()
        self.scale(num_prefill, num_decode, num_colocated)
        self.thread = threading.Thread(target=self.run, name="pdserve-controller", daemon=True)
        self.thread.start()
        return self.router_url

    def start_router(self) -> None:
        """The router actor on the head node, serving once this returns (at start-up)."""
        ray = require_ray()
        self.restart_router()
        self.router_url = ray.get(self.router_start_ref, timeout=ROUTER_START_TIMEOUT_S)
        self.router_start_ref = None

    def restart_router(self) -> None:
        """A new router actor, starting in the background (the ticks go on: the controller stays
        responsive while it loads its tokenizer); it gets the list once it serves."""
        ray = require_ray()
        spec = self.spec
        self.router = remote_class(ray, RouterActor).options(
            num_cpus=0, resources={"node:__internal_head__": 0.001}, name="pdserve-router", namespace=NAMESPACE).remote()
        self.router_start_ref = self.router.start.remote(spec.router_host, spec.router_port, spec.router_kwargs,
                                                         spec.model)
        self.router_start_deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        self.pushed = None   # a new router knows no instance

    def check_router(self) -> None:
        ray = require_ray()
        if self.router_start_ref is None:
            return
        done, _ = ray.wait([self.router_start_ref], timeout=0)
        if not done and time.monotonic() < self.router_start_deadline:
            return
        try:
            if not done:
                raise TimeoutError(f"not serving within {ROUTER_START_TIMEOUT_S:.0f} s")
            self.router_url = ray.get(self.router_start_ref)
            self.log(f"router serving again at {self.router_url}")
        except Exception as e:   # e.g. its port not free yet
            self.log(f"the new router did not start ({type(e).__name__}: {e}); trying again")
            try:
                ray.kill(self.router, no_restart=True)
            except Exception:
                pass
            self.restart_router()
            return
        self.router_start_ref = None

    def scale(self, num_prefill: int | None = None, num_decode: int | None = None,
              num_colocated: int | None = None) -> dict:
        """New wanted sizes (None: unchanged); the ticks converge to them. ValueError on a size that cannot
        serve (P without D, or nothing that decodes)."""
        with self.scale_lock:   # not self.lock: a tick may hold that for seconds
            if self.stopping:
                raise ValueError("the cluster is stopping")
            wanted = dict(self.wanted)
            for role, n in (("prefill", num_prefill), ("decode", num_decode), ("colocated", num_colocated)):
                if n is not None:
                    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_POOL_SIZE:
                        raise ValueError(f"--{role}: a count from 0 to {MAX_POOL_SIZE}, got {n!r}")
                    wanted[role] = n
            if wanted["prefill"] and not wanted["decode"]:
                raise ValueError("prefill instances need decode instances to hand their KV to")
            if not (wanted["decode"] or wanted["colocated"]):
                raise ValueError("the cluster needs decode or colocated instances")
            if wanted != self.wanted:
                self.log(f"scale to {wanted['prefill']}P {wanted['decode']}D {wanted['colocated']} colocated")
            self.wanted = wanted   # one assignment: a tick sees the old sizes or the new, never a mix
            return dict(wanted)

    def set_autoscale(self, config: AutoscaleConfig | None, interval_s: float | None = None) -> None:
        """Turn the autoscaler on (with a fresh history) or off (None) on a running cluster."""
        with self.lock:
            self.autoscaler = Autoscaler(config) if config is not None else None
            if interval_s is not None:
                self.spec.autoscale_interval_s = interval_s
            self.next_decision = 0.0
            self.log(f"autoscale {'on' if config is not None else 'off'}")

    def status(self) -> dict:
        # No self.lock: a tick may hold it for seconds (it waits on the router); list() of a dict's values
        # is one step under the GIL, so this is a consistent snapshot.
        members = list(self.members.values())
        autoscale = None
        if (scaler := self.autoscaler) is not None:
            autoscale = {"decisions": dict(scaler.counts), "pressure": dict(scaler.last_pressure)}
        return {"router": self.router_url, "wanted": dict(self.wanted), "autoscale": autoscale,
                "instances": [{"name": m.name, "role": m.role, "state": m.state, "url": m.url, "node": m.node,
                               "pid": m.pid} for m in members],
                "events": list(self.events[-50:])}

    def serving_list(self) -> list[tuple[str, str, str]]:
        return sorted((m.name, m.url, m.role) for m in list(self.members.values()) if m.state == SERVING)

    def ready(self) -> bool:
        """Every pool at its wanted size with every instance serving, nothing draining, and the router
        serving all of them. (No self.lock, as status.)"""
        members, wanted = list(self.members.values()), self.wanted
        for role in POOL_ROLES:
            pool = [m for m in members if m.role == role]
            if len(pool) != wanted[role] or any(m.state != SERVING for m in pool):
                return False
        return self.router_start_ref is None and self.pushed == self.serving_list()

    def settled(self) -> bool:
        """No instance placed and starting, none draining: the figures the autoscaler reads are the pools'
        own (one waiting for resources does not count: it would freeze the autoscaler)."""
        return not any(m.state == DRAINING or (m.state == STARTING and m.start_ref is None)
                       for m in list(self.members.values()))

    def log(self, event: str) -> None:
        logger.info(event)
        self.events.append(f"{time.strftime('%H:%M:%S')} {event}")
        del self.events[:-200]

    # --- the ticks ----------------------------------------------------------------------------------------

    def run(self) -> None:
        while not self.stopping:
            try:
                with self.lock:
                    self.tick(time.monotonic())
            except Exception:   # one bad tick must not end supervision
                logger.exception("controller tick failed")
            time.sleep(TICK_S)

    def tick(self, now: float) -> None:
        self.check_router()
        self.check_starting(now)
        self.check_serving(now)
        self.autoscale(now)
        self.converge(now)
        self.push_members()
        self.check_draining(now)

    def autoscale(self, now: float) -> None:
        if self.autoscaler is None or now < self.next_decision or self.router is None:
            return
        self.next_decision = now + self.spec.autoscale_interval_s
        ray = require_ray()
        try:
            status = ray.get(self.router.cluster_status.remote(), timeout=5.0)
        except Exception as e:
            self.log(f"autoscale: no cluster status from the router: {type(e).__name__}")
            return
        decision = self.autoscaler.decide(status, self.wanted, self.settled(), now)
        if decision is not None:
            self.log(f"autoscale: {decision.reason}")
            self.scale(decision.prefill, decision.decode)

    def check_starting(self, now: float) -> None:
        ray = require_ray()
        for m in [m for m in self.members.values() if m.state == STARTING]:
            if m.start_ref is not None:
                done, _ = ray.wait([m.start_ref], timeout=0)
                if not done:
                    # Not placed yet: it waits for the resources (a node may join), and says so once.
                    if not m.warned and now - m.started > PLACEMENT_WARN_S:
                        m.warned = True
                        free = ray.available_resources()
                        self.log(f"{m.name} waits for resources {self.bundle(m.role)}; the cluster has "
                                 f"{ {k: v for k, v in free.items() if k in self.bundle(m.role)} } free "
                                 f"(add a node, or scale down)")
                    continue
                try:
                    info = ray.get(m.start_ref)
                except Exception as e:
                    self.lost(m, now, f"could not start: {type(e).__name__}: {e}")
                    continue
                m.start_ref, m.url, m.node, m.pid = None, info["url"], info["node"], info["pid"]
                m.started = now   # the start-up timeout counts from here: waiting for resources is no failure
            status = self.poll_status(m, now)
            if status is None:
                continue
            if status.get("returncode") is not None:
                self.lost(m, now, f"exited during start-up (code {status['returncode']})")
            elif status.get("healthy"):
                m.state = SERVING
                self.log(f"{m.name} serving at {m.url} (node {m.node[:8]})")
            elif now - m.started > START_TIMEOUT_S:
                self.lost(m, now, f"not healthy within {START_TIMEOUT_S:.0f} s")

    def check_serving(self, now: float) -> None:
        for m in [m for m in self.members.values() if m.state == SERVING]:
            status = self.poll_status(m, now)
            if status is None:
                continue
            if status.get("returncode") is not None:
                self.lost(m, now, f"exited (code {status['returncode']})")
            elif status.get("healthy"):
                m.unhealthy_since = None
            elif m.unhealthy_since is None:
                m.unhealthy_since = now
            elif now - m.unhealthy_since > UNHEALTHY_REPLACE_S:   # hung: the router ejected it long ago
                self.lost(m, now, f"unhealthy for {UNHEALTHY_REPLACE_S:.0f} s")

    def poll_status(self, m: Member, now: float) -> dict | None:
        """The instance's status when its call has answered (a new one is sent); None while it is pending.
        A dead actor answers {"returncode": "actor died: ..."}, one silent for STATUS_TIMEOUT_S unhealthy."""
        ray = require_ray()
        if m.status_ref is None:
            m.status_ref, m.status_since = m.actor.status.remote(), now
            return None
        done, _ = ray.wait([m.status_ref], timeout=0)
        if not done:
            # Silent (a starved node, a hung actor): unhealthy, replaced if it lasts (UNHEALTHY_REPLACE_S);
            # only an answer that the actor is gone is a death.
            return {"returncode": None, "healthy": False} if now - m.status_since > STATUS_TIMEOUT_S else None
        try:
            status = ray.get(m.status_ref)
        except Exception as e:   # RayActorError: the actor (or its node) died
            return {"returncode": f"actor died: {type(e).__name__}"}
        m.status_ref, m.status_since = m.actor.status.remote(), now
        return status

    def lost(self, m: Member, now: float, why: str) -> None:
        """An instance that died or never started: out of the router's list at the next push, its actor and
        resources freed; the pool's size is restored after a backoff."""
        self.log(f"{m.name} lost: {why}")
        self.release(m)
        deaths = [t for t in self.deaths[m.role] if now - t < 600.0] + [now]
        self.deaths[m.role] = deaths
        self.not_before[m.role] = now + RESTART_BACKOFF_S[min(len(deaths), len(RESTART_BACKOFF_S)) - 1]

    def release(self, m: Member) -> None:
        ray = require_ray()
        from ray.util.placement_group import remove_placement_group
        self.members.pop(m.name, None)
        try:
            ray.kill(m.actor, no_restart=True)   # its server gets SIGTERM from PR_SET_PDEATHSIG
        except Exception:
            pass
        try:
            remove_placement_group(m.placement_group)
        except Exception:
            pass

    def converge(self, now: float) -> None:
        for role in POOL_ROLES:
            live = [m for m in self.members.values() if m.role == role and m.state != DRAINING]
            if len(live) < self.wanted[role] and now >= self.not_before[role]:
                for _ in range(min(self.wanted[role] - len(live), MAX_STARTS_PER_TICK)):
                    self.add(role, now)
            # Too many: those not serving yet go first, then the newest (the oldest hold the warmest caches).
            for m in sorted(live, key=lambda m: (m.state == SERVING, -m.started))[:max(0, len(live) - self.wanted[role])]:
                if m.state == STARTING:   # never served: nothing to drain
                    self.log(f"{m.name} stopped before it served")
                    self.release(m)
                else:
                    m.state = DRAINING    # leaves the router's list at this tick's push, drains after it
                    self.log(f"{m.name} draining")

    def bundle(self, role: str) -> dict[str, float]:
        spec = self.spec
        bundle = {"CPU": spec.cpus_per_instance}
        if spec.use_gpus:
            bundle["GPU"] = float(spec.tp_sizes.get(role, 1))
        bundle.update(spec.extra_resources.get(role, {}))
        return bundle

    def add(self, role: str, now: float) -> None:
        ray = require_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        index = next(self.counter)
        name = f"{ROLE_NAMES[KV_ROLES[role]]}-{index}"
        bundle = self.bundle(role)
        pg = placement_group([bundle], strategy="STRICT_PACK")   # one bundle: the instance on one node
        options = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0),
                   "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                   "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
                   "name": f"pdserve-{name}", "namespace": NAMESPACE}
        actor = remote_class(ray, InstanceActor).options(**options).remote(name, role, index, self.spec)
        m = Member(name, role, actor, pg, now)
        m.start_ref = actor.start.remote()
        self.members[name] = m
        self.log(f"{name} starting ({bundle})")

    def push_members(self) -> None:
        """The serving instances to the router when they changed; draining ones may stop once it answered."""
        ray = require_ray()
        if self.router_start_ref is not None:
            return
        members = self.serving_list()
        now = time.monotonic()
        if members == self.pushed and now - self.last_push < ROUTER_CHECK_S:
            return
        self.last_push = now   # unchanged lists too, every few seconds: that is how a dead router is noticed
        try:
            ray.get(self.router.set_members.remote(members), timeout=ROUTER_ACK_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            self.log("the router actor died: starting a new one")
            self.restart_router()
            return   # the list goes to the new one once it serves
        except Exception as e:
            self.log(f"the router did not take the member list: {type(e).__name__}: {e}")
            return
        self.pushed = members

    def check_draining(self, now: float) -> None:
        ray = require_ray()
        if self.pushed is None or self.router_start_ref is not None:
            return
        pushed = {name for name, _, _ in self.pushed}
        waiting = [m for m in self.members.values() if m.state == DRAINING and m.name not in pushed
                   and m.drain_ref is None]
        if waiting:   # out of the router's list: let the router's hops on it end first (a P's prefill, a
            try:      # D chosen before its P finished), up to --drain-timeout
                open_hops = ray.get(self.router.in_flight.remote([m.name for m in waiting]), timeout=5.0)
            except Exception:
                open_hops = {}
            for m in waiting:
                if m.drain_after is None:
                    m.drain_after = now + self.spec.drain_timeout
                if open_hops.get(m.name, 1) == 0 or now >= m.drain_after:
                    m.drain_ref = m.actor.drain.remote(self.spec.drain_timeout + 5.0)
                    m.drain_deadline = now + self.spec.drain_timeout + 15.0   # its own SIGKILL, and then some
        for m in [m for m in self.members.values() if m.state == DRAINING and m.drain_ref is not None]:
            done, _ = ray.wait([m.drain_ref], timeout=0)
            if not done and now > m.drain_deadline:   # a hung actor: killing it kills its server too
                self.log(f"{m.name} did not answer its drain: killed")
                self.release(m)
            elif done:
                try:
                    code = ray.get(m.drain_ref)
                except Exception as e:
                    code = f"actor died: {type(e).__name__}"
                self.log(f"{m.name} drained (exit code {code})")
                self.release(m)

    def stop(self) -> None:
        """Drain everything (the router first stops routing), then stop the router."""
        ray = require_ray()
        with self.scale_lock:
            self.stopping = True
            self.wanted = dict.fromkeys(POOL_ROLES, 0)
        if self.thread is not None:
            self.thread.join(timeout=10)
        with self.lock:
            if self.router is not None:
                try:
                    ray.get(self.router.set_members.remote([]), timeout=ROUTER_ACK_TIMEOUT_S)
                except Exception:
                    pass
            placed = [m for m in self.members.values() if m.start_ref is None]   # (the others never started)
            refs = [m.actor.drain.remote(self.spec.drain_timeout + 5.0) for m in placed]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=self.spec.drain_timeout + 10.0)
            for m in list(self.members.values()):
                self.release(m)
            if self.router is not None:
                try:
                    ray.get(self.router.stop.remote(), timeout=10)
                    ray.kill(self.router, no_restart=True)
                except Exception:
                    pass
                self.router = None


# --- the commands ---------------------------------------------------------------------------------------

def stop_timeout(spec: PoolSpec) -> float:
    """Controller.stop's worst case: its tick thread (a set_members ack), the drains, the router's stop."""
    return 10.0 + ROUTER_ACK_TIMEOUT_S + spec.drain_timeout + 10.0 + 10.0 + STOP_TIMEOUT_S


def connect(address: str | None, *, local_host: str = "127.0.0.1"):
    """ray.init on `address` ("auto", a cluster address), or a new local Ray instance on `local_host`."""
    ray = require_ray()
    if ray.is_initialized():   # (a caller that is already a driver of the cluster)
        return ray
    if address and address != "auto" and "://" not in address:   # nobody listening: ray.init would wait for ever
        host, _, port = address.rpartition(":")
        if host and port.isdigit():
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=5.0).close()
            except OSError as e:
                raise ConnectionError(f"nothing answers at {address}: {e}") from None
    if address:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
    else:
        ray.init(namespace=NAMESPACE, include_dashboard=False, _node_ip_address=local_host,
                 logging_level=logging.WARNING)
    return ray


_REMOTE: dict[type, Any] = {}


def remote_class(ray, cls: type):
    """ray.remote(cls), made once per process (each call would ship the class to the cluster again)."""
    if cls not in _REMOTE:
        _REMOTE[cls] = ray.remote(cls)
    return _REMOTE[cls]




def run_ray_cluster(spec: PoolSpec, *, address: str | None, num_prefill: int, num_decode: int,
                    num_colocated: int, ready_timeout: float = START_TIMEOUT_S) -> int:
    try:
        ray = connect(address, local_host=spec.router_host if spec.router_host != "0.0.0.0" else "127.0.0.1")
    except Exception as e:
        print(f"pdserve up --ray: cannot connect to Ray at {address or 'a new local instance'}: {e}", file=sys.stderr)
        return 1
    if spec.instance_host is None and not address:
        spec.instance_host = "127.0.0.1"   # a local Ray instance is this host: nothing to reach from outside
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    spec.use_gpus = spec.device == "cuda" or (spec.device == "auto" and has_gpus)
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    controller = None
    try:
        # Threads: scale/status/ready are answered while the supervision thread runs.
        controller = remote_class(ray, Controller).options(
            num_cpus=0, max_concurrency=8, name=CONTROLLER_NAME, namespace=NAMESPACE).remote(spec)
        url = ray.get(controller.start.remote(num_prefill, num_decode, num_colocated), timeout=300)
        deadline = time.monotonic() + ready_timeout
        state = "ready"
        while not ray.get(controller.ready.remote(), timeout=60):
            if time.monotonic() > deadline:   # what serves, serves: say what is missing, do not tear it down
                events = ray.get(controller.status.remote(), timeout=60)["events"][-5:]
                print(f"pdserve up --ray: not every instance is serving after {ready_timeout:.0f} s; the cluster "
                      f"goes on with those that are (`pdserve scale` shows them). Last events:\n  "
                      + "\n  ".join(events), file=sys.stderr, flush=True)
                state = "partly up"
                break
            time.sleep(1.0)
        gcs = ray.get_runtime_context().gcs_address
        print(f"pdserve cluster {state} on Ray ({gcs}): {url}/v1  ({num_prefill}P {num_decode}D "
              f"{num_colocated} colocated). `pdserve status {url}` shows it; `pdserve scale --address {gcs} "
              f"--prefill N --decode M` resizes it; Ctrl-C stops it.", flush=True)
        while True:   # the controller dying ends the cluster; a slow answer does not
            try:
                ray.get(controller.status.remote(), timeout=60)
            except ray.exceptions.GetTimeoutError:
                print("pdserve up --ray: the controller is slow to answer", file=sys.stderr, flush=True)
            time.sleep(2.0)
    except KeyboardInterrupt:
        return 0
    except Exception as e:
        print(f"pdserve up --ray: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        if controller is not None:
            try:
                ray.get(controller.stop.remote(), timeout=stop_timeout(spec))
            except Exception:
                pass
            ray.kill(controller, no_restart=True)
        ray.shutdown()


def scale_main(args) -> int:
    try:
        ray = connect(args.address)
        controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except Exception as e:
        print(f"pdserve scale: no pdserve cluster on Ray at {args.address}: {e}", file=sys.stderr)
        return 1
    if args.prefill is None and args.decode is None and args.colocated is None:
        print_status(ray.get(controller.status.remote(), timeout=30))
        return 0
    try:
        wanted = ray.get(controller.scale.remote(args.prefill, args.decode, args.colocated), timeout=30)
    except Exception as e:
        cause = getattr(e, "cause", None)   # the controller's ValueError, wrapped by Ray
        print(f"pdserve scale: {cause if isinstance(cause, ValueError) else e}", file=sys.stderr)
        return 2 if isinstance(cause, ValueError) else 1
    print(f"pdserve scale: wanted {wanted['prefill']}P {wanted['decode']}D {wanted['colocated']} colocated",
          flush=True)
    if args.wait <= 0:
        return 0
    deadline = time.monotonic() + args.wait
    while not _ready(ray, controller):
        if time.monotonic() > deadline:
            print(f"pdserve scale: not there within {args.wait:g} s (the controller goes on; `pdserve scale` "
                  f"without sizes shows why)", file=sys.stderr)
            return 1
        time.sleep(0.5)
    print_status(ray.get(controller.status.remote(), timeout=30), events=0)
    return 0


def _ready(ray, controller) -> bool:
    try:
        return ray.get(controller.ready.remote(), timeout=60)
    except ray.exceptions.GetTimeoutError:   # a slow controller: ask again until the caller's deadline
        return False


def print_status(status: dict, events: int = 10) -> None:
    wanted = status["wanted"]
    print(f"router {status['router']}   wanted {wanted['prefill']}P {wanted['decode']}D {wanted['colocated']} colocated")
    for inst in status["instances"]:
        print(f"  {inst['name']:<14} {inst['role']:<10} {inst['state']:<9} {inst['url'] or '-'}")
    if status.get("autoscale") is not None:
        pressure = ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} n/a"
                             for k, v in status["autoscale"]["pressure"].items())
        print(f"autoscale: decisions {status['autoscale']['decisions'] or 'none'}; pressure {pressure or 'n/a'}")
    for event in status["events"][-events:] if events else ():
        print(f"  {event}")
