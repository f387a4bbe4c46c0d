"""A discrete-event simulator of a pdserve cluster: requests arrive, the router sends them to prefill,
decode or colocated instances, each instance runs engine steps whose time comes from a measured step
model (planner/profile.py), and KV moves from P to D at a measured rate.

What each instance does per step is the scheduler's rule (core/scheduler.py), reduced to counts:
- every running sequence decodes one token, then prefill fills what is left of the token budget
  (`max_num_batched_tokens`), oldest request first, in chunks when chunked prefill is on, else only a
  prompt that fits whole;
- a request is admitted (starts its prefill, or on D joins the batch) while fewer than `max_num_seqs`
  sequences are in the instance and its KV fits: P reserves its prompt, D and colocated instances the prompt
  plus the whole answer (so the simulation never preempts; a real engine under KV pressure preempts and
  recomputes, which this leaves out);
- a decode-only step runs as the CUDA graph of the smallest captured batch size that holds it
  (worker/cuda_graphs.py): a batch of 65 costs the matmul rows of 128. The step profile was measured at
  batch sizes that are all bucket sizes, so its fit cannot know this; the simulator adds it. The bucket
  also sets the decode kernel's splits, and with them, where the profile has a decode kernel
  (planner/profile.py), the decodes' attention, which depends on the longest decoding context too: each
  instance keeps its decoding sequences in a heap by context (they all grow one token a step, so their
  order never changes);
- a P's request, once prefilled, reaches the client's first token `handoff_latency_s` later: P's sampled
  token goes with its kv_transfer_params and D sends it on admission, before it reads the KV (D's step in
  flight, at most one step more in a real engine, is left out). Its KV is on D after `handoff_latency_s +
  prompt KV bytes / rate`; it then joins D's batch at D's next step and decodes the other tokens. P frees
  its KV when the handoff ends; a request of one token ends at its first.

The router picks P and D at arrival (`round-robin` or `least-load`: P by prefill tokens waiting, D by
sequences held or coming; past 16 instances of a kind, the less loaded of two picked at random, as
vllm-router's power-of-two choices). With `pd_min_prompt_tokens`, a prompt shorter than that goes straight
to a D, which prefills it itself (conditional disaggregation). Colocated instances, when there are no P/D
instances, take the requests by the same policy.

Cost: a step is O(1) plus O(log n) per request that finishes or starts, independent of the batch size, so a
run is linear in requests and steps: a million requests over a thousand instances runs in minutes
(benchmarks/plan_scale.py).
"""
from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdserve.planner.profile import GRAPH_BUCKETS, StepModel, attention_pairs, graph_buckets, padded_batches

ARRIVAL, STEP_END, HANDOFF_DONE = 0, 1, 2
POLICIES = ("round-robin", "least-load")
POWER_OF_TWO_ABOVE = 16
# graph_buckets and padded_batches live in planner/profile.py (the fit needs them too); importable here as before
__all__ = ["GRAPH_BUCKETS", "POLICIES", "graph_buckets", "padded_batches", "ClusterSpec", "EngineSpec", "Workload",
           "Result", "Simulator", "simulate"]


