"""The router's eyes: every instance's GET /v1/load, polled, feeding its Instance record and the prefix index.

One poll per instance every `interval` seconds, all instances at once, each with a deadline (`timeout`); a
round lasts one interval whatever the slowest instance does (its poll goes on, and it is asked again only
once that one ended):
- a good report updates the instance (load, learned rates) and the prefix index (KV events since the last
  poll; a restarted instance, a gap or a first poll is answered with a snapshot) and re-admits an ejected
  instance;
- no answer, an error status or a malformed report is one failure; `eject_after` failures in a row eject
  the instance (the policies stop choosing it; requests on it finish or fail on their own);
- an instance that has no /v1/load (404: another OpenAI server) is probed on /health instead, and the
  policies see no load for it.
A request that could not connect to an instance also counts as a failure (`Monitor.connect_failed`), so a
dead instance is ejected by the requests that meet it as much as by the poll.

At hundreds of instances the polls would be the router's main work (500 instances every 0.1 s took 75 % of its
core on CPU, benchmarks/cpu_router_scale.py), so the polls per second are capped (max_polls_per_s): past
interval x max_polls_per_s instances a round lasts N / max_polls_per_s seconds, and its polls go out spread over
it in slices of at most one interval's worth, not in one burst. Between two reports of an instance the router
counts what it sends there itself (Instance.begin / end). Events cost per block stored or removed, not per
request.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp

from pdserve.router.errors import NETWORK_ERRORS, describe, public_detail
from pdserve.router.instances import Instance
from pdserve.router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_S = 0.1
DEFAULT_MAX_POLLS_PER_S = 1000.0   # every 0.1 s up to 100 instances; 500 are each asked every 0.5 s
DEFAULT_POLL_TIMEOUT_S = 2.0
DEFAULT_EJECT_AFTER = 3
MIN_STARTUP_ATTEMPT_S = 0.1   # the start-up check's last look at an instance, even past its deadline
MAX_REPORT_BYTES = 64 << 20   # a snapshot of a large GPU cache is a few MiB; beyond this something is wrong

# The role an instance must report for each pool (its kv_role; None: no KV connector).
POOL_KV_ROLES = {"prefill": ("producer", "both"), "decode": ("consumer", "both"),
                 "colocated": (None, "consumer", "both", "producer")}


class StartupError(RuntimeError):
    """An instance the router was given cannot serve its pool: it never answered, or has the wrong role."""


class Monitor:
    def __init__(self, instances: list[Instance], index: PrefixIndex, *, headers: dict[str, str],
                 interval: float = DEFAULT_POLL_INTERVAL_S, timeout: float = DEFAULT_POLL_TIMEOUT_S,
                 eject_after: int = DEFAULT_EJECT_AFTER, max_polls_per_s: float = DEFAULT_MAX_POLLS_PER_S) -> None:
        # The router's own list, not a copy: instances it adds are polled from the next round on.
        self.instances, self.index = instances, index
        self.headers, self.interval, self.timeout, self.eject_after = headers, interval, timeout, eject_after
        if not 0 < max_polls_per_s < float("inf"):
            raise ValueError(f"max_polls_per_s: must be a positive number, got {max_polls_per_s}")
        self.max_polls_per_s = max_polls_per_s
        self.session: aiohttp.ClientSession | None = None
        self.boot_ids: dict[str, str] = {}
        self.no_load_route: set[str] = set()   # instances answering /v1/load with 404
        self.on_round = lambda: None            # called after every slice of polls: waiters for capacity look again

    async def run(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        polls: dict[str, asyncio.Task] = {}   # at most one poll per instance in flight
        try:
            while True:
                started = time.monotonic()
                round_s = self.round_seconds()
                due = list(self.instances)
                slices = max(1, min(len(due), round(round_s / self.interval)))
                for i in range(slices):   # (one slice a round, up to max_polls_per_s x interval instances)
                    # An instance whose last poll failed is asked again every slice until it is ejected, so
                    # that ejection takes eject_after intervals however long the round (review).
                    failing = [inst for inst in self.instances if 0 < inst.consecutive_failures < self.eject_after]
                    for inst in due[i::slices] + failing:
                        if inst.name not in polls and not inst.removed:
                            polls[inst.name] = asyncio.create_task(self.poll(inst))
                    # A slice waits its share of the round at most: an instance that answers slowly, or not at
                    # all (until its poll's timeout), must not hold back every other instance's polls (a
                    # hostile test: one hung /v1/load made every round last the 2 s timeout, and a dead
                    # instance took 6 s to eject).
                    end = started + (i + 1) * round_s / slices
                    if polls:
                        await asyncio.wait(polls.values(), timeout=max(0.0, end - time.monotonic()))
                    self._reap(polls)
                    self.index.purge(time.monotonic())
                    self.on_round()   # (every slice: waiters for capacity see what its polls brought)
                    await asyncio.sleep(max(0.0, end - time.monotonic()))
        finally:
            for task in polls.values():
                task.cancel()

    def _reap(self, polls: dict[str, asyncio.Task]) -> None:
        """Polls that ended, and those of instances removed from the cluster meanwhile (cancelled)."""
        members = {inst.name: inst for inst in self.instances}
        for name, task in list(polls.items()):
            if (inst := members.get(name)) is None:   # removed from the cluster meanwhile
                task.cancel()
                del polls[name]
                self.forget(name)
            elif task.done():
                del polls[name]
                # One poll's unexpected error must not end the polls (nothing would be re-admitted).
                if (error := task.exception()) is not None:
                    logger.error("polling %s failed", inst.name, exc_info=error)
                    self.failed(inst, f"poll error: {type(error).__name__}")

    def round_seconds(self) -> float:
        """How long one round (every instance asked once) lasts: the interval, or longer past the poll budget."""
        return max(self.interval, len(self.instances) / self.max_polls_per_s)

    async def poll(self, inst: Instance) -> None:
        try:
            report = await self.fetch(inst)
        except NETWORK_ERRORS as e:   # /health and /cluster show the public words, the log the address
            self.failed(inst, public_detail(e), describe(e), answered=False)
            return
        except ValueError as e:
            self.failed(inst, str(e))
            return
        if inst.removed:
            return
        now = time.monotonic()
        if report is None:   # /health answered 200: alive, load unknown
            self.succeeded(inst)
            return
        boot_id = report.get("boot_id")
        if self.boot_ids.get(inst.name) not in (None, boot_id):
            # A restart: its block ids, sequence numbers and cache are new. This report answered the old
            # cursor, so drop what we knew and ask again from scratch next round.
            logger.info("%s restarted (boot %s)", inst.name, boot_id)
            self.index.forget(inst.name)
            self.boot_ids[inst.name] = boot_id
            inst.restarted()
            return
        if not self.learn(inst, report, now):
            self.failed(inst, "malformed load report")
            return
        if report.get("healthy") is False:
            self.failed(inst, f"unhealthy: {report.get('health')}")
            return
        inst.last_heard = now   # its engine is stepping: whole answers on it may go on (hops.while_heard)
        self.succeeded(inst)

    def learn(self, inst: Instance, report: dict, now: float) -> bool:
        """The instance's load and KV events from one report of its current boot; False if malformed."""
        self.boot_ids[inst.name] = report.get("boot_id")
        if not inst.update(report, now):
            return False
        if isinstance(events := report.get("kv_events"), dict):
            self.index.apply_report(inst.name, events, now)
        return True

    async def fetch(self, inst: Instance) -> dict | None:
        """The instance's load report (None: it has no /v1/load and its /health said 200); ValueError on an
        answer that is not one."""
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        if inst.name in self.no_load_route:
            async with self.session.get(inst.url + "/health", headers=self.headers, timeout=timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"/health answered HTTP {resp.status}")
                return None
        last_seq = self.index.last_seq(inst.name)
        params = {} if last_seq is None else {"events_after": str(last_seq)}
        async with self.session.get(inst.url + "/v1/load", params=params, headers=self.headers,
                                    timeout=timeout) as resp:
            if resp.status == 404:
                self.no_load_route.add(inst.name)
                logger.info("%s has no /v1/load: probing its /health, no load-aware routing for it", inst.name)
                return await self.fetch(inst)
            if resp.status != 200:
                raise ValueError(f"/v1/load answered HTTP {resp.status}")
            # read(n) returns what has arrived, up to n: a snapshot of a large cache comes in many chunks.
            data = bytearray()
            while chunk := await resp.content.read(1 << 16):
                data += chunk
                if len(data) > MAX_REPORT_BYTES:
                    raise ValueError("load report too large")
        try:
            report = json.loads(data)
        except ValueError:
            raise ValueError("load report is not JSON") from None
        if not isinstance(report, dict):
            raise ValueError("load report is not a JSON object")
        return report

    def forget(self, name: str) -> None:
        """What the polls learned of an instance that left (a new one may come back under its name)."""
        self.boot_ids.pop(name, None)
        self.no_load_route.discard(name)

    def failed(self, inst: Instance, detail: str, log_detail: str | None = None, answered: bool = True) -> None:
        if inst.removed:   # (a request that met it on its way out: it is no longer routed to anyway)
            return
        was_available = inst.is_available
        inst.record_failure(self.eject_after, detail, answered)
        if was_available and not inst.is_available:
            logger.warning("%s ejected after %d failed checks: %s", inst.name, self.eject_after,
                           log_detail or detail)

    def succeeded(self, inst: Instance) -> None:
        was_available = inst.is_available
        inst.record_success()
        if not was_available:
            logger.info("%s re-admitted", inst.name)

    def connect_failed(self, inst: Instance, error: BaseException) -> None:
        """A request could not connect to the instance: as telling as a failed poll."""
        self.failed(inst, public_detail(error), describe(error))

    async def check_at_start(self, session: aiohttp.ClientSession, timeout: float) -> None:
        """Before serving: every instance answers within `timeout` s and reports the role of its pool, else
        StartupError naming it. Instances without /v1/load (another server) only need a 200 /health."""
        self.session = session
        deadline = time.monotonic() + timeout
        pending, last_error = list(self.instances), {}
        while pending:
            for inst in list(pending):
                try:   # a silent instance may not hold the check past its deadline (a poll waits longer)
                    left = max(deadline - time.monotonic(), MIN_STARTUP_ATTEMPT_S)
                    report = await asyncio.wait_for(self.fetch(inst), min(left, self.timeout))
                except (*NETWORK_ERRORS, ValueError) as e:
                    last_error[inst.name] = describe(e) if not isinstance(e, ValueError) else str(e)
                    continue
                if report is not None:
                    role = report.get("kv_role")
                    if role not in POOL_KV_ROLES[inst.role]:
                        raise StartupError(f"{inst.url} was given as --{inst.role} but is "
                                           f"{'a ' + role if role else 'an instance without a KV connector'} "
                                           f"(--kv-role {role or 'none'}); a {inst.role} instance needs "
                                           f"--kv-role {' or '.join(r for r in POOL_KV_ROLES[inst.role] if r)}")
                    self.learn(inst, report, time.monotonic())   # (malformed: the polls will say so)
                pending.remove(inst)
            if pending and time.monotonic() > deadline:
                inst = pending[0]
                raise StartupError(f"{inst.url} (--{inst.role}) did not answer within {timeout:g} s: "
                                   f"{last_error.get(inst.name, 'no answer')}")
            if pending:
                await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        self.check_handoffs()

    def check_handoffs(self) -> None:
        """Every P and D must hand KV over the same way: a pull D never announces blocks to a push P, and a
        push D waits for a WRITE no pull P makes. StartupError naming one of each."""
        pd = [inst for inst in self.instances if inst.role in ("prefill", "decode")]
        kinds = {inst.handoff for inst in pd}
        if len(kinds) > 1:
            one = next(inst for inst in pd if inst.handoff != "pull") if "pull" in kinds else pd[0]
            other = next(inst for inst in pd if inst.handoff != one.handoff)
            raise StartupError(f"{one.url} (--{one.role}) hands its KV over by {one.handoff} but {other.url} "
                               f"(--{other.role}) by {other.handoff}: every prefill and decode instance needs the "
                               f"same handoff (--kv-connector nixl or cuda_ipc: pull; nixl-push: push; store)")
        # A D rank's KV heads come from whole P ranks (read or written): of a P's and a D's tensor-parallel
        # sizes one must divide the other (else every request would be prefilled, then refused at the handshake).
        # The store's pool holds the whole model's layout, which every size reads and writes.
        for p in (inst for inst in pd if inst.role == "prefill" and inst.handoff != "store"):
            for d in (inst for inst in pd if inst.role == "decode"):
                if max(p.tp_size, d.tp_size) % min(p.tp_size, d.tp_size):
                    raise StartupError(f"{p.url} (--prefill) has {p.tp_size} tensor-parallel ranks and {d.url} "
                                       f"(--decode) {d.tp_size}: of the two sizes one must divide the other")
