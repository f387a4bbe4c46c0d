"""What the engine hands upward: one RequestOutput per request per step with new tokens."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class FinishReason(str, Enum):
    STOP = "stop"        # EOS, a stop token or a stop string
    LENGTH = "length"    # max_tokens or the model's length
    ABORT = "abort"      # the client went away or the request was cancelled
    ERROR = "error"      # the engine could not finish it (e.g. a KV load failed under policy `fail`)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]          # tokens produced since the last output of this request
    new_text: str                     # text produced since the last output (stop strings held back)
    num_prompt_tokens: int
    num_output_tokens: int            # total so far
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0        # prompt tokens that came from the prefix cache or a remote P
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
