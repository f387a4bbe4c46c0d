"""The only objects that cross between the scheduler (core) and the model runner (worker)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.kv_transfer.base import ConnectorMeta


# A token the step before this one samples and has not reported yet (async scheduling): the model
# runner takes it from that step's sampled ids on the device. Not a "none" value: an id no vocabulary
# has, so a placeholder that reached the model unfilled would fail the embedding lookup, not pass
# for a real token.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: process `token_ids` at positions
    [num_computed_tokens, num_computed_tokens + len(token_ids))."""
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int          # tokens already in the KV cache before this step
    block_ids: list[int]              # the request's whole block table
    sampling_params: SamplingParams
    do_sample: bool                   # False for a prompt chunk that is not the last
    # The tokens are the prompt's (a prefill chunk), not the one token the step before sampled: a one-token
    # prefill chunk takes the prefill attention path, so its row gets the bits it gets inside a longer
    # chunk (the decode kernel sums in another order).
    prefill: bool = False
    # Tokens sampled for the request before this step, as the scheduler knows them (a resumed request
    # starts with those another instance generated): a seeded generator made now skips that many draws.
    num_output_tokens: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    finished_request_ids: set[str] = field(default_factory=set)  # runner may drop per-request state
    # Async scheduling: preempted while a step that samples for them was in flight. That sample is
    # dropped, so a seeded request's generator must take the same draw again.
    dropped_sample_ids: set[str] = field(default_factory=set)
    connector_meta: "ConnectorMeta | None" = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class KVConnectorOutput:
    finished_sending: set[str] = field(default_factory=set)   # P: D has read these; free the blocks
    finished_recving: set[str] = field(default_factory=set)   # D: KV for these has landed (or failed)
    invalid_block_ids: set[int] = field(default_factory=set)  # D: blocks whose load failed
    recompute_request_ids: set[str] = field(default_factory=set)  # D: failed loads to recompute whatever the policy
    # D: the token P sampled after the prompt, where the connector brought it (push): for requests still
    # loading (sent ahead of the KV) or in finished_recving
    first_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]   # request id → the token sampled this step
    kv_connector_output: KVConnectorOutput = field(default_factory=KVConnectorOutput)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(sampled_token_ids={})
