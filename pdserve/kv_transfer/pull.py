"""The scheduler half of the pull handoff (D reads P's blocks), shared by every pull transport.

Lifecycle of one disaggregated request, as this half sees it:

  on P (producer), request has kv_transfer_params {"do_remote_decode": true}:
    1. it is scheduled like any request: prompt computed, one token sampled, max_tokens=1
    2. request_finished → delay_free=True, and params for D: do_remote_prefill, remote_engine_id,
       remote_request_id, remote_block_ids, remote_host, remote_port, remote_boot_id (the worker
       half's per-boot nonce), tp_size, num_remote_tokens; the scheduler adds first_token_ids, the
       token P sampled
    3. next build_connector_meta hands the worker half a SendSpec: hold these blocks under a lease
       (lifecycle.LeaseHolder: one D may claim them, once)
    4. the worker half reports the request in finished_sending when D notifies that its READ is
       done, on a release, or when the lease expires (D's claim and heartbeats extend it); the
       scheduler then frees the blocks

  on D (consumer), request has kv_transfer_params {"do_remote_prefill": true, ...}:
    0. request_added: while it queues (D busy, no free blocks) the worker half heartbeats P for it,
       so P's lease outlives any wait; if it ends without a load (D's prefix cache covers it, or it
       finishes or is aborted first) the worker half tells P to release the blocks at once
    1. get_num_new_matched_tokens → (prompt tokens beyond D's own prefix-cache hit, load_async=True)
    2. the scheduler allocates blocks for the whole prompt; update_state_after_alloc pairs each
       local block still to fill with P's block at the same index; the request parks in
       WAITING_FOR_REMOTE_KVS
    3. next build_connector_meta hands the worker half a RecvSpec; the worker half (lifecycle.Loader)
       handshakes with P (once per remote engine and boot), claims the grant, READs, notifies P, and
       reports the request in finished_recving, each wait on P under a deadline (blocks that failed
       come back through get_block_ids_with_load_errors)
    4. the scheduler moves the request back to WAITING with its prompt computed and decodes from
       P's first token, which it sent on admission (without first_token_ids: it recomputes the last
       prompt token for logits, "back off one token")
    5. an abort while waiting goes into reqs_to_cancel; blocks stay allocated until
       finished_recving names the request, so a READ in flight never writes into freed blocks
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.kv_transfer.base import ConnectorMeta, KVConnectorScheduler, KVTransferParams

if TYPE_CHECKING:
    from pdserve.core.batch import SchedulerOutput
    from pdserve.core.request import Request


@dataclass(frozen=True)
class RecvSpec:
    """D: fill local_block_ids[i] with the remote engine's remote_block_ids[i]."""
    request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_boot_id: str | None = None  # P's boot nonce from the params: a restarted P refuses them


@dataclass(frozen=True)
class KeepAliveSpec:
    """D: a request queued here whose KV the remote engine holds for it; heartbeat until its load."""
    request_id: str
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_boot_id: str | None = None


def track_keep_alives(kept_alive: dict[str, KeepAliveSpec], meta: "PullConnectorMeta") -> None:
    """D's worker half, each step: the requests to keep alive after this meta. Keep-alives go first,
    then releases, each of which ends only the keep-alive it names (spec equality: a release may end an
    earlier request under an id a keep-alive in the same meta reuses, and a request added and released
    within one step must leave nothing behind); a request whose READ starts leaves (the READ's own
    heartbeats take over). Sending the releases is the caller's: meta.reqs_to_release."""
    for keep in meta.reqs_to_keep_alive:
        kept_alive[keep.request_id] = keep
    for keep in meta.reqs_to_release:
        if kept_alive.get(keep.request_id) == keep:
            del kept_alive[keep.request_id]
    for spec in meta.reqs_to_recv:
        kept_alive.pop(spec.request_id, None)


@dataclass(frozen=True)
class SendSpec:
    """P: keep block_ids readable for a remote reader until it notifies or the lease expires."""
    request_id: str
    block_ids: list[int]


@dataclass
class PullConnectorMeta(ConnectorMeta):
    reqs_to_recv: list[RecvSpec] = field(default_factory=list)
    reqs_to_send: list[SendSpec] = field(default_factory=list)
    reqs_to_cancel: set[str] = field(default_factory=set)
    reqs_to_keep_alive: list[KeepAliveSpec] = field(default_factory=list)
    # Kept alive, will never load: free P's copy. The spec itself, not the request id: the id may
    # already name a new request (with its own remote KV) in the same meta.
    reqs_to_release: list[KeepAliveSpec] = field(default_factory=list)


