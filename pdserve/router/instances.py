"""The router's record of one instance: health, its last load report, what the router sent it, learned rates.

docs/router.md, "The router's view". The poller (monitor.py) feeds `update` with each `GET /v1/load` report
and `record_failure` / `record_success` with each poll's outcome; the proxy brackets every hop with
`begin` / `end`, so that the estimates see requests the instance has not reported yet. Estimates take the
larger of the reported and the router's own count: exact with one router, still sane with several (each
router's own count is a lower bound of the truth, the report is one as of its time).

Pure and deterministic: no I/O, the caller passes `now`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pdserve.config import PUSH_KV_CONNECTORS
from pdserve.router.prefix_index import parse_kv_events

ROLES = ("prefill", "decode", "colocated")
HEALTHY, EJECTED = "healthy", "ejected"

# Until measured. Deliberately middle-of-the-road: a wrong default only skews choices until the first busy
# poll interval of the instance replaces it.
DEFAULT_PREFILL_TOKENS_PER_S = 4000.0
DEFAULT_DECODE_STEP_S = 0.025
DEFAULT_TRANSFER_BYTES_PER_S = 2e9
DEFAULT_BLOCK_SIZE = 16                 # pdserve's own default (EngineConfig.block_size)
DEFAULT_KV_BYTES_PER_TOKEN = 131072     # an 8B GQA model in 16 bits: 32 layers × 8 heads × 128 × K,V × 2 B

EWMA_ALPHA = 0.3                # weight of the newest interval: a few polls to follow a change of load mix
MIN_BUSY_DELTA_S = 0.02         # intervals with less engine time say more about timer noise than speed
MIN_PREFILL_TOKENS = 32         # ... and with fewer prompt tokens, about scheduling overhead
MIN_DECODE_STEPS = 2.0
MIN_TRANSFER_DELTA_S = 0.005
MIN_SHARE_OF_BUSY = 0.25        # a kind of work that took less of the interval cannot be timed by subtraction
MIN_BATCH_VARIANCE = 0.25       # batches that varied less (std < 0.5 sequences) cannot give a step's slope


class MalformedReport(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One `GET /v1/load` answer (docs/router.md), each field None when the instance did not send it."""
    boot_id: str | None = None
    kv_role: str | None = None
    healthy: bool | None = None
    health: Any = None
    block_size: int | None = None
    hash_extra: str | None = None
    num_blocks: int | None = None
    num_free_blocks: int | None = None
    kv_bytes_per_token: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    max_prompt_chars: int | None = None
    num_requests_running: int | None = None
    num_requests_waiting: int | None = None
    num_requests_waiting_for_remote_kvs: int | None = None
    num_prefill_tokens_waiting: int | None = None
    num_blocks_held_for_transfer: int | None = None
    num_prompt_tokens_computed_total: int | None = None
    num_output_tokens_total: int | None = None
    busy_seconds_total: float | None = None
    kv_transfer_bytes_total: int | None = None
    kv_transfer_seconds_total: float | None = None
    kv_connector: Mapping | None = None   # {name, engine_id, tp_size, host, port, boot_id}: connector, side channel

    @classmethod
    def parse(cls, data: Any) -> LoadReport:
        """Missing fields and nulls are None (an older or foreign instance); a field of the wrong type, a
        negative count or a non-finite number is MalformedReport: such an instance is broken, not old."""
        if not isinstance(data, Mapping):
            raise MalformedReport("load report: not a JSON object")
        values = {}
        for field in fields(cls):
            value = data.get(field.name)
            if value is not None:
                check = _FIELD_CHECKS.get(field.name, _is_count)
                if not check(value):
                    raise MalformedReport(f"load report: {field.name} = {str(value)[:40]!r}")
            values[field.name] = value
        if values["block_size"] == 0:
            raise MalformedReport("load report: block_size = 0")
        if data.get("kv_events") is not None:   # the prefix index's part: checked here so it fails the poll
            try:
                parse_kv_events(data["kv_events"])
            except ValueError as e:
                raise MalformedReport(f"load report: {e}") from None
        return cls(**values)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_seconds(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value >= 0)


