"""The scheduler half of the push handoff (P writes into blocks D announced), for `--kv-connector nixl-push`.

The router sends one request to P and D at once, both carrying one transfer id; neither waits for the
other's HTTP answer. As this half sees it:

  on D (consumer), kv_transfer_params {"do_remote_prefill": true, "transfer_id": T, "remote_engine_id",
  "remote_host", "remote_port", "remote_boot_id"} (P's side channel, from the router's view of P):
    0. request_added: while it queues here without blocks the worker half heartbeats P for T, so P holds
       its computed KV for us (the same keep-alive as pull's, keyed by T)
    1. get_num_new_matched_tokens → (prompt tokens beyond D's own prefix-cache hit, load_async=True):
       P computes the whole prompt, so D asks only for the blocks its cache lacks
    2. update_state_after_alloc → PushRecvSpec: "write P's prompt blocks [first_block, ...) into these";
       the request parks in WAITING_FOR_REMOTE_KVS and the worker half announces the blocks to P
    3. the worker half reports the request in finished_recving when P's WRITE notification arrives, or
       with its blocks invalid when P says it will not write (kv_load_failure_policy applies), never
       while a WRITE may still land in the blocks. The notification carries the token P sampled after
       the prompt: D emits it and computes from it, as a pull D does with P's token, so that its output
       is P's prefill's, not a recomputation of the prompt's last position (which in bfloat16 may pick
       another token on a near-tie)
  on P (producer), kv_transfer_params {"do_remote_decode": true, "transfer_id": T}:
    1. computed like any request (max_tokens=1)
    2. request_finished → delay_free=True and a PushSendSpec (with P's sampled token): the worker half
       writes the blocks D announced for T (now, or when the announce arrives) and reports
       finished_sending when the WRITE is done, failed, or no D announced within a lease
    3. a request that ends without KV (aborted, an error) goes to reqs_not_sent: the worker half tells
       the D that announced T (now or later) that nothing will come
The consumer side reuses pull's KeepAliveSpec (remote_request_id = T) and its release rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.kv_transfer.base import ConnectorMeta, KVConnectorScheduler, KVTransferParams
from pdserve.kv_transfer.pull import KeepAliveSpec

if TYPE_CHECKING:
    from pdserve.core.batch import SchedulerOutput
    from pdserve.core.request import Request


@dataclass(frozen=True)
class PushRecvSpec:
    """D: P writes its prompt blocks [first_block, first_block + len(local_block_ids)) into local_block_ids."""
    request_id: str
    transfer_id: str
    local_block_ids: list[int]
    first_block: int
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_boot_id: str | None = None


@dataclass(frozen=True)
class PushSendSpec:
    """P: the request's prompt blocks, to be written where D announced for transfer_id. first_token_ids:
    the token P sampled after the prompt; it travels in the WRITE's notification, and D starts from it."""
    request_id: str
    transfer_id: str
    block_ids: list[int]
    first_token_ids: tuple[int, ...] = ()


@dataclass
class PushConnectorMeta(ConnectorMeta):
    reqs_to_recv: list[PushRecvSpec] = field(default_factory=list)              # D
    reqs_to_keep_alive: list[KeepAliveSpec] = field(default_factory=list)       # D
    reqs_to_release: list[KeepAliveSpec] = field(default_factory=list)          # D
    reqs_to_cancel: set[str] = field(default_factory=set)                       # D: request ids
    reqs_to_send: list[PushSendSpec] = field(default_factory=list)              # P
    reqs_not_sent: list[tuple[str, str]] = field(default_factory=list)          # P: (request id, transfer id)


def push_params(request: "Request") -> KVTransferParams | None:
    return KVTransferParams.from_dict(request.kv_transfer_params)


