"""Run a benchmark: one workload at one request rate (run_benchmark) or at several (run_sweep).

Lifecycle of run_benchmark:
  1. validate the config and build the workload (the same seed gives the same prompts and arrivals);
  2. resolve the model: --model, else the first id from GET /v1/models;
  3. dispatch: request i is sent at its arrival offset (Poisson or gamma), then waits for a slot
     when --max-concurrency is set, so the measured latency starts when it is actually sent;
     multi-turn: conversation c starts at arrival offset c, and each of its turns is sent when the
     turn before it has finished, with that turn's streamed answer in its history (a failed turn's
     placeholder answer instead, so that every configuration sends the same number of requests);
  4. each request streams and comes back as a RequestRecord, failures included;
  5. duration = start → last request finished; metrics from the records, the duration and the SLO.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, TextIO

import aiohttp

from pdserve.bench.client import (ROUTES, RequestRecord, auth_headers, build_payload, fetch_first_model,
                                  normalize_base_url, send_request)
from pdserve.bench.metrics import SLO, compute_metrics, format_rate, max_rate_meeting_slo
from pdserve.bench.workloads import DATASETS, ENDPOINTS, Conversation, RequestSpec, arrival_times, \
    jsonl_requests, mixed_requests, multi_turn_conversations, synthetic_requests


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None                 # None: the first id from GET /v1/models
    endpoint: str = "completions"            # completions | chat
    dataset: str = "random"                  # random | prefix-shared | multi-turn | mixed | a .jsonl path
    num_prompts: int = 100
    input_len: int = 512                     # random part of the prompt, tokens
    output_len: int = 128                    # max_tokens
    range_ratio: float = 0.0                 # lengths uniform in [len*(1-r), len*(1+r)]
    output_range_ratio: float | None = None  # output lengths' r, when not range_ratio
    prefix_len: int = 256                    # prefix-shared: tokens every prompt starts with; multi-turn: each
                                             # group's system prompt
    num_users: int = 16                      # multi-turn: conversations (num_prompts is not used)
    num_turns: int = 4                       # multi-turn: requests per conversation
    num_groups: int = 4                      # multi-turn: system prompts; user u has group u % num_groups's
    turn_len: int = 64                       # multi-turn: words of each new user message
    short_fraction: float = 0.8              # mixed: the share of short prompts
    short_len: tuple[int, int] = (32, 128)   # mixed: short prompt tokens, uniform in [low, high]
    long_len: tuple[int, int] = (1024, 2048)  # mixed: long prompt tokens, uniform in [low, high]
    vocab_range: tuple[int, int] = (1000, 20000)  # random token ids are drawn from [low, high)
    request_rate: float = math.inf           # requests/s; inf sends everything at once
    burstiness: float = 1.0                  # gamma shape of the gaps; 1.0 is Poisson
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    seed: int = 0
    api_key: str | None = field(default=None, repr=False)   # never written to results
    extra_body: dict[str, Any] | None = None  # merged into every request body
    request_timeout_s: float | None = 600.0

    def validate(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: expected http://HOST:PORT or https://..., got {self.base_url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint: expected one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.dataset not in DATASETS and not self.dataset.endswith(".jsonl"):
            raise ValueError(f"dataset: expected {', '.join(DATASETS)} or a .jsonl file, got {self.dataset!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts: must be >= 1, got {self.num_prompts}")
        if self.input_len < 1:
            raise ValueError(f"input_len: must be >= 1, got {self.input_len}")
        if self.output_len < 1:
            raise ValueError(f"output_len: must be >= 1, got {self.output_len}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio: must be in [0, 1), got {self.range_ratio}")
        if self.output_range_ratio is not None and not 0.0 <= self.output_range_ratio < 1.0:
            raise ValueError(f"output_range_ratio: must be in [0, 1), got {self.output_range_ratio}")
        if self.dataset in ("prefix-shared", "multi-turn") and self.prefix_len < 1:
            raise ValueError(f"prefix_len: must be >= 1 for dataset {self.dataset}, got {self.prefix_len}")
        for name in ("num_users", "num_turns", "num_groups", "turn_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.short_fraction <= 1.0:
            raise ValueError(f"short_fraction: must be in [0, 1], got {self.short_fraction}")
        for name in ("short_len", "long_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name}: expected 1 <= low <= high, got {getattr(self, name)}")
        low, high = self.vocab_range
        if not 0 <= low < high:
            raise ValueError(f"vocab_range: expected 0 <= low < high, got {self.vocab_range}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness: must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {self.request_timeout_s}")

    @property
    def slo(self) -> SLO:
        return SLO(ttft_ms=self.slo_ttft_ms, tpot_ms=self.slo_tpot_ms)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["api_key"]
        for name in ("vocab_range", "short_len", "long_len"):
            data[name] = list(getattr(self, name))
        data["request_rate"] = format_rate(self.request_rate)
        return data


@dataclass
class BenchmarkResult:
    config: BenchConfig                      # with the model resolved
    metrics: dict[str, Any]
    records: list[RequestRecord]
    started_at: str = ""                     # UTC, ISO 8601

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "started_at": self.started_at, "metrics": self.metrics,
                "requests": [r.to_dict() for r in self.records]}


@dataclass
class SweepResult:
    config: BenchConfig                      # the shared workload; request_rate varies per entry
    results: list[BenchmarkResult]
    target_attainment: float = 0.9

    def entries(self) -> list[dict[str, Any]]:
        return [{"request_rate": format_rate(r.config.request_rate), "started_at": r.started_at,
                 "metrics": r.metrics, "requests": [rec.to_dict() for rec in r.records]}
                for r in self.results]

    def to_dict(self) -> dict[str, Any]:
        entries = self.entries()
        config = self.config.to_dict()
        del config["request_rate"]
        best = max_rate_meeting_slo(entries, self.target_attainment)
        return {"config": config, "request_rates": [e["request_rate"] for e in entries],
                "target_attainment": self.target_attainment,
                "max_rate_meeting_slo": None if best is None else format_rate(best),
                "results": entries}


def build_conversations(config: BenchConfig) -> list[Conversation]:
    """multi-turn's conversations."""
    return multi_turn_conversations(
        num_users=config.num_users, num_turns=config.num_turns, num_groups=config.num_groups,
        system_len=config.prefix_len, turn_len=config.turn_len, output_len=config.output_len,
        range_ratio=config.range_ratio, output_range_ratio=config.output_range_ratio, seed=config.seed)