def _is_kv_connector(value: Any) -> bool:
    """{name, engine_id, tp_size, and host, port, boot_id where the connector has a side channel}."""
    if not (isinstance(value, Mapping) and all(isinstance(value.get(k), str) for k in ("name", "engine_id"))):
        return False
    if "host" not in value and "port" not in value:   # (the store's instances: no side channel)
        return True
    return (isinstance(value.get("host"), str) and _is_count(value.get("port")) and 0 < value["port"] < 65536
            and isinstance(value.get("boot_id"), (str, type(None))))


_FIELD_CHECKS = {
    "boot_id": lambda v: isinstance(v, str), "kv_role": lambda v: isinstance(v, str),
    "kv_connector": _is_kv_connector,
    "healthy": lambda v: isinstance(v, bool), "health": lambda v: True,
    "hash_extra": lambda v: isinstance(v, str),
    "busy_seconds_total": _is_seconds, "kv_transfer_seconds_total": _is_seconds,
}
COUNTERS = ("num_prompt_tokens_computed_total", "num_output_tokens_total", "busy_seconds_total",
            "kv_transfer_bytes_total", "kv_transfer_seconds_total")


class StepFit:
    """A decode step's time as an affine function of the running batch, fitted online to (mean batch, step
    time) pairs of poll intervals by EWMA moments: step(n) = fixed + per_sequence × n. Each sequence adds its
    KV reads and its share of the batch's arithmetic; the fixed part is the weights' read. Without the slope
    every D with the same step time looks the same however many streams it runs, and the cost policy piles
    every request onto whichever D measured a hair faster.

    Until the batches have varied enough to show a slope, the fixed part is taken as one sequence's share
    (step(n) ∝ n + 1): middle-of-the-road between a GPU's weight-bound step and a CPU's, and enough to
    spread equal Ds. The slope is clamped so that neither part is negative."""
    __slots__ = ("n", "mean_b", "mean_s", "mean_bb", "mean_bs")

    def __init__(self) -> None:
        self.n = 0
        self.mean_b = self.mean_s = self.mean_bb = self.mean_bs = 0.0

    def add(self, batch: float, step_s: float) -> None:
        if self.n == 0:
            self.mean_b, self.mean_s, self.mean_bb, self.mean_bs = batch, step_s, batch * batch, batch * step_s
        else:
            a = EWMA_ALPHA
            self.mean_b += a * (batch - self.mean_b)
            self.mean_s += a * (step_s - self.mean_s)
            self.mean_bb += a * (batch * batch - self.mean_bb)
            self.mean_bs += a * (batch * step_s - self.mean_bs)
        self.n += 1

    def at(self, batch: int, step_s: float) -> float:
        """step_s: the EWMA step time at the fit's mean batch (the default step at batch 1 until measured)."""
        mean_b = self.mean_b if self.n else 1.0
        slope = step_s / (mean_b + 1.0)
        variance = self.mean_bb - self.mean_b * self.mean_b
        if self.n >= 2 and variance >= MIN_BATCH_VARIANCE:
            slope = min(max(0.0, (self.mean_bs - self.mean_b * self.mean_s) / variance), step_s / mean_b)
        return max(0.0, step_s + slope * (max(1, batch) - mean_b))


class Ticket:
    """One hop's share of an instance, from `Instance.begin` to `Instance.end`."""
    __slots__ = ("num_prompt_tokens", "num_blocks", "generation", "prompt_open", "open")

    def __init__(self, num_prompt_tokens: int, num_blocks: int, generation: int) -> None:
        self.num_prompt_tokens, self.num_blocks, self.generation = num_prompt_tokens, num_blocks, generation
        self.prompt_open = self.open = True


def ewma(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - EWMA_ALPHA) * old + EWMA_ALPHA * new


