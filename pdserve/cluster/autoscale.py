"""The autoscaler of a Ray cluster's P/D pools (`pdserve up --ray --autoscale`, docs/ray.md).

From the router's view of the instances (GET /cluster: queued prefill tokens, learned prefill rates and
decode step times, KV usage, queues) it estimates two pressures against the SLOs:
- prefill: the time a new prompt waits behind the prompt tokens queued on the P pool,
  Σ queued tokens / Σ prefill tokens per second, as a fraction of the TTFT SLO;
- decode: the mean decode step time of the Ds running requests (as measured) as a fraction of the TPOT SLO,
  or the pool's mean KV usage as a fraction of `kv_high`, or 1 when requests wait for a batch slot on some
  D, whichever is largest (0 for an idle pool).
A pool whose pressure stays above `up` for `patience` decisions in a row gets one more instance; below
`down` (and above its minimum) one fewer. At `max_instances` a pool that needs one takes it from the other
pool when that one is idle enough to give one up, else nothing happens. After each change nothing moves for
`cooldown_s`, and nothing is decided while an instance is starting or draining (it skews every figure; one
that waits for resources does not count, else an unplaceable instance would freeze the autoscaler): the hysteresis that keeps it from flapping.

Pure: the caller passes the status, the wanted sizes and the time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class AutoscaleConfig:
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.05
    max_instances: int = 8
    min_prefill: int = 1
    min_decode: int = 1
    up: float = 0.8            # pressure above which a pool grows ...
    down: float = 0.2          # ... and below which it shrinks
    kv_high: float = 0.9       # a D pool this full is at pressure 1
    patience: int = 3          # decisions in a row that must agree before a change
    cooldown_s: float = 30.0   # after a change: long enough for a new instance to start and take load

    def __post_init__(self) -> None:
        for name in ("slo_ttft_s", "slo_tpot_s", "cooldown_s", "kv_high"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and value == value and value != float("inf")):
                raise ValueError(f"{name}: a finite number >= 0, got {value!r}")
        if not (self.slo_ttft_s > 0 and self.slo_tpot_s > 0):
            raise ValueError("the SLOs must be > 0")
        if not 0 <= self.down < self.up:
            raise ValueError(f"down ({self.down}) must be >= 0 and below up ({self.up})")
        if self.min_prefill < 1 or self.min_decode < 1:
            raise ValueError("min_prefill and min_decode must be >= 1 (P/D needs both pools)")
        if self.max_instances < self.min_prefill + self.min_decode:
            raise ValueError(f"max_instances ({self.max_instances}) must hold min_prefill + min_decode")
        if self.patience < 1:
            raise ValueError(f"patience: must be >= 1, got {self.patience}")


@dataclass
class Decision:
    prefill: int
    decode: int
    reason: str


@dataclass
class Autoscaler:
    config: AutoscaleConfig
    streak: dict[str, tuple[int, int]] = field(default_factory=dict)   # pool → (direction, decisions in a row)
    last_change: float = float("-inf")
    counts: dict[str, int] = field(default_factory=dict)                # reason → decisions taken
    last_pressure: dict[str, float | None] = field(default_factory=dict)

    def pressures(self, status: dict[str, Any]) -> dict[str, float | None]:
        """pool → pressure (None: no healthy instance of it reports yet)."""
        healthy = [i for i in status.get("instances", ()) if i.get("state") == "healthy"]
        prefills = [i for i in healthy if i.get("role") == "prefill"]
        decodes = [i for i in healthy if i.get("role") == "decode"]
        prefill = None
        rates = [(i.get("rates") or {}).get("prefill_tokens_per_s") for i in prefills]
        if prefills and all(r for r in rates):
            queued = sum(i.get("prefill_tokens_waiting") or 0 for i in prefills)
            prefill = queued / sum(rates) / self.config.slo_ttft_s
        decode = None
        if decodes:
            # A step time counts only where it was measured and requests run now: an idle D reports its
            # last (or the router's default) step for ever, which says nothing about the load of now.
            steps = [(i.get("rates") or {}).get("decode_step_s") for i in decodes
                     if ((i.get("rates") or {}).get("measured") or {}).get("decode_step_s") and (i.get("running") or 0) > 0]
            usage = [i.get("kv_usage") for i in decodes if i.get("kv_usage") is not None]
            parts = [0.0]
            if steps:
                parts.append(sum(s for s in steps if s is not None) / len(steps) / self.config.slo_tpot_s)
            if usage:
                parts.append(sum(usage) / len(usage) / self.config.kv_high)
            if any((i.get("waiting") or 0) > 0 for i in decodes):
                parts.append(1.0)
            decode = max(parts)
        return {"prefill": prefill, "decode": decode}

    def decide(self, status: dict[str, Any], wanted: dict[str, int], settled: bool, now: float) -> Decision | None:
        """A new (prefill, decode) size, or None. settled: no instance is starting or draining."""
        cfg = self.config
        pressure = self.pressures(status)
        self.last_pressure = pressure
        if not settled or now - self.last_change < cfg.cooldown_s:
            self.streak.clear()
            return None
        sizes = {"prefill": wanted.get("prefill", 0), "decode": wanted.get("decode", 0)}
        minimum = {"prefill": cfg.min_prefill, "decode": cfg.min_decode}
        direction = {}
        for pool, value in pressure.items():
            if value is None:
                direction[pool] = 0
            elif value > cfg.up:
                direction[pool] = 1
            elif value < cfg.down and sizes[pool] > minimum[pool]:
                direction[pool] = -1
            else:
                direction[pool] = 0
            previous, count = self.streak.get(pool, (0, 0))
            self.streak[pool] = (direction[pool], count + 1 if previous == direction[pool] else 1)
        ready = {pool: d for pool, d in direction.items() if d and self.streak[pool][1] >= cfg.patience}
        if not ready:
            return None
        total = sizes["prefill"] + sizes["decode"]   # (the colocated pool is not the autoscaler's)
        new = dict(sizes)
        growing = sorted((p for p, d in ready.items() if d > 0), key=lambda p: -(pressure[p] or 0))
        if growing:
            pool = growing[0]
            other = "decode" if pool == "prefill" else "prefill"
            if total < cfg.max_instances:
                new[pool] += 1
                reason = f"{pool}_up"
            elif pressure[other] is not None and pressure[other] < cfg.down and sizes[other] > minimum[other]:
                new[pool] += 1
                new[other] -= 1
                reason = f"{pool}_from_{other}"
            else:
                self.counts["at_max"] = self.counts.get("at_max", 0) + 1
                self.streak.clear()
                return None
        else:
            pool = next(p for p, d in ready.items() if d < 0)
            new[pool] -= 1
            reason = f"{pool}_down"
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.streak.clear()
        self.last_change = now
        figures = ", ".join(f"{p} {v:.2f}" if v is not None else f"{p} n/a" for p, v in pressure.items())
        return Decision(new["prefill"], new["decode"], f"{reason} (pressure: {figures})")
