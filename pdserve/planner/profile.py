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
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
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

    def seconds(self, prefill_tokens: float, prefill_attention: float, decode_batch: float,
                decode_context: float) -> float:
        return (self.fixed + max(self.weights, self.per_token * (prefill_tokens + decode_batch))
                + self.per_context_token * decode_context + self.per_attention_pair * prefill_attention
                + self.per_decode_seq * decode_batch + (self.prefill_step if prefill_tokens else 0.0))

    def as_dict(self) -> dict:
        return asdict(self)

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
                   source=str(data.get("source", "")))


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


def _features(p: StepPoint, compute_bound: bool) -> list[float]:
    tokens = p.prefill_tokens + p.decode_batch
    return [1.0, 0.0 if compute_bound else 1.0, tokens if compute_bound else 0.0, p.decode_context,
            p.prefill_attention, p.decode_batch, 1.0 if p.prefill_tokens else 0.0]


def fit_step_model(points: list[StepPoint], source: str = "") -> StepModel:
    if len(points) < len(TERMS):
        raise ValueError(f"fit: {len(points)} points for {len(TERMS)} terms")
    secs = np.array([p.seconds for p in points], dtype=float)
    if (secs <= 0).any() or not np.isfinite(secs).all():
        raise ValueError("fit: every step must take a positive time")
    side = [p.prefill_tokens > 0 for p in points]   # start: prefills compute-bound, decodes weight-bound
    coef = np.zeros(len(TERMS))
    for _ in range(20):
        feats = np.array([_features(p, s) for p, s in zip(points, side)], dtype=float)
        scale = feats.max(axis=0)
        scale[scale == 0] = 1.0
        coef = nnls(feats / scale / secs[:, None], np.ones(len(points))) / scale
        new_side = [coef[2] * (p.prefill_tokens + p.decode_batch) > coef[1] for p in points]
        if new_side == side:
            break
        side = new_side
    model = StepModel(*coef.tolist(), source=source)
    errors = [abs(model.seconds(p.prefill_tokens, p.prefill_attention, p.decode_batch, p.decode_context)
                  / p.seconds - 1) for p in points]
    return StepModel(*coef.tolist(), max_relative_error=float(max(errors)), source=source)


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
            model = fit_step_model(points, source=str(path))
            if model.per_token <= 0:
                raise ValueError("the fit gives tokens no cost: measure prefill steps of several lengths")
            return model
        fit = data.get("fit", data)
        if not isinstance(fit, dict):
            raise ValueError('"fit" is not an object')
        return StepModel.from_dict({**fit, "source": str(path)})
    except (TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise ValueError(f"profile {path}: {exc}") from None
