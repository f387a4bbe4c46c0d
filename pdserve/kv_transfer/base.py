"""The KV connector contract: the one plug-in point for prefill/decode disaggregation.

A connector has two halves. The scheduler half lives beside the scheduler and speaks requests,
token counts and block ids; the worker half lives beside the model runner and moves bytes. They
talk only through `ConnectorMeta` (scheduler → worker, once per step) and `KVConnectorOutput`
(worker → scheduler, once per step). Neither the scheduler nor the model runner knows what
transport sits underneath.

Call points (same as vLLM v1's KVConnectorBase_V1):

  scheduler, for a waiting request:
    1. num, load_async = get_num_new_matched_tokens(request, num_computed_tokens)
       num tokens beyond the local prefix-cache hit can come from outside; None = not known yet
    2. the scheduler allocates blocks for local + external tokens, then calls
       update_state_after_alloc(request, block_ids, num_external_tokens)
       if load_async, the request parks in WAITING_FOR_REMOTE_KVS and uses no compute
    3. meta = build_connector_meta(scheduler_output), once per step, even an empty one
  worker, each step (also when no forward pass runs):
    4. start_load_kv(meta) before the forward pass, wait_for_save() after it
    5. finished_sending, finished_recving = get_finished(); invalid blocks from
       get_block_ids_with_load_errors() (and get_recompute_request_ids(): failed loads to recompute
       whatever the policy; get_first_token_ids(): P's first token, where the load brought it); the
       engine passes these back to the scheduler
  scheduler, when a request ends:
    6. delay_free, params = request_finished(request, block_ids)
       delay_free: keep the blocks until the request id shows up in finished_sending
       params: kv_transfer_params to return to the client (P → proxy → D)

The same contract fits pull (D reads from P), push (P writes into blocks D announced) and a
store (P inserts, D drop-selects): only the halves' insides differ.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.core.batch import SchedulerOutput
    from pdserve.core.request import Request


@dataclass
class ConnectorMeta:
    """What the scheduler half tells the worker half for one step; each connector subclasses it."""


@dataclass(frozen=True)
class KVTransferParams:
    """kv_transfer_params as they cross HTTP (vLLM's field names)."""
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[int] = field(default_factory=list)
    remote_host: str | None = None
    remote_port: int | None = None
    remote_boot_id: str | None = None     # P's per-boot nonce: a claim naming another boot is refused
    tp_size: int = 1
    transfer_id: str | None = None
    num_remote_tokens: int | None = None  # prompt tokens whose KV P computed
    # The token P sampled after the prompt: D emits it at once and computes from it, instead of
    # sampling it again from the prompt's last position (engine/engine_core.py add_request).
    first_token_ids: list[int] | None = None
    remote_cached_tokens: int | None = None  # of the prompt, the tokens P found in its prefix cache

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "KVTransferParams | None":
        if not data:
            return None
        if not isinstance(data, dict):
            raise ValueError("kv_transfer_params: must be an object")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        for name, types in _FIELD_TYPES.items():
            value = known.get(name)
            if value is not None and (not isinstance(value, types) or isinstance(value, bool) != (bool in types)):
                raise ValueError(f"kv_transfer_params: {name} has the wrong type ({type(value).__name__})")
        params = cls(**known)
        if params.do_remote_prefill:
            missing = [f for f in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
                       if getattr(params, f) is None]
            if missing:
                raise ValueError(f"kv_transfer_params: do_remote_prefill needs {', '.join(missing)}")
            if not 0 <= params.remote_port < 65536:
                raise ValueError(f"kv_transfer_params: remote_port must be in [0, 65535], got {params.remote_port}")
            if not isinstance(params.remote_block_ids, list) or not all(
                    isinstance(b, int) and b >= 0 for b in params.remote_block_ids):
                raise ValueError("kv_transfer_params: remote_block_ids must be a list of block ids")
        if params.first_token_ids is not None and (len(params.first_token_ids) != 1 or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in params.first_token_ids)):
            raise ValueError("kv_transfer_params: first_token_ids must be a list of one token id")
        if params.remote_cached_tokens is not None and params.remote_cached_tokens < 0:
            raise ValueError("kv_transfer_params: remote_cached_tokens must be >= 0")
        return params

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


# What each field must be when present: a malformed value must be refused at the door (HTTP 400),
# never reach the engine loop.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "do_remote_decode": (bool,), "do_remote_prefill": (bool,), "remote_engine_id": (str,),
    "remote_request_id": (str,), "remote_block_ids": (list,), "remote_host": (str,), "remote_port": (int,),
    "remote_boot_id": (str,), "tp_size": (int,), "transfer_id": (str,), "num_remote_tokens": (int,),
    "first_token_ids": (list,), "remote_cached_tokens": (int,),
}


class KVConnectorScheduler(ABC):
    """Scheduler half. Pure Python: never imports torch or a transport."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens loadable from outside beyond num_computed_tokens, whether the load is async)."""

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """Blocks are allocated for the request; remember which of them the load must fill."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> ConnectorMeta:
        """Everything the worker half must do this step; resets the half's per-step state."""

    @abstractmethod
    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free, kv_transfer_params for the response)."""

    def check_params(self, params: KVTransferParams | None) -> None:
        """At admission: ValueError for kv_transfer_params this connector cannot act on (a 400 for the
        request, never an error inside a step)."""

    def request_aborted_while_loading(self, request: "Request") -> None:
        """The request was aborted in WAITING_FOR_REMOTE_KVS: cancel what has not started.
        Its blocks stay allocated until the worker half reports it in finished_recving."""

    def request_added(self, request: "Request") -> None:
        """The request entered the scheduler's queue. D: the KV it will load is held by P under a
        lease; keep that alive for as long as the request queues here."""


class KVConnectorWorker(ABC):
    """Worker half: owns the transport and the registered KV memory."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: Any) -> None:
        """Called once at start-up with the paged KV cache tensor(s)."""

    @abstractmethod
    def start_load_kv(self, meta: ConnectorMeta) -> None:
        """Start (or advance) loads and sends the meta asks for; must not block on the network."""

    def wait_for_save(self) -> None:
        """After the forward pass: make sure KV produced this step is ready to be read remotely."""

    @abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) request ids since the last call."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def get_recompute_request_ids(self) -> set[str]:
        """D: failed loads (their blocks among the load errors) whose prompt this instance computes itself
        whatever kv_load_failure_policy says, because the router moved the computation here (push: its
        prefill hop failed before P wrote anything, as a failed pull prefill is routed straight to a D)."""
        return set()

    def get_first_token_ids(self) -> dict[str, list[int]]:
        """D: the token P sampled after the prompt, for requests whose load is under way or reported in
        this step's finished_recving, where the connector itself brought it (push: P sends it as soon as
        it has it, and its WRITE notification carries it again). Each is reported once. D emits it and
        computes from it, as it does with a pull's first_token_ids, instead of sampling the prompt's last
        position again."""
        return {}

    def get_load_error(self, request_id: str) -> str | None:
        """Why the request's load failed, for the client's error message (once; None if unknown)."""
        return None

    def release_held(self, request_ids: list[str]) -> None:
        """P: no reader will come for these requests (the decode hop failed before D took them):
        free their blocks at the next get_finished instead of at lease expiry."""

    def num_pending_requests(self) -> int:
        """Requests this half still tracks (held, queued, in flight, or to report). While it is
        above zero the engine keeps stepping, also with no request to compute."""
        return 0

    def get_stats(self) -> dict[str, float]:
        """Counters for /metrics (kv_transfer_* names without the prefix)."""
        return {}

    def shutdown(self) -> None:
        pass
