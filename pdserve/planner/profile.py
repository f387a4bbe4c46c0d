"""How long one engine step takes, as a function of what the step holds: the profile the simulator runs on.

The form follows the roofline of a step. Every token of the step, prefill or decode, goes through the
same matmuls, which read the weights once: that part is bound by whichever is slower, reading the
weights or the matmuls' FLOPs. Attention is added on top: the decodes read their KV (per context token),
a prefill chunk computes its (query, key) pairs. So

    seconds = fixed + max(weights, per_token * (P + B)) + per_context_token * C
              + per_attention_pair * A + per_decode_seq * B + (prefill_step if P > 0)

with P the step's prefill tokens, B its decoding sequences, C their summed context, and A = sum over the
prefill chunks of chunk x context. prefill_step is what a step with a prefill costs beyond the
others: on CUDA, decode-only steps replay a captured graph while a prefill launches its kernels one by
one (about 13 ms for the 8B shape on an H200). The coefficients (all >= 0) are fitted to steps measured on the
target hardware (benchmarks/gpu_step_profile.py) by non-negative least squares on relative error, with
each point's side of the max chosen by the current fit until no point changes side. `pdserve plan
--profile FILE` reads the JSON that script writes; the fit's error on every measured point is reported
(docs/planner.md).

The decodes' attention (optional: a profile's "decode_kernel") is not always per_context_token x C. The
decode kernel (model/triton_attention.py) runs one program per (sequence, KV head, split), and one program
alone reads its KV at only 1/bandwidth_programs of the memory bandwidth. So a step lasts until its longest
program ends, and a batch with too few programs, or with one long sequence among short ones, takes longer
than its summed context at full bandwidth. C is then replaced by decode_attention_context(): the
makespan of those programs in a fluid model (each of the n programs running reads at min(1/rho, 1/n) of
the bandwidth, at most programs_per_sm x SMs of them at once), from the batch's summed and longest
context alone (the lengths taken as uniform between 2 x mean - longest and the longest), in context
tokens, so that an equal batch of enough programs costs exactly C. Measured and fitted on an H100
(docs/planner.md, "Decode steps between graph buckets and over unequal contexts").
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

TERMS = ("fixed", "weights", "per_token", "per_context_token", "per_attention_pair", "per_decode_seq",
         "prefill_step")


@dataclass(frozen=True)
class StepPoint:
    prefill_tokens: int
    prefill_attention: int   # sum over prefill chunks of chunk length x context at the chunk's end
    decode_batch: int
    decode_context: int      # summed context of the decoding sequences
    seconds: float
    decode_max_context: int = 0   # the longest decoding sequence's context; 0: not recorded (all equal)

    def as_dict(self) -> dict:
        return asdict(self)


# The batch sizes pdserve captures decode CUDA graphs for (worker/cuda_graphs.py: BUCKETS, graph_buckets).
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_SPLITS = 64   # model/triton_attention.py


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """worker/cuda_graphs.graph_buckets, kept here so that the planner imports no torch: powers of two up
    to 256, then steps of 128 up to max_num_seqs."""
    small = [b for b in GRAPH_BUCKETS if b < max_num_seqs]
    large = [b for b in GRAPH_BUCKETS if b >= max_num_seqs][:1] or \
        list(range(GRAPH_BUCKETS[-1] + 128, max_num_seqs + 128, 128))
    return tuple(small + large)


def padded_batches(max_num_seqs: int) -> list[int]:
    """rows[b]: the rows a decode-only step of b sequences runs through the model (its graph bucket)."""
    rows = [0] * (max_num_seqs + 1)
    buckets = graph_buckets(max_num_seqs)
    i = 0
    for b in range(1, max_num_seqs + 1):
        while buckets[i] < b:
            i += 1
        rows[b] = buckets[i]
    return rows


@lru_cache(maxsize=4096)   # the simulator asks once a step
def decode_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """model/triton_attention.decode_num_splits without torch: splits per (sequence, KV head) for a decode
    launch of num_seqs rows (a graph's bucket, or an eager step's decodes)."""
    programs = num_seqs * num_kv_heads
    splits = 1
    while splits < MAX_SPLITS and programs * splits < 2 * num_sms:
        splits *= 2
    return splits


@dataclass(frozen=True)
class DecodeKernel:
    """What the decode attention's makespan depends on beside the context (module docstring)."""
    kv_heads: int                 # the model's KV heads: programs per sequence and split
    bandwidth_programs: float     # rho: programs that together reach the bandwidth (one alone: 1/rho of it)
    programs_per_sm: int = 4      # programs of the decode kernel resident on one SM at once
    num_sms: int = 132

    def validate(self) -> None:
        if self.kv_heads < 1 or self.num_sms < 1 or self.programs_per_sm < 0:
            raise ValueError("decode_kernel: kv_heads and num_sms must be >= 1, programs_per_sm >= 0 (0: no limit)")
        if not (0 <= self.bandwidth_programs < math.inf):
            raise ValueError("decode_kernel: bandwidth_programs must be finite and >= 0")