MIN_FULL_HOLD_S = 0.1   # an instance's 503 at capacity holds new hops back at least one poll interval ...
MAX_FULL_HOLD_S = 2.0   # ... and at most this, whatever its Retry-After says (the polls see it sooner)


def handoff_of(kv_connector: str) -> str:
    """pull (D reads P's blocks), push (P writes into D's) or store (both through a KV store)."""
    return "push" if kv_connector in PUSH_KV_CONNECTORS else "store" if kv_connector == "store" else "pull"


class Instance:
    def __init__(self, name: str, url: str, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role: one of {', '.join(ROLES)}, got {role!r}")
        self.name, self.url, self.role = name, url, role
        self.state, self.consecutive_failures, self.detail = HEALTHY, 0, None
        self.last_heard: float | None = None   # time.monotonic() of its last healthy load report
        self.removed = False                # Router.remove: out of the cluster (hops on it still end)
        self.removed_at: float | None = None   # ... since then, no longer polled
        self.report: LoadReport | None = None
        self.report_time: float | None = None
        self.num_reports = self.num_restarts = self.num_ejections = 0
        self.unanswered_polls = 0   # polls in a row that got no answer at all (a stopped or hung process)
        # The router's own accounting.
        self.own_in_flight = 0
        self.num_sent = 0                   # hops begun, ever (GET /cluster: how the policy spread them)
        self.own_prompt_tokens = 0          # of requests whose prompt is not computed yet
        self._blocks_since_report = 0       # blocks the router sent since the last report (it cannot see them)
        self._generation = 0                # report count: tells a ticket begun before the last report
        self.full_until = 0.0               # it answered 503 at capacity: no new hop before then
        self.handoff = "pull"               # "push" | "store": how its connector hands KV over (kept across a
                                            # restart's empty view)
        self.tp_size = 1                    # its tensor-parallel ranks, as last reported
        # Learned rates; None until measured.
        self._prefill_tokens_per_s: float | None = None
        self._decode_step_s: float | None = None
        self._step_fit = StepFit()
        self._transfer_bytes_per_s: float | None = None

    def __repr__(self) -> str:
        return f"Instance({self.name}, {self.role}, {self.state})"

    # --- health -------------------------------------------------------------------------------------------

    @property
    def is_available(self) -> bool:
        """May the policies choose it. Until its first poll an instance counts as healthy: the router serves
        from the start, and a dead one is ejected by the polls or connections that fail."""
        return self.state == HEALTHY

    def record_failure(self, eject_after: int, detail: str | None = None, answered: bool = True) -> bool:
        """A failed poll (no answer, an error status, a malformed or unhealthy report) or a refused
        connection; answered=False for a poll that got no answer at all. True when this failure ejected the
        instance."""
        self.consecutive_failures += 1
        self.detail = detail
        self.unanswered_polls = 0 if answered else self.unanswered_polls + 1
        if self.state == HEALTHY and self.consecutive_failures >= max(1, eject_after):
            self.state = EJECTED
            self.num_ejections += 1
            return True
        return False

    def mark_full(self, now: float, retry_after: str | None) -> None:
        """It answered a hop with 503 at capacity: send it nothing new for its Retry-After (capped at
        MAX_FULL_HOLD_S), so that waiting requests do not retry it as fast as they can (a retry storm
        that grows with the square of the waiters, found by a hostile test)."""
        try:
            seconds = float(retry_after) if retry_after is not None else MIN_FULL_HOLD_S
        except ValueError:   # an HTTP date, or garbage
            seconds = MIN_FULL_HOLD_S
        if not math.isfinite(seconds):
            seconds = MAX_FULL_HOLD_S
        self.full_until = max(self.full_until, now + min(max(seconds, MIN_FULL_HOLD_S), MAX_FULL_HOLD_S))

    def is_full(self, now: float) -> bool:
        return now < self.full_until

    def record_success(self) -> bool:
        """A good poll. True when it re-admitted an ejected instance."""
        was_ejected = self.state == EJECTED
        self.state, self.consecutive_failures, self.detail, self.unanswered_polls = HEALTHY, 0, None, 0
        return was_ejected

    def why_silent(self, began: float, since_restarts: int, silence_s: float, now: float) -> str | None:
        """Why a hop begun at `began` (when the instance had `since_restarts` restarts) should stop waiting for
        the instance's first byte, or None while it may go on: the instance has not restarted, and it sent a
        healthy load report (a pdserve instance's health says its engine is stepping) within silence_s of now
        or of `began`. An instance that sends no load reports (another server, probed on /health, which says
        nothing of its engine) or was removed from the cluster (no longer polled) gets silence_s from `began`
        or from its removal, as a stream gets between two bytes. An instance the polls ejected, and that has
        answered no poll since, is given up on at once."""
        if self.num_restarts != since_restarts:
            return "restarted"
        if self.state == EJECTED and self.unanswered_polls:
            # ejected, and its polls go unanswered (a stopped or hung process; not one that drains or
            # reports itself unhealthy, which answers): the router has given up on it, so does the hop
            return "ejected (its polls go unanswered)"
        heard = max(began, self.removed_at or began) if self.removed else max(began, self.last_heard or began)
        if now - heard > silence_s:
            return f"no healthy load report for {now - heard:.1f} s"
        return None

    # --- reports ------------------------------------------------------------------------------------------

    def update(self, data: Any, now: float) -> bool:
        """Take one load report. False (and nothing changed) when it is malformed: the caller counts that
        as a failed poll. A new boot id or a counter that went backwards is a restart: rates learned of the
        old process are dropped and this report becomes the new baseline."""
        try:
            report = LoadReport.parse(data)
        except MalformedReport as e:
            self.detail = str(e)
            return False
        previous = self.report
        if previous is not None and (report.boot_id != previous.boot_id or _went_backwards(previous, report)):
            self.restarted()
            previous = None
        if previous is not None and self.report_time is not None:
            self._learn(previous, report)
        self.report, self.report_time = report, now
        if report.kv_connector is not None:
            self.handoff = handoff_of(report.kv_connector["name"])
            tp_size = report.kv_connector.get("tp_size", 1)
            self.tp_size = tp_size if _is_count(tp_size) and tp_size >= 1 else 1
        self.num_reports += 1
        self._generation += 1
        self._blocks_since_report = 0
        return True

    def restarted(self) -> None:
        """The instance is a new process: what was learned of the old one no longer holds. The router's own
        in-flight accounting stays: those hops still end through `end`."""
        self.num_restarts += 1
        self.report = self.report_time = None
        self._prefill_tokens_per_s = self._decode_step_s = self._transfer_bytes_per_s = None
        self._step_fit = StepFit()
        self._blocks_since_report = 0
        self._generation += 1

    def _learn(self, prev: LoadReport, cur: LoadReport) -> None:
        """Rates from the counters' deltas over one poll interval.

        Busy time mixes prefill and decode steps on a decode or colocated instance, so each kind is timed by
        subtracting the other's share at its current estimate: steps ≈ output tokens / mean running batch
        (each decode step yields one token per running request), decode time ≈ steps × step time, prefill
        time = busy − decode time, and the converse, both against the estimates from before this interval.
        One interval cannot tell the two apart (one equation, two unknowns); intervals of different mixes
        do, and the EWMA carries them over. A prefill instance's busy time is all prefill (its one output
        token per request comes out of the prefill step). An interval where a kind took less than
        MIN_SHARE_OF_BUSY of the busy time leaves that kind's estimate as it was: the subtraction would
        amplify the other's error.
        """
        d_busy = _delta(prev.busy_seconds_total, cur.busy_seconds_total)
        d_prompt = _delta(prev.num_prompt_tokens_computed_total, cur.num_prompt_tokens_computed_total)
        d_out = _delta(prev.num_output_tokens_total, cur.num_output_tokens_total)
        if d_busy is not None and d_busy >= MIN_BUSY_DELTA_S:
            if self.role == "prefill":
                if d_prompt is not None and d_prompt >= MIN_PREFILL_TOKENS:
                    self._prefill_tokens_per_s = ewma(self._prefill_tokens_per_s, d_prompt / d_busy)
            else:
                running = [r for r in (prev.num_requests_running, cur.num_requests_running) if r is not None]
                batch = max(1.0, sum(running) / len(running)) if running else 1.0
                steps = (d_out or 0) / batch
                d_prompt = d_prompt or 0
                prefill_s = d_busy - steps * self.decode_step_s
                decode_s = d_busy - d_prompt / self.prefill_tokens_per_s
                if d_prompt >= MIN_PREFILL_TOKENS and prefill_s >= MIN_SHARE_OF_BUSY * d_busy:
                    self._prefill_tokens_per_s = ewma(self._prefill_tokens_per_s, d_prompt / prefill_s)
                if steps >= MIN_DECODE_STEPS and decode_s >= MIN_SHARE_OF_BUSY * d_busy:
                    self._decode_step_s = ewma(self._decode_step_s, decode_s / steps)
                    self._step_fit.add(batch, decode_s / steps)
        d_bytes = _delta(prev.kv_transfer_bytes_total, cur.kv_transfer_bytes_total)
        d_transfer_s = _delta(prev.kv_transfer_seconds_total, cur.kv_transfer_seconds_total)
        if d_bytes and d_transfer_s is not None and d_transfer_s >= MIN_TRANSFER_DELTA_S:
            self._transfer_bytes_per_s = ewma(self._transfer_bytes_per_s, d_bytes / d_transfer_s)

    # --- the router's own accounting ----------------------------------------------------------------------

    def begin(self, num_prompt_tokens: int = 0, num_blocks: int = 0) -> Ticket:
        """The router sends the instance a request: `num_prompt_tokens` it will compute (0 for a decode that
        reads them from a P), `num_blocks` of KV it will take."""
        ticket = Ticket(max(0, num_prompt_tokens), max(0, num_blocks), self._generation)
        self.own_in_flight += 1
        self.num_sent += 1
        self.own_prompt_tokens += ticket.num_prompt_tokens
        self._blocks_since_report += ticket.num_blocks
        return ticket

    def prompt_done(self, ticket: Ticket) -> None:
        """The first token came back: the prompt no longer waits for prefill (optional; `end` implies it)."""
        if ticket.prompt_open:
            ticket.prompt_open = False
            self.own_prompt_tokens -= ticket.num_prompt_tokens

    def end(self, ticket: Ticket) -> None:
        """The hop is over (answered, failed or cancelled); idempotent."""
        if not ticket.open:
            return
        self.prompt_done(ticket)
        ticket.open = False
        self.own_in_flight -= 1
        if ticket.generation == self._generation:   # no report since: it never counted these blocks
            self._blocks_since_report -= ticket.num_blocks

    # --- learned rates ------------------------------------------------------------------------------------

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S

    @property
    def decode_step_s(self) -> float:
        return self._decode_step_s or DEFAULT_DECODE_STEP_S

    def decode_step_s_at(self, batch: int) -> float:
        """A decode step's time with `batch` sequences running (docs/router.md, "The router's view")."""
        return self._step_fit.at(batch, self.decode_step_s)

    @property
    def transfer_bytes_per_s(self) -> float:
        return self._transfer_bytes_per_s or DEFAULT_TRANSFER_BYTES_PER_S

    @property
    def rates_measured(self) -> dict[str, bool]:
        return {"prefill_tokens_per_s": self._prefill_tokens_per_s is not None,
                "decode_step_s": self._decode_step_s is not None,
                "transfer_bytes_per_s": self._transfer_bytes_per_s is not None}

    # --- estimates for the policies -----------------------------------------------------------------------

    @property
    def kv_connector(self) -> Mapping | None:
        """Its connector and side channel as last reported (None: not reported yet, or none)."""
        return self._reported("kv_connector")

    @property
    def is_push(self) -> bool:
        """A push-handoff instance (as last reported, or as the start-up check found it)."""
        return self.handoff == "push"

    def _reported(self, field: str) -> int | None:
        return None if self.report is None else getattr(self.report, field)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens waiting for prefill on it."""
        return max(self._reported("num_prefill_tokens_waiting") or 0, self.own_prompt_tokens)

    @property
    def num_in_flight(self) -> int:
        """Requests on it: running, waiting, or waiting for their KV from a P."""
        reported = sum(self._reported(f) or 0 for f in ("num_requests_running", "num_requests_waiting",
                                                        "num_requests_waiting_for_remote_kvs"))
        return max(reported, self.own_in_flight)

    @property
    def num_queued_requests(self) -> int:
        """Requests waiting for a slot in its running batch (those past max_num_seqs, by the router's count)."""
        own_excess = 0
        max_num_seqs = self._reported("max_num_seqs")
        if max_num_seqs:
            own_excess = max(0, self.own_in_flight - max_num_seqs)
        return max(self._reported("num_requests_waiting") or 0, own_excess)

    @property
    def num_blocks(self) -> int | None:
        return self._reported("num_blocks")

    @property
    def free_blocks(self) -> int | None:
        """Reported free blocks minus those the router sent since that report; None when unknown."""
        free = self._reported("num_free_blocks")
        return None if free is None else max(0, free - self._blocks_since_report)

    @property
    def held_fraction(self) -> float | None:
        """A P's share of its KV held for a D to read, the prefills sent since the report included (they
        will be held once computed); None when unknown."""
        num_blocks, held = self._reported("num_blocks"), self._reported("num_blocks_held_for_transfer")
        if not num_blocks or held is None:
            return None
        return (held + self._blocks_since_report) / num_blocks

    @property
    def block_size(self) -> int:
        return self._reported("block_size") or DEFAULT_BLOCK_SIZE

    @property
    def hash_extra(self) -> str:
        return self._reported("hash_extra") or ""

    @property
    def kv_bytes_per_token(self) -> int:
        return self._reported("kv_bytes_per_token") or DEFAULT_KV_BYTES_PER_TOKEN

    @property
    def max_num_seqs(self) -> int | None:
        return self._reported("max_num_seqs")

    def blocks_for(self, num_tokens: int) -> int:
        return -(-max(0, num_tokens) // self.block_size)

    def status(self) -> dict[str, Any]:
        """For the router's GET /cluster (pdserve status)."""
        num_blocks, free = self.num_blocks, self._reported("num_free_blocks")
        return {
            "name": self.name, "role": self.role, "handoff": self.handoff if self.role != "colocated" else None,
            "state": self.state, "detail": self.detail, "restarts": self.num_restarts, "ejections": self.num_ejections,
            "consecutive_failures": self.consecutive_failures, "in_flight": self.num_in_flight,
            "own_in_flight": self.own_in_flight, "sent": self.num_sent, "running": self._reported("num_requests_running"),
            "waiting": self._reported("num_requests_waiting"),
            "waiting_for_remote_kvs": self._reported("num_requests_waiting_for_remote_kvs"),
            "prefill_tokens_waiting": self.queued_prefill_tokens,
            "kv_usage": None if not num_blocks or free is None else 1.0 - free / num_blocks,
            "blocks_held_for_transfer": self._reported("num_blocks_held_for_transfer"),
            "rates": {"prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_step_s": self.decode_step_s,
                      "transfer_bytes_per_s": self.transfer_bytes_per_s, "measured": self.rates_measured},
        }


def _delta(old: float | None, new: float | None) -> float | None:
    return None if old is None or new is None else new - old


def _went_backwards(prev: LoadReport, cur: LoadReport) -> bool:
    return any((d := _delta(getattr(prev, c), getattr(cur, c))) is not None and d < 0 for c in COUNTERS)