class PullConnectorScheduler(KVConnectorScheduler):
    def __init__(self, engine_id: str, host: str, port: int, block_size: int,
                 is_producer: bool, is_consumer: bool, boot_id: str | None = None) -> None:
        self.engine_id = engine_id
        self.boot_id = boot_id  # the worker half's per-boot nonce, handed out with every grant
        self.host = host
        self.port = port
        self.block_size = block_size
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self._reqs_to_recv: list[RecvSpec] = []
        self._reqs_to_send: list[SendSpec] = []
        self._reqs_to_cancel: set[str] = set()
        self._reqs_to_keep_alive: list[KeepAliveSpec] = []
        self._reqs_to_release: list[KeepAliveSpec] = []
        self._kept_alive: dict[str, KeepAliveSpec] = {}  # queued requests the worker half heartbeats

    def _remote_params(self, request: "Request") -> KVTransferParams | None:
        if not self.is_consumer:
            return None
        params = KVTransferParams.from_dict(request.kv_transfer_params)
        return params if params is not None and params.do_remote_prefill else None

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = self._remote_params(request)
        if params is None:
            return 0, False
        num_remote = params.num_remote_tokens or request.num_prompt_tokens
        num_remote = min(num_remote, request.num_prompt_tokens,
                         len(params.remote_block_ids) * self.block_size)
        num_new = num_remote - num_computed_tokens
        # Nothing left to load (D's own prefix cache covers it): compute the rest locally.
        if num_new <= 0:
            self._stop_keep_alive(request.request_id)
            request.kv_transfer_params = None  # released: never load it later (after an eviction)
            return 0, False
        return num_new, True

    def request_added(self, request: "Request") -> None:
        params = self._remote_params(request)
        if params is None:
            return
        keep = KeepAliveSpec(request.request_id, params.remote_engine_id, params.remote_request_id,
                             params.remote_host, int(params.remote_port), params.remote_boot_id)
        self._kept_alive[request.request_id] = keep
        self._reqs_to_keep_alive.append(keep)

    def _stop_keep_alive(self, request_id: str) -> None:
        """The request will not load what P holds for it: P may free it now."""
        keep = self._kept_alive.pop(request_id, None)
        if keep is not None:
            self._reqs_to_release.append(keep)

    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        params = self._remote_params(request)
        if params is None or num_external_tokens == 0:
            return
        first = request.num_computed_tokens // self.block_size
        last = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        self._reqs_to_recv.append(RecvSpec(
            request_id=request.request_id,
            local_block_ids=list(block_ids[first:last]),
            remote_block_ids=list(params.remote_block_ids[first:last]),
            remote_engine_id=params.remote_engine_id,
            remote_request_id=params.remote_request_id,
            remote_host=params.remote_host,
            remote_port=int(params.remote_port),
            remote_boot_id=params.remote_boot_id,
        ))
        self._kept_alive.pop(request.request_id, None)  # the load's own heartbeats take over
        # Consumed: a preempted request must recompute, not load twice.
        request.kv_transfer_params = None

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> PullConnectorMeta:
        meta = PullConnectorMeta(self._reqs_to_recv, self._reqs_to_send, self._reqs_to_cancel,
                                 self._reqs_to_keep_alive, self._reqs_to_release)
        self._reqs_to_recv, self._reqs_to_send, self._reqs_to_cancel = [], [], set()
        self._reqs_to_keep_alive, self._reqs_to_release = [], []
        return meta

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._stop_keep_alive(request.request_id)  # D: finished or aborted before its load began
        params = request.kv_transfer_params
        if not (self.is_producer and params and params.get("do_remote_decode")):
            return False, None
        if request.status.finish_reason is None or request.status.name in (
                "FINISHED_ABORTED", "FINISHED_ERROR"):
            return False, None
        num_prompt_blocks = -(-request.num_prompt_tokens // self.block_size)
        held = list(block_ids[:num_prompt_blocks])
        self._reqs_to_send.append(SendSpec(request.request_id, held))
        return True, KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_block_ids=held,
            remote_host=self.host,
            remote_port=self.port,
            remote_boot_id=self.boot_id,
            tp_size=1,
            transfer_id=params.get("transfer_id"),
            num_remote_tokens=request.num_prompt_tokens,
        ).to_dict()

    def request_aborted_while_loading(self, request: "Request") -> None:
        self._reqs_to_cancel.add(request.request_id)