def _one_wave(n: float, mean: float, longest: float, rho: float) -> float:
    """Fluid makespan, in program-tokens at full bandwidth, of n programs started together whose lengths
    are uniform on [2 mean - longest, longest], each reading at min(1/rho, 1/active) of the bandwidth:
    max over x of sum(min(length, x)) + rho (longest - x). Where 2 mean < longest, a share 2 mean / longest
    of the programs is taken as uniform on [0, longest] and the rest as empty (same total)."""
    if n <= 0 or longest <= 0:
        return 0.0
    low = 2 * mean - longest
    if low < 0:
        n, low = n * 2 * mean / longest, 0.0
    if n <= rho:
        return rho * longest
    spread = longest - low
    if spread <= 1e-9 * longest:
        return n * longest
    x = longest - rho / n * spread   # where the share of programs still running falls to rho / n
    below = (x - low) * (low + x) / 2 + (longest - x) * x
    return n * below / spread + rho * (longest - x)


def decode_attention_context(batch: int, context: float, max_context: float, launch_batch: int,
                             kernel: DecodeKernel) -> float:
    """The summed context at full bandwidth that costs what the decode kernel's programs take (>= context;
    equal to it for an equal batch of at least rho programs in one wave). launch_batch: the rows the kernel
    is launched for (a graph's bucket; they set the splits); max_context 0: every sequence the same."""
    if batch <= 0 or context <= 0 or kernel.bandwidth_programs <= 0:
        return context
    splits = decode_num_splits(max(launch_batch, batch), kernel.kv_heads, kernel.num_sms)
    n = batch * kernel.kv_heads * splits
    mean = context / batch / splits
    longest = max(max_context / splits, mean)
    rho = kernel.bandwidth_programs
    slots = kernel.programs_per_sm * kernel.num_sms
    if not slots or n <= slots:
        work = _one_wave(n, mean, longest, rho)
    else:
        # More programs than fit at once. Equal lengths: the full waves at bandwidth, then the last wave's
        # programs alone. Lengths spread to [0, longest]: what is in flight when the last program starts is
        # `slots` programs with what they have left, taken as uniform on [0, longest]. Between the two,
        # weighted by the spread of the lengths.
        last = n - slots * (math.ceil(n / slots) - 1)
        equal = (n - last) * mean + _one_wave(last, mean, longest, rho)
        spread = n * mean - slots * longest / 2 + _one_wave(slots, longest / 2, longest, rho)
        u = min(1.0, (longest - max(0.0, 2 * mean - longest)) / longest)
        work = (1 - u) * equal + u * spread
    return max(context, work / kernel.kv_heads)


