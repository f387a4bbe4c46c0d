"""Request and RequestStatus: one generation request as the scheduler tracks it."""
from __future__ import annotations

import enum
import time
from typing import Any

from pdserve.outputs import FinishReason
from pdserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # blocks allocated, KV being loaded by the connector
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), max_model_len: int | None = None,
                 kv_transfer_params: dict[str, Any] | None = None,
                 arrival_time: float | None = None, output_token_ids: list[int] | None = None) -> None:
        """output_token_ids: a resumed request's tokens generated elsewhere (by an instance that died
        mid-stream): computed as context like a preempted request's, counted as output (max_tokens,
        usage), never sent again."""
        if not prompt_token_ids:
            raise ValueError("prompt: must hold at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.kv_transfer_params = kv_transfer_params
        # On a KV consumer whose prompt a remote P computed (set by the engine): P's prefix hits, what usage
        # reports as cached (num_reported_cached_tokens)
        self.remote_prefill_cached_tokens: int | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

        # Output tokens allowed: what was asked, capped by the room the model's length leaves.
        limits = [n for n in (sampling_params.max_tokens,
                              max_model_len - len(prompt_token_ids) if max_model_len else None) if n is not None]
        self.max_tokens = max(1, min(limits)) if limits else 1

        self.output_token_ids: list[int] = list(output_token_ids or ())
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Async scheduling: scheduled into a step whose outputs have not landed yet (0 otherwise).
        self.num_inflight_tokens = 0
        self.num_inflight_samples = 0
        self.num_cached_tokens = 0        # prompt tokens not computed here (prefix cache or remote KV)
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # filled by the KV cache manager as blocks fill
        self.error: str | None = None

    @property
    def num_reported_cached_tokens(self) -> int:
        """usage.prompt_tokens_details.cached_tokens: prompt tokens whose prefill this request was spared
        by a cache, as colocated serving reports them. KV a remote P computed for it is not cached (P
        computed it for this request): P's own prefix hits are, which P's kv_transfer_params carry (none
        known: 0). Not this instance's hits then: P computed the prompt all the same, and D, which takes
        P's first token, may hit the prompt's last block, which a colocated instance recomputes. Otherwise
        this instance's prefix and KV store hits (num_cached_tokens)."""
        if self.remote_prefill_cached_tokens is not None:
            cached = self.remote_prefill_cached_tokens
        else:
            cached = self.num_cached_tokens
        return min(cached, self.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_in_flight(self) -> bool:
        """Async scheduling: the step in flight samples the request's last allowed token."""
        return self.num_output_tokens + self.num_inflight_samples >= self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """The finished status implied by the last token, or None to go on (stop strings are checked
        by the detokenizer, which sees text)."""
        last = self.output_token_ids[-1]
        sp = self.sampling_params
        if not sp.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in sp.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