@dataclass(frozen=True)
class EngineSpec:
    """One instance's scheduler limits (pdserve serve's flags of the same names)."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    kv_capacity_tokens: int = 800_000
    # A decode-only step replays the CUDA graph of the smallest captured batch size holding it, so its
    # matmuls run that many rows (padded rows included); steps with a prefill run eager, unpadded.
    cuda_graphs: bool = True

    def validate(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.kv_capacity_tokens < 1:
            raise ValueError(f"engine: max_num_seqs, max_num_batched_tokens and kv_capacity_tokens must be >= 1, "
                             f"got {self.max_num_seqs}, {self.max_num_batched_tokens}, {self.kv_capacity_tokens}")
        if self.max_num_seqs > MAX_NUM_SEQS:   # a table of one entry per batch size is built from it
            raise ValueError(f"engine: max_num_seqs must be at most {MAX_NUM_SEQS:,}, got {self.max_num_seqs:,}")


MAX_NUM_SEQS = 1_000_000   # far past any engine's running batch


@dataclass(frozen=True)
class ClusterSpec:
    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0
    engine: EngineSpec = field(default_factory=EngineSpec)
    prefill_engine: EngineSpec | None = None   # None: `engine`
    policy: str = "least-load"
    pd_min_prompt_tokens: int = 0
    kv_bytes_per_token: int = 131_072          # Llama-3.1-8B, bf16: 32 layers x 2 x 8 heads x 128 x 2 B
    handoff_bytes_per_s: float = 300e9         # cuda_ipc / NIXL between two H200s, measured (docs/benchmarks.md)
    handoff_latency_s: float = 0.003           # the router's hops and D's post, per request

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode + self.num_colocated

    def describe(self) -> str:
        parts = []
        if self.num_prefill or self.num_decode:
            parts.append(f"{self.num_prefill}P{self.num_decode}D")
        if self.num_colocated:
            parts.append(f"{self.num_colocated} colocated")
        return " + ".join(parts)

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, got {self.policy!r}")
        if min(self.num_prefill, self.num_decode, self.num_colocated) < 0 or self.num_instances == 0:
            raise ValueError(f"cluster: instance counts must be >= 0 and not all 0, got {self.describe() or 'none'}")
        if (self.num_prefill == 0) != (self.num_decode == 0):
            raise ValueError(f"cluster: prefill and decode instances come together, got {self.num_prefill}P"
                             f"{self.num_decode}D")
        if self.num_prefill and self.num_colocated:
            raise ValueError("cluster: P/D and colocated instances in one simulated cluster are not supported")
        if not (0 < self.handoff_bytes_per_s < math.inf and 0 <= self.handoff_latency_s < math.inf
                and self.kv_bytes_per_token >= 0):
            raise ValueError("cluster: handoff rate must be finite and > 0, its latency finite and >= 0, "
                             "the KV bytes >= 0")
        self.engine.validate()
        if self.prefill_engine is not None:
            self.prefill_engine.validate()


@dataclass
class Workload:
    """Requests as arrays: arrival (s, from 0), prompt tokens, answer tokens (>= 1)."""
    arrival: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray

    def __post_init__(self) -> None:
        self.arrival = np.asarray(self.arrival, dtype=float)
        self.prompt_len = np.asarray(self.prompt_len, dtype=np.int64)
        self.output_len = np.asarray(self.output_len, dtype=np.int64)
        n = len(self.arrival)
        if len(self.prompt_len) != n or len(self.output_len) != n:
            raise ValueError("workload: arrival, prompt_len and output_len differ in length")
        if n and ((self.prompt_len < 1).any() or (self.output_len < 1).any() or not np.isfinite(self.arrival).all()
                  or (self.arrival < 0).any() or (np.diff(self.arrival) < 0).any()):
            raise ValueError("workload: lengths must be >= 1 and arrivals finite, >= 0, in order")

    def __len__(self) -> int:
        return len(self.arrival)

    @classmethod
    def poisson(cls, rate: float, prompt_len, output_len, seed: int = 0) -> Workload:
        """Exponential gaps at `rate` per second (the first request at 0, as `pdserve bench` sends them)."""
        if not 0 < rate < math.inf:
            raise ValueError(f"rate must be finite and > 0, got {rate}")
        n = len(prompt_len)
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
        gaps[0] = 0.0
        return cls(np.cumsum(gaps), prompt_len, output_len)


@dataclass
class Result:
    ttft: np.ndarray
    tpot: np.ndarray
    finish: np.ndarray
    steps: int
    rejected: int = 0   # requests whose KV can never fit an instance: never served

    def attainment(self, slo_ttft_s: float, slo_tpot_s: float) -> float:
        """The share of all requests, those never served included, that met both SLOs."""
        total = len(self.ttft) + self.rejected
        if total == 0:
            return 1.0
        ok = (self.ttft <= slo_ttft_s) & (self.tpot <= slo_tpot_s)
        return float(ok.sum()) / total

    def summary(self, slo_ttft_s: float, slo_tpot_s: float) -> dict:
        def pct(a, q):
            return float(np.percentile(a, q)) if len(a) else 0.0
        return {"requests": int(len(self.ttft)), "slo_attainment": self.attainment(slo_ttft_s, slo_tpot_s),
                "ttft_attainment": self.attainment(slo_ttft_s, math.inf),
                "tpot_attainment": self.attainment(math.inf, slo_tpot_s),
                "ttft_p50_ms": pct(self.ttft, 50) * 1e3, "ttft_p90_ms": pct(self.ttft, 90) * 1e3,
                "tpot_p50_ms": pct(self.tpot, 50) * 1e3, "tpot_p90_ms": pct(self.tpot, 90) * 1e3,
                "duration_s": float(self.finish.max()) if len(self.finish) else 0.0, "steps": self.steps,
                "rejected": self.rejected}


class _Instance:
    __slots__ = ("index", "role", "spec", "waiting", "incoming", "prefill_left", "admitted", "n_dec", "ctx_sum",
                 "finishing", "k", "busy", "kv_used", "seqs", "queued_tokens", "chunks", "load",
                 "last_start", "pad_s", "rows", "longest")

    def __init__(self, index: int, role: str, spec: EngineSpec):
        self.index, self.role, self.spec = index, role, spec
        self.waiting: deque[int] = deque()    # requests to prefill here, oldest first
        self.incoming: deque[int] = deque()   # D: handed off, waiting to join the batch
        self.prefill_left: dict[int, int] = {}
        self.admitted: set[int] = set()
        self.n_dec = 0
        self.ctx_sum = 0
        self.finishing: list[tuple[int, int]] = []   # (step index it finishes at, request)
        self.k = 0          # decode steps run
        self.busy = False
        self.kv_used = 0
        self.seqs = 0
        self.queued_tokens = 0   # prefill tokens waiting (the router's P load)
        self.chunks: list[tuple[int, int]] = []   # this step's prefill chunks (request, tokens)
        self.load = 0            # D: sequences held, coming, or routed here
        self.last_start = 0.0    # when the step now running was scheduled
        self.pad_s: list[float] | None = None  # pad_s[b]: what a decode-only step of b pays for its padding
        self.rows: list[int] | None = None     # rows[b]: the graph bucket a decode-only step of b runs
        # (-(context - k), request) of each decoding sequence, k the decode steps run: a sequence's context
        # minus k is fixed while it decodes; finished ones are dropped lazily when they reach the top
        self.longest: list[tuple[int, int]] = []


class Simulator:
    def __init__(self, cluster: ClusterSpec, model: StepModel, seed: int = 0):
        cluster.validate()
        self.cluster, self.model = cluster, model
        self.rng = random.Random(seed)
        p_spec = cluster.prefill_engine or cluster.engine
        self.prefill = [_Instance(i, "prefill", p_spec) for i in range(cluster.num_prefill)]
        base = len(self.prefill)
        self.decode = [_Instance(base + i, "decode", cluster.engine) for i in range(cluster.num_decode)]
        base += len(self.decode)
        self.colocated = [_Instance(base + i, "colocated", cluster.engine) for i in range(cluster.num_colocated)]
        pads: dict[EngineSpec, tuple[list[float], list[int]]] = {}
        self.track_longest = model.decode_kernel is not None
        for inst in (*self.prefill, *self.decode, *self.colocated):
            if inst.spec.cuda_graphs:
                if inst.spec not in pads:
                    # the padded rows go through the matmuls (per_token) like real ones; attention reads one
                    # token for each: nothing
                    w, t = model.weights, model.per_token
                    rows = padded_batches(inst.spec.max_num_seqs)
                    pads[inst.spec] = ([max(w, t * r) - max(w, t * b) for b, r in enumerate(rows)], rows)
                inst.pad_s, inst.rows = pads[inst.spec]
        self.rr = {"prefill": 0, "decode": 0, "colocated": 0}

    # -- the router ----------------------------------------------------------------------------------

    def _pick(self, pool: list[_Instance], load) -> _Instance:
        if self.cluster.policy == "round-robin":
            role = pool[0].role
            inst = pool[self.rr[role] % len(pool)]
            self.rr[role] += 1
            return inst
        if len(pool) > POWER_OF_TWO_ABOVE:
            a, b = self.rng.sample(pool, 2)
            return a if load(a) <= load(b) else b
        return min(pool, key=load)

    # -- the run -------------------------------------------------------------------------------------

    def run(self, workload: Workload) -> Result:
        n = len(workload)
        arrival, prompt, output = workload.arrival, workload.prompt_len.tolist(), workload.output_len.tolist()
        self.prompt, self.output = prompt, output
        self.first = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.decoder: dict[int, _Instance] = {}
        self.ready = np.zeros(n)   # when a request reached the queue it waits in
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.steps = 0
        rejected = np.zeros(n, dtype=bool)
        next_arrival = 0
        now = 0.0
        while next_arrival < n or self.events:
            if next_arrival < n and (not self.events or arrival[next_arrival] <= self.events[0][0]):
                now = float(arrival[next_arrival])
                if not self._route(next_arrival, now):
                    rejected[next_arrival] = True
                next_arrival += 1
                continue
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == STEP_END:
                self._end_step(payload, now)
            else:   # HANDOFF_DONE
                rid, p_inst = payload
                p_inst.kv_used -= prompt[rid]
                p_inst.seqs -= 1
                d = self.decoder.pop(rid)
                self._kick(p_inst, now)
                if output[rid] == 1:   # P's token was the whole answer: D released P's KV unread
                    self.finish[rid] = self.first[rid]
                    d.load -= 1
                    continue
                self.ready[rid] = now
                d.incoming.append(rid)
                self._kick(d, now)
        served = ~rejected
        ttft = (self.first - arrival)[served]
        out = np.asarray(output)[served]
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(out > 1, (self.finish[served] - self.first[served]) / np.maximum(out - 1, 1), 0.0)
        return Result(ttft=ttft, tpot=tpot, finish=self.finish[served], steps=self.steps,
                      rejected=int(rejected.sum()))

    def _push(self, time: float, kind: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, self.seq, kind, payload))

    @staticmethod
    def _never_fits(spec: EngineSpec, prompt: int, kv_tokens: int) -> bool:
        """Its KV exceeds the instance's, or, without chunked prefill, its prompt exceeds the token budget:
        a real engine refuses it at once (a 400), so it is not served."""
        return kv_tokens > spec.kv_capacity_tokens or (not spec.enable_chunked_prefill
                                                       and prompt > spec.max_num_batched_tokens)

    def _route(self, rid: int, now: float) -> bool:
        c = self.cluster
        need = self.prompt[rid] + self.output[rid]
        if c.num_colocated:
            if self._never_fits(c.engine, self.prompt[rid], need):
                return False
            inst = self._pick(self.colocated, lambda i: i.queued_tokens + i.seqs)
            self._enqueue(inst, rid, now)
            return True
        p_spec = c.prefill_engine or c.engine
        direct = self.prompt[rid] < c.pd_min_prompt_tokens
        if (need > c.engine.kv_capacity_tokens
                or (direct and self._never_fits(c.engine, self.prompt[rid], need))
                or (not direct and self._never_fits(p_spec, self.prompt[rid], self.prompt[rid]))):
            return False
        d = self._pick(self.decode, lambda i: i.load)
        d.load += 1
        if direct:
            self._enqueue(d, rid, now)
            return True
        p = self._pick(self.prefill, lambda i: i.queued_tokens)
        self.decoder[rid] = d
        self._enqueue(p, rid, now)
        return True

    def _enqueue(self, inst: _Instance, rid: int, now: float) -> None:
        self.ready[rid] = now
        inst.waiting.append(rid)
        inst.prefill_left[rid] = self.prompt[rid]
        inst.queued_tokens += self.prompt[rid]
        self._kick(inst, now)

    def _kick(self, inst: _Instance, now: float) -> None:
        if not inst.busy:
            inst.last_start = now   # an idle engine schedules what arrives at once
            self._start_step(inst, now)

    def _reserve(self, inst: _Instance, rid: int) -> int:
        return self.prompt[rid] if inst.role == "prefill" else self.prompt[rid] + self.output[rid]

    def _start_step(self, inst: _Instance, now: float) -> None:
        spec = inst.spec
        # D: handed-off requests join the batch; their first decode makes their second token
        # Async scheduling: the engine schedules a step while the one before runs, so a step holds what had
        # arrived when the step before it started (or, on an idle engine, what is there now).
        cutoff = inst.last_start
        # ready times only grow along each queue, so its head is its earliest
        if inst.n_dec == 0 and not any(q and self.ready[q[0]] <= cutoff for q in (inst.incoming, inst.waiting)):
            cutoff = now
        while inst.incoming and inst.seqs < spec.max_num_seqs and self.ready[inst.incoming[0]] <= cutoff:
            rid = inst.incoming[0]
            if inst.kv_used + self._reserve(inst, rid) > spec.kv_capacity_tokens:
                break
            inst.incoming.popleft()
            inst.kv_used += self._reserve(inst, rid)
            inst.seqs += 1
            inst.n_dec += 1
            inst.ctx_sum += self.prompt[rid] + 1   # P's first token follows the prompt
            heapq.heappush(inst.finishing, (inst.k + self.output[rid] - 1, rid))
            if self.track_longest:
                heapq.heappush(inst.longest, (inst.k - self.prompt[rid] - 1, rid))
        budget = spec.max_num_batched_tokens - inst.n_dec
        tokens = pairs = 0
        for rid in inst.waiting:
            if budget <= 0 or self.ready[rid] > cutoff:
                break
            if rid not in inst.admitted:
                if inst.seqs >= spec.max_num_seqs or inst.kv_used + self._reserve(inst, rid) > spec.kv_capacity_tokens:
                    break
            left = inst.prefill_left[rid]
            chunk = min(left, budget)
            if chunk < left and not spec.enable_chunked_prefill:
                break
            if rid not in inst.admitted:
                inst.admitted.add(rid)
                inst.kv_used += self._reserve(inst, rid)
                inst.seqs += 1
            done = self.prompt[rid] - left
            tokens += chunk
            pairs += attention_pairs(chunk, done)
            inst.chunks.append((rid, chunk))
            budget -= chunk
        if not tokens and not inst.n_dec:
            inst.busy = False
            return
        inst.busy = True
        inst.last_start = now
        self.steps += 1
        graph = not tokens and inst.pad_s is not None   # a decode-only step: its graph pads the batch
        if self.track_longest and inst.n_dec:
            heap, finish = inst.longest, self.finish
            while finish[heap[0][1]] == finish[heap[0][1]]:   # finished (not NaN)
                heapq.heappop(heap)
            seconds = self.model.seconds(tokens, pairs, inst.n_dec, inst.ctx_sum, inst.k - heap[0][0],
                                         inst.rows[inst.n_dec] if graph else inst.n_dec)
        else:
            seconds = self.model.seconds(tokens, pairs, inst.n_dec, inst.ctx_sum)
        if graph:
            seconds += inst.pad_s[inst.n_dec]
        self._push(now + seconds, STEP_END, inst)

    def _end_step(self, inst: _Instance, now: float) -> None:
        prompt, output = self.prompt, self.output
        if inst.n_dec:
            inst.k += 1
            inst.ctx_sum += inst.n_dec
            while inst.finishing and inst.finishing[0][0] <= inst.k:
                _, rid = heapq.heappop(inst.finishing)
                self._finish(inst, rid, now)
                inst.n_dec -= 1
                inst.ctx_sum -= prompt[rid] + output[rid]   # its context after its last token
        for rid, chunk in inst.chunks:
            left = inst.prefill_left[rid] - chunk
            inst.queued_tokens -= chunk
            if left:
                inst.prefill_left[rid] = left
                continue
            del inst.prefill_left[rid]
            inst.admitted.discard(rid)
            # only a step's last chunk can be partial, so the prompts it completes are the oldest, in order
            assert inst.waiting[0] == rid
            inst.waiting.popleft()
            if inst.role == "prefill":
                c = self.cluster
                self.first[rid] = now + c.handoff_latency_s
                self._push(now + c.handoff_latency_s + prompt[rid] * c.kv_bytes_per_token / c.handoff_bytes_per_s,
                           HANDOFF_DONE, (rid, inst))
                continue
            self.first[rid] = now   # the prefill's own sampled token
            if output[rid] == 1:
                self._finish(inst, rid, now)
                continue
            inst.n_dec += 1
            inst.ctx_sum += prompt[rid] + 1
            heapq.heappush(inst.finishing, (inst.k + output[rid] - 1, rid))
            if self.track_longest:
                heapq.heappush(inst.longest, (inst.k - prompt[rid] - 1, rid))
        inst.chunks.clear()
        self._start_step(inst, now)

    def _finish(self, inst: _Instance, rid: int, now: float) -> None:
        self.finish[rid] = now
        inst.kv_used -= self._reserve(inst, rid)
        inst.seqs -= 1
        if inst.role == "decode":
            inst.load -= 1


def simulate(cluster: ClusterSpec, model: StepModel, workload: Workload, seed: int = 0) -> Result:
    return Simulator(cluster, model, seed).run(workload)