@dataclass(frozen=True)
class StepModel:
    fixed: float
    weights: float
    per_token: float
    per_context_token: float
    per_attention_pair: float
    per_decode_seq: float
    prefill_step: float
    max_relative_error: float = 0.0   # over the points it was fitted to
    source: str = ""
    decode_kernel: DecodeKernel | None = None   # None: the decodes' attention is per_context_token x C

    def seconds(self, prefill_tokens: float, prefill_attention: float, decode_batch: float,
                decode_context: float, decode_max_context: float = 0, launch_batch: int = 0) -> float:
        """launch_batch: the rows a decode-only step's CUDA graph runs (its bucket; 0: decode_batch), for
        the decode kernel's splits only (the simulator adds the padded rows' matmuls itself)."""
        if self.decode_kernel is not None and decode_batch:
            decode_context = decode_attention_context(int(decode_batch), decode_context, decode_max_context,
                                                      launch_batch, self.decode_kernel)
        return (self.fixed + max(self.weights, self.per_token * (prefill_tokens + decode_batch))
                + self.per_context_token * decode_context + self.per_attention_pair * prefill_attention
                + self.per_decode_seq * decode_batch + (self.prefill_step if prefill_tokens else 0.0))

    def as_dict(self) -> dict:
        data = asdict(self)
        if self.decode_kernel is None:
            del data["decode_kernel"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> StepModel:
        missing = [t for t in TERMS if t not in data]
        if missing:
            raise ValueError(f"step model: missing {missing} (expected {list(TERMS)})")
        values = {t: float(data[t]) for t in TERMS}
        bad = [t for t, v in values.items() if not np.isfinite(v) or v < 0]
        if bad:
            raise ValueError(f"step model: {bad} must be finite and >= 0")
        if values["per_token"] <= 0:
            raise ValueError("step model: per_token must be > 0 (a token must cost time)")
        return cls(**values, max_relative_error=float(data.get("max_relative_error", 0.0)),
                   source=str(data.get("source", "")), decode_kernel=_decode_kernel(data.get("decode_kernel")))


def _decode_kernel(data) -> DecodeKernel | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ValueError('"decode_kernel" is not an object')
    try:
        kernel = DecodeKernel(kv_heads=int(data["kv_heads"]), bandwidth_programs=float(data["bandwidth_programs"]),
                              programs_per_sm=int(data.get("programs_per_sm", 4)),
                              num_sms=int(data.get("num_sms", 132)))
    except KeyError as exc:
        raise ValueError(f"decode_kernel: missing {exc}") from None
    kernel.validate()
    return kernel


def attention_pairs(chunk: int, context_before: int) -> int:
    """(query, key) pairs of a causal chunk of `chunk` tokens after `context_before` cached ones."""
    return chunk * context_before + chunk * (chunk + 1) // 2


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """argmin ||a x - b|| with x >= 0 (Lawson and Hanson's active set method)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        if passive.all() or (w[~passive] <= 1e-12 * max(1.0, np.abs(w).max())).all():
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocking = passive & (z <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


def _launch_rows(p: StepPoint, rows: list[int] | None) -> int:
    """The rows p's decodes were launched for: its graph's bucket for a decode-only step measured with CUDA
    graphs (rows from padded_batches), else its decodes."""
    if rows is not None and not p.prefill_tokens and 0 < p.decode_batch < len(rows):
        return rows[p.decode_batch]
    return p.decode_batch


def _context(p: StepPoint, kernel: DecodeKernel | None, rows: list[int] | None) -> float:
    if kernel is None or not p.decode_batch:
        return p.decode_context
    return decode_attention_context(p.decode_batch, p.decode_context, p.decode_max_context,
                                    _launch_rows(p, rows), kernel)


def _features(p: StepPoint, compute_bound: bool, context: float, launch_rows: int) -> list[float]:
    tokens = p.prefill_tokens + launch_rows
    return [1.0, 0.0 if compute_bound else 1.0, tokens if compute_bound else 0.0, context,
            p.prefill_attention, p.decode_batch, 1.0 if p.prefill_tokens else 0.0]


def fit_step_model(points: list[StepPoint], source: str = "", decode_kernel: DecodeKernel | None = None,
                   graph_max_num_seqs: int = 0) -> StepModel:
    """decode_kernel: fit with the decode kernel's makespan in place of the summed context (its
    bandwidth_programs given, not fitted). graph_max_num_seqs: the points' decode-only steps ran CUDA graphs
    captured up to this batch, so their matmuls ran their bucket's rows (0: as many rows as decodes)."""
    if len(points) < len(TERMS):
        raise ValueError(f"fit: {len(points)} points for {len(TERMS)} terms")
    rows = padded_batches(graph_max_num_seqs) if graph_max_num_seqs else None
    contexts = [_context(p, decode_kernel, rows) for p in points]
    launch = [_launch_rows(p, rows) for p in points]
    secs = np.array([p.seconds for p in points], dtype=float)
    if (secs <= 0).any() or not np.isfinite(secs).all():
        raise ValueError("fit: every step must take a positive time")
    side = [p.prefill_tokens > 0 for p in points]   # start: prefills compute-bound, decodes weight-bound
    coef = np.zeros(len(TERMS))
    for _ in range(20):
        feats = np.array([_features(p, s, c, r) for p, s, c, r in zip(points, side, contexts, launch)], dtype=float)
        scale = feats.max(axis=0)
        scale[scale == 0] = 1.0
        coef = nnls(feats / scale / secs[:, None], np.ones(len(points))) / scale
        new_side = [coef[2] * (p.prefill_tokens + r) > coef[1] for p, r in zip(points, launch)]
        if new_side == side:
            break
        side = new_side
    model = StepModel(*coef.tolist(), source=source, decode_kernel=decode_kernel)
    errors = [abs(step_seconds(model, p, rows) / p.seconds - 1) for p in points]
    return StepModel(*coef.tolist(), max_relative_error=float(max(errors)), source=source,
                     decode_kernel=decode_kernel)


def step_seconds(model: StepModel, p: StepPoint, rows: list[int] | None = None) -> float:
    """The model's time for a measured point; rows (padded_batches of the engine's max_num_seqs): its
    decode-only steps ran CUDA graphs, their matmuls the bucket's rows."""
    launch = _launch_rows(p, rows)
    padded = launch - p.decode_batch
    return (model.seconds(p.prefill_tokens, p.prefill_attention, p.decode_batch, p.decode_context,
                          p.decode_max_context, launch)
            + max(model.weights, model.per_token * (p.prefill_tokens + launch))
            - max(model.weights, model.per_token * (p.prefill_tokens + launch - padded)))


def load_step_model(path: str | Path) -> StepModel:
    """A profile JSON: either benchmarks/gpu_step_profile.py's output (its "fit", or a refit of its
    "points"), or a bare step model {fixed, per_prefill_token, ...}."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"profile {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"profile {path}: expected a JSON object")
    try:
        if "points" in data:
            points = [StepPoint(**{k: float(v) if k == "seconds" else int(v) for k, v in p.items()})
                      for p in data["points"]]
            model = fit_step_model(points, source=str(path), decode_kernel=_decode_kernel(data.get("decode_kernel")),
                                   graph_max_num_seqs=int(data.get("graph_max_num_seqs", 0)))
            if model.per_token <= 0:
                raise ValueError("the fit gives tokens no cost: measure prefill steps of several lengths")
            return model
        fit = data.get("fit", data)
        if not isinstance(fit, dict):
            raise ValueError('"fit" is not an object')
        return StepModel.from_dict({**fit, "source": str(path)})
    except (TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise ValueError(f"profile {path}: {exc}") from None