class PushConnectorScheduler(KVConnectorScheduler):
    def __init__(self, engine_id: str, block_size: int, is_producer: bool, is_consumer: bool) -> None:
        self.engine_id, self.block_size = engine_id, block_size
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self._meta = PushConnectorMeta()
        self._kept_alive: dict[str, KeepAliveSpec] = {}
        # The transfer ids of live requests, per side: one request per transfer id (a second one is refused
        # at admission: two would share one announce or one WRITE).
        self._live: dict[str, set[str]] = {"decode": set(), "prefill": set()}
        self._transfer_of: dict[str, tuple[str, str]] = {}   # request id → (side, transfer id)

    def _consumer_params(self, request: "Request") -> KVTransferParams | None:
        if not self.is_consumer:
            return None
        params = push_params(request)
        return params if params is not None and params.do_remote_prefill else None

    def _side(self, params: KVTransferParams | None) -> str | None:
        if params is not None and params.do_remote_prefill and self.is_consumer:
            return "decode"
        if params is not None and params.do_remote_decode and self.is_producer:
            return "prefill"
        return None

    def check_params(self, params: KVTransferParams | None) -> None:
        if params is not None and (params.do_remote_prefill or params.do_remote_decode) and not params.transfer_id:
            raise ValueError("kv_transfer_params: the push handoff needs a transfer_id")
        side = self._side(params)
        if side is not None and params.transfer_id in self._live[side]:
            raise ValueError(f"kv_transfer_params: transfer_id {params.transfer_id!r} is already in use here")

    def request_added(self, request: "Request") -> None:
        side = self._side(push_params(request))
        if side is not None:
            transfer_id = request.kv_transfer_params["transfer_id"]
            self._live[side].add(transfer_id)
            self._transfer_of[request.request_id] = (side, transfer_id)
        params = self._consumer_params(request)
        if params is None:
            return
        keep = KeepAliveSpec(request.request_id, params.remote_engine_id, params.transfer_id,
                             params.remote_host, int(params.remote_port), params.remote_boot_id)
        self._kept_alive[request.request_id] = keep
        self._meta.reqs_to_keep_alive.append(keep)

    def _stop_keep_alive(self, request_id: str) -> None:
        keep = self._kept_alive.pop(request_id, None)
        if keep is not None:
            self._meta.reqs_to_release.append(keep)

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._consumer_params(request) is None:
            return 0, False
        num_new = request.num_prompt_tokens - num_computed_tokens
        if num_new <= 0:  # D's own prefix cache covers the prompt: P may free its copy
            self._stop_keep_alive(request.request_id)
            request.kv_transfer_params = None
            return 0, False
        return num_new, True

    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        params = self._consumer_params(request)
        if params is None or num_external_tokens == 0:
            return
        first = request.num_computed_tokens // self.block_size
        last = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        self._meta.reqs_to_recv.append(PushRecvSpec(
            request.request_id, params.transfer_id, list(block_ids[first:last]), first,
            params.remote_engine_id, params.remote_host, int(params.remote_port), params.remote_boot_id))
        self._kept_alive.pop(request.request_id, None)  # the load's own heartbeats take over
        request.kv_transfer_params = None  # consumed: a preempted request recomputes, never loads twice

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> PushConnectorMeta:
        meta, self._meta = self._meta, PushConnectorMeta()
        return meta

    def _end_live(self, request_id: str) -> None:
        side, transfer_id = self._transfer_of.pop(request_id, (None, None))
        if side is not None:
            self._live[side].discard(transfer_id)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._stop_keep_alive(request.request_id)  # D: finished or aborted before its load began
        self._end_live(request.request_id)
        params = request.kv_transfer_params
        if not (self.is_producer and params and params.get("do_remote_decode")):
            return False, None
        transfer_id = params.get("transfer_id")
        if not transfer_id:
            return False, None  # (refused at admission; nothing to tell anyone)
        if request.status.finish_reason is None or request.status.name in ("FINISHED_ABORTED", "FINISHED_ERROR"):
            self._meta.reqs_not_sent.append((request.request_id, transfer_id))
            return False, None
        num_prompt_blocks = -(-request.num_prompt_tokens // self.block_size)
        self._meta.reqs_to_send.append(PushSendSpec(request.request_id, transfer_id, list(block_ids[:num_prompt_blocks]),
                                                    tuple(request.output_token_ids[:1])))
        return True, {"transfer_id": transfer_id, "handoff": "push", "remote_engine_id": self.engine_id,
                      "num_remote_tokens": request.num_prompt_tokens}

    def request_aborted_while_loading(self, request: "Request") -> None:
        self._end_live(request.request_id)
        self._meta.reqs_to_cancel.add(request.request_id)