def build_requests(config: BenchConfig) -> list[RequestSpec]:
    """The requests of the workload; multi-turn: every turn with placeholder answers (the runner sends
    the answers it received instead)."""
    if config.dataset == "multi-turn":
        return [spec for c in build_conversations(config) for spec in c.requests(endpoint=config.endpoint)]
    output_ratio = config.range_ratio if config.output_range_ratio is None else config.output_range_ratio
    if config.dataset == "mixed":
        return mixed_requests(
            endpoint=config.endpoint, num_prompts=config.num_prompts, output_len=config.output_len,
            short_fraction=config.short_fraction, short_len=config.short_len, long_len=config.long_len,
            output_range_ratio=output_ratio, vocab_range=config.vocab_range, seed=config.seed)
    if config.dataset in DATASETS:
        return synthetic_requests(
            endpoint=config.endpoint, num_prompts=config.num_prompts, input_len=config.input_len,
            output_len=config.output_len, range_ratio=config.range_ratio,
            prefix_len=config.prefix_len if config.dataset == "prefix-shared" else 0,
            vocab_range=config.vocab_range, seed=config.seed, output_range_ratio=config.output_range_ratio)
    return jsonl_requests(config.dataset, endpoint=config.endpoint, num_prompts=config.num_prompts,
                          output_len=config.output_len, range_ratio=output_ratio, seed=config.seed)


class ProgressBar:
    """`[bench] |#####-----| 37/100 ok 36 failed 1 12.3s` on stderr: redrawn in place at most 10 times a
    second on a terminal, one line every few seconds otherwise (a log file)."""

    def __init__(self, total: int, *, label: str = "bench", enabled: bool = True,
                 stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.label, self.enabled, self.width = total, label, enabled, width
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = getattr(self.stream, "isatty", lambda: False)()
        self.num_ok = self.num_failed = 0
        self.start = time.perf_counter()
        self.last_draw = 0.0

    def update(self, success: bool) -> None:
        if success:
            self.num_ok += 1
        else:
            self.num_failed += 1
        now = time.perf_counter()
        if now - self.last_draw >= (0.1 if self.is_tty else 5.0) or self.num_ok + self.num_failed == self.total:
            self.last_draw = now
            self.draw()

    def draw(self) -> None:
        if not self.enabled:
            return
        done = self.num_ok + self.num_failed
        filled = self.width * done // max(self.total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        start, end = ("\r", "") if self.is_tty else ("", "\n")  # redraw in place, or one line each
        self.stream.write(f"{start}[{self.label}] |{bar}| {done}/{self.total} ok {self.num_ok} "
                          f"failed {self.num_failed} {time.perf_counter() - self.start:.1f}s{end}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.is_tty:
            self.stream.write("\n")
            self.stream.flush()


def _new_session(config: BenchConfig) -> aiohttp.ClientSession:
    # limit=0: aiohttp's default pool of 100 connections would silently cap the concurrency
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=config.request_timeout_s))


