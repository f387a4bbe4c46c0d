"""SamplingParams: what a request asks of the sampler and of the stop logic."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

# Bounds that keep every value inside the tensors and generators it becomes: a top_k becomes an int64
# (and above the vocabulary size it cuts nothing), a seed what torch.Generator.manual_seed takes.
MAX_TOP_K = 2**31 - 1
SEED_RANGE = (-2**63, 2**64 - 1)


@dataclass
class SamplingParams:
    max_tokens: int | None = 16       # None: up to the model's length
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """ValueError naming the field. The engine checks again where a request enters it
        (EngineCore.add_request), so params changed after construction are caught too."""
        if self.max_tokens is not None and not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not (_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature: must be in [0, 100], got {self.temperature!r}")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not (_is_int(self.top_k) and -1 <= self.top_k <= MAX_TOP_K):
            raise ValueError(f"top_k: must be -1, 0 or an integer in [1, {MAX_TOP_K}], got {self.top_k!r}")
        if self.seed is not None and not (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed: must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: must be non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