async def _run(session: aiohttp.ClientSession, config: BenchConfig, progress: bool) -> BenchmarkResult:
    conversations = build_conversations(config) if config.dataset == "multi-turn" else None
    specs = build_requests(config) if conversations is None else []
    if config.model is None:
        config = replace(config, model=await fetch_first_model(session, config.base_url, config.api_key))
    url = normalize_base_url(config.base_url) + ROUTES[config.endpoint]
    headers = auth_headers(config.api_key)
    # multi-turn: the arrival process starts conversations; their later turns follow their answers
    num_arrivals = len(specs) if conversations is None else len(conversations)
    offsets = arrival_times(num_arrivals, config.request_rate, config.burstiness, config.seed)
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    num_requests = len(specs) if conversations is None else config.num_users * config.num_turns
    bar = ProgressBar(num_requests, label=f"rate {config.request_rate:g}", enabled=progress)

    async def send(index: int, spec: RequestSpec, bench_start: float, scheduled_time: float,
                   collect_text: bool = False) -> RequestRecord:
        payload = build_payload(spec, endpoint=config.endpoint, model=config.model,
                                ignore_eos=config.ignore_eos, temperature=config.temperature,
                                extra_body=config.extra_body)
        async with slots or contextlib.nullcontext():
            record = await send_request(session, url, payload, index=index, bench_start=bench_start,
                                        scheduled_time=scheduled_time, headers=headers, collect_text=collect_text)
        bar.update(record.success)
        return record

    async def one(index: int, spec: RequestSpec, bench_start: float) -> list[RequestRecord]:
        return [await send(index, spec, bench_start, offsets[index])]

    async def conversation(c: Conversation, bench_start: float) -> list[RequestRecord]:
        records: list[RequestRecord] = []
        answers: list[str] = []
        ready = offsets[c.user]
        for turn in range(c.num_turns):
            spec = c.request(turn, answers, endpoint=config.endpoint)
            record = await send(c.user * c.num_turns + turn, spec, bench_start, ready, collect_text=True)
            answers.append(record.output_text if record.success and record.output_text is not None
                           else c.placeholder_answers[turn])
            records.append(replace(record, conversation=c.user, turn=turn, output_text=None))
            ready = time.perf_counter() - bench_start   # the next turn is due once this one has finished
        return records

    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    bench_start = time.perf_counter()
    tasks = []
    for index in range(num_arrivals):
        delay = bench_start + offsets[index] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index, specs[index], bench_start) if conversations is None
                                         else conversation(conversations[index], bench_start)))
    records = sorted((r for rs in await asyncio.gather(*tasks) for r in rs), key=lambda r: r.index)
    duration = time.perf_counter() - bench_start
    bar.close()
    return BenchmarkResult(config=config, metrics=compute_metrics(records, duration, config.slo),
                           records=records, started_at=started_at)


async def run_benchmark(config: BenchConfig, *, progress: bool = False,
                        session: aiohttp.ClientSession | None = None) -> BenchmarkResult:
    """Run one workload at `config.request_rate`; failed requests are records, not exceptions.
    ValueError for a bad config or when no model can be found."""
    config.validate()
    if session is not None:
        return await _run(session, config, progress)
    async with _new_session(config) as own_session:
        return await _run(own_session, config, progress)


async def run_sweep(config: BenchConfig, request_rates: list[float], *, progress: bool = False,
                    target_attainment: float = 0.9) -> SweepResult:
    """The same workload (same prompts and seed) at each rate in turn, each rate on fresh connections
    so that one rate's pool (or a connection the server closed meanwhile) does not leak into the next."""
    if not request_rates:
        raise ValueError("request_rates: give at least one rate")
    config.validate()
    if config.model is None:
        async with _new_session(config) as session:
            config = replace(config, model=await fetch_first_model(session, config.base_url, config.api_key))
    results = [await run_benchmark(replace(config, request_rate=rate), progress=progress)
               for rate in request_rates]
    return SweepResult(config=config, results=results, target_attainment=target_attainment)
