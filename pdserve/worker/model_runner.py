"""SchedulerOutput → tensors → model → sampler → ModelRunnerOutput.

Each step builds the flattened batch (no padding) as Python lists, moves it to the device with
pinned, non-blocking copies, runs the model, samples the rows that asked for a token, and makes one
host sync (an event recorded after sampling). launch() and collect() split a step at that sync so
that the engine can launch the next step first (async scheduling, engine/engine_core.py). On CUDA a
pure-decode step replays a captured graph instead (worker/cuda_graphs.py; off with enforce_eager or
PDSERVE_ENFORCE_EAGER=1). Around the forward pass it drives the connector's worker half; it does so on
every step, also when nothing is scheduled, so KV transfers advance while all requests wait for them.

Under tensor parallelism every rank runs its own ModelRunner on the same SchedulerOutput (the engine's
executor, worker/tp_executor.py, hands it over): the same inputs, the model's collectives in between,
the same logits on every rank. Rank 0 samples and broadcasts the tokens, so each rank's next step
fills its placeholders with the tokens rank 0 reports.
"""
from __future__ import annotations

import functools
import os

import torch

from pdserve.config import CacheConfig, ModelConfig
from pdserve.core.batch import (PLACEHOLDER_TOKEN_ID, KVConnectorOutput, ModelRunnerOutput, ScheduledRequest,
                                SchedulerOutput)
from pdserve.core.kv_cache_manager import cdiv
from pdserve.kv_transfer.base import KVConnectorWorker
from pdserve.model import layers
from pdserve.model.attention import AttentionMetadata
from pdserve.model.host_copy import to_device
from pdserve.model.loader import load_max_model_len, load_model
from pdserve.model.sampler import sample, skip_draws
from pdserve.parallel.group import SINGLE, TPGroup
from pdserve.sampling_params import SamplingParams
from pdserve.worker.cuda_graphs import DecodeGraphs, graph_buckets
from pdserve.worker.kv_cache import allocate_kv_cache


class StepHandle:
    """A launched step: its sampled token ids, on the device for the next step's placeholders and on
    their way to pinned host memory, and an event after its last kernel. wait() is the step's one
    host sync. It waits for the event even when nothing was sampled (a prompt chunk): the scheduler
    frees a finished request's blocks when its step lands, and a remote load (not ordered with this
    engine's stream) may be given them next."""

    def __init__(self, request_ids: list[str], tokens: torch.Tensor | None, host: torch.Tensor | None,
                 ready: torch.cuda.Event | None) -> None:
        self.request_ids, self.tokens, self.host, self.ready = request_ids, tokens, host, ready

    @functools.cached_property
    def row_of(self) -> dict[str, int]:
        """Request id → row of `tokens`; built only when a next step has placeholders to fill."""
        return {request_id: row for row, request_id in enumerate(self.request_ids)}

    @classmethod
    def launched(cls, request_ids: list[str], tokens: torch.Tensor | None, device: torch.device) -> StepHandle:
        if device.type != "cuda":  # CPU ops ran already
            return cls(request_ids, tokens, tokens, None)
        host = None
        if tokens is not None:
            # A .tolist() later would wait for every step queued after this one; the event waits
            # for this step alone.
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(request_ids, tokens, host, ready)

    def wait(self) -> dict[str, int]:
        if self.ready is not None:
            self.ready.synchronize()
        if self.host is None:
            return {}
        return dict(zip(self.request_ids, self.host.tolist()))


NOTHING_LAUNCHED = StepHandle([], None, None, None)


def contiguous_run(values: list[int]) -> slice | None:
    """values (non-empty) as a slice when they are consecutive ascending integers, else None."""
    first = values[0]
    return slice(first, first + len(values)) if values == list(range(first, first + len(values))) else None


def connector_output(connector: KVConnectorWorker, vocab_size: int) -> KVConnectorOutput:
    """The worker half's report after a step (its forward pass done)."""
    connector.wait_for_save()
    finished_sending, finished_recving = connector.get_finished()
    # A token outside the vocabulary would fail the step that computes it: D samples that one itself.
    first_token_ids = {request_id: ids for request_id, ids in connector.get_first_token_ids().items()
                       if all(0 <= t < vocab_size for t in ids)}
    return KVConnectorOutput(finished_sending, finished_recving, connector.get_block_ids_with_load_errors(),
                             connector.get_recompute_request_ids(), first_token_ids)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_and_dtype(config: ModelConfig) -> tuple[torch.device, torch.dtype]:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but no CUDA device is available")
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return torch.device(device), DTYPES[dtype]


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 connector: KVConnectorWorker | None = None, num_blocks: int | None = None,
                 enforce_eager: bool | None = None, max_num_seqs: int = 256, tp: TPGroup = SINGLE,
                 device: torch.device | None = None) -> None:
        self.device, self.dtype = resolve_device_and_dtype(model_config)
        if device is not None:   # a TP rank's own GPU
            self.device = device
        self.block_size = cache_config.block_size
        self.tp = tp
        # Refused before the weights load: past its limit the model meets positions it never saw.
        if model_config.max_model_len is not None and \
                model_config.max_model_len > (limit := load_max_model_len(model_config.model)):
            raise ValueError(f"max_model_len {model_config.max_model_len} is more than this model's limit of "
                             f"{limit} tokens (its max_position_embeddings or sliding window)")
        self.model, self.info = load_model(model_config.model, self.dtype, self.device,
                                           model_config.load_format, model_config.seed, tp)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            layers.prepare_cpu_linear()
        self.kv_cache = allocate_kv_cache(self.info, cache_config, self.dtype, self.device, num_blocks, tp)
        self.num_blocks = self.kv_cache.shape[0]
        self.connector = connector
        if connector is not None:
            connector.register_kv_caches(self.kv_cache)
        self.generators: dict[str, torch.Generator] = {}
        self._generator_states: dict[str, torch.Tensor] = {}  # before each seeded request's last draw
        if enforce_eager is None:
            enforce_eager = os.environ.get("PDSERVE_ENFORCE_EAGER", "0") == "1"
        self.pin_memory = self.device.type == "cuda"
        self.max_model_len = model_config.max_model_len or self.info.max_model_len   # (the engine's too)
        self.max_num_seqs = max_num_seqs
        self.decode_graphs: DecodeGraphs | None = None
        self._previous = NOTHING_LAUNCHED  # the last launched step
        if self.device.type == "cuda" and not enforce_eager:
            self.capture_decode_graphs()

    def capture_decode_graphs(self) -> None:
        self.decode_graphs = None  # the old graphs' memory goes back to the pool first
        self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, self.block_size,
                                          cdiv(self.max_model_len, self.block_size),
                                          graph_buckets(self.max_num_seqs))
        self.decode_graphs.capture()

    @torch.inference_mode()
    def warm_up(self, max_num_batched_tokens: int) -> None:
        """Run the shapes serving will meet before the first request does: a full-budget prefill, a
        mixed prefill + decode step, prefills of 2, 3, 5, 9, ... tokens (kernels pick tile shapes
        by the next power of two of the longest query) and, without CUDA graphs, decode batches.
        On CUDA their first run compiles kernels (Triton, torch.compile), which would otherwise land
        on some client's TTFT, seconds into serving. Writes only into blocks that no request holds yet (the cache is empty at start-up)."""
        if self.device.type != "cuda":
            return
        bs, greedy = self.block_size, SamplingParams(temperature=0.0)
        num_tokens = max(2, min(max_num_batched_tokens, self.max_model_len - 1, self.num_blocks * bs - 2 * bs))
        blocks = list(range(cdiv(num_tokens, bs)))
        steps = [
            [ScheduledRequest("warm-prefill", [0] * num_tokens, 0, blocks, greedy, True)],
            [ScheduledRequest("warm-chunk", [0] * min(17, num_tokens - 1), 1, blocks, greedy, True),
             ScheduledRequest("warm-decode", [0], num_tokens - 1, blocks, greedy, True)],
        ]
        length = 2
        while length < num_tokens:
            steps.append([ScheduledRequest("warm-short", [0] * length, 0, blocks, greedy, True)])
            length = 2 * length - 1  # 2, 3, 5, 9, 17, ...: one length per power-of-two bucket
        if self.decode_graphs is None:  # else capture ran every decode split count already
            for n in graph_buckets(self.max_num_seqs):  # decode kernels choose splits by batch size
                steps.append([ScheduledRequest(f"warm-decode-{i}", [0], num_tokens - 1, blocks, greedy, True)
                              for i in range(n)])
        for scheduled in steps:
            self._run(SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled)))
        torch.cuda.synchronize(self.device)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens."""
        return self.collect(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> StepHandle:
        """Queue the step on the device and return without waiting for it (on CUDA). The engine may
        schedule and launch the next step before collecting this one: that step's placeholder
        tokens are this step's samples, taken on the device."""
        for request_id in out.finished_request_ids:
            self.generators.pop(request_id, None)
            self._generator_states.pop(request_id, None)
        for request_id in out.dropped_sample_ids:
            state = self._generator_states.get(request_id)
            if state is not None:
                self.generators[request_id].set_state(state)
        if self.connector is not None and out.connector_meta is not None:
            self.connector.start_load_kv(out.connector_meta)
        handle = self._launch(out) if not out.is_empty else NOTHING_LAUNCHED
        self._previous = handle
        return handle

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a launched step's sampled tokens (the one host sync of a step); drive the
        connector's worker half."""
        sampled = handle.wait()
        if self.connector is None:
            return ModelRunnerOutput(sampled)
        return ModelRunnerOutput(sampled, connector_output(self.connector, self.info.vocab_size))

    def _run(self, out: SchedulerOutput) -> dict[str, int]:
        return self._launch(out).wait()

    def _launch(self, out: SchedulerOutput) -> StepHandle:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_rows: list[int] = []
        fill_rows: list[int] = []    # input rows whose token the previous step samples
        fill_from: list[int] = []    # ... and which of its sampled rows holds it
        # One-token rows first, decodes before one-token prefill chunks: the attention kernels give the
        # leading one-token rows their own launch (all of them on CUDA; on CPU the decodes only).
        scheduled = sorted(out.scheduled, key=lambda item: (len(item.token_ids) != 1, item.prefill))
        decodes = sum(len(item.token_ids) == 1 and not item.prefill for item in scheduled)
        max_blocks = max(len(item.block_ids) for item in scheduled)
        # Filled row by row through a numpy view (a nested-list torch.tensor costs ~10 us per sequence).
        block_tables = torch.zeros(len(scheduled), max_blocks, dtype=torch.int32, pin_memory=self.pin_memory)
        table_rows = block_tables.numpy()  # [num_seqs, max_blocks], padded with 0
        for row, item in enumerate(scheduled):
            start, n = item.num_computed_tokens, len(item.token_ids)
            if item.token_ids[0] == PLACEHOLDER_TOKEN_ID:
                fill_rows.append(len(input_ids))
                fill_from.append(self._previous.row_of[item.request_id])
            input_ids.extend(item.token_ids)
            span = range(start, start + n)
            positions.extend(span)
            slot_mapping.extend(item.block_ids[p // bs] * bs + p % bs for p in span)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            query_lens.append(n)
            table_rows[row, :len(item.block_ids)] = item.block_ids
            if item.do_sample:
                logits_rows.append(query_start_loc[-1] - 1)
        fill = None
        if fill_rows:
            rows, source = contiguous_run(fill_rows), contiguous_run(fill_from)
            if rows is not None and source is not None:
                # The usual decode step: the same requests in the same order as the step before, so
                # one device copy, with no index lists to upload and no gather kernel.
                fill = (rows, self._previous.tokens[source])
            else:
                fill = (to_device(fill_rows, torch.long, self.device),
                        self._previous.tokens[to_device(fill_from, torch.long, self.device)])

        sample_items = [item for item in scheduled if item.do_sample]
        graphs = self.decode_graphs
        if (graphs is not None and len(input_ids) == len(scheduled)
                and graphs.can_run(len(input_ids), max_blocks)):
            # Pure decode: replay the bucket's graph (logits of every row; decodes all sample).
            logits = graphs.run(input_ids, positions, slot_mapping, seq_lens, block_tables, fill)
            if len(sample_items) != len(scheduled):
                logits = logits[to_device(logits_rows, torch.long, self.device)]
        else:
            md = AttentionMetadata(
                query_start_loc=to_device(query_start_loc, torch.int32, self.device),
                seq_lens=to_device(seq_lens, torch.int32, self.device),
                block_tables=block_tables.to(self.device, non_blocking=True),
                slot_mapping=to_device(slot_mapping, torch.int64, self.device),
                query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, block_size=bs, decodes=decodes)
            ids = to_device(input_ids, torch.long, self.device)
            if fill is not None:
                ids[fill[0]] = fill[1]
            hidden = self.model(ids, to_device(positions, torch.long, self.device), md, self.kv_cache)
            if not logits_rows:
                return StepHandle.launched([], None, self.device)
            logits = self.model.compute_logits(hidden[to_device(logits_rows, torch.long, self.device)])
        if not sample_items:
            return StepHandle.launched([], None, self.device)
        tokens = self._sample(logits, sample_items)
        return StepHandle.launched([item.request_id for item in sample_items], tokens, self.device)

    def _sample(self, logits: torch.Tensor, sample_items: list[ScheduledRequest]) -> torch.Tensor:
        if not self.tp.is_driver:
            return self.tp.broadcast_from_driver(
                torch.empty(len(sample_items), dtype=torch.long, device=self.device))
        sp = [item.sampling_params for item in sample_items]
        try:
            # Host lists let the sampler skip work it can see is not needed (an all-greedy batch is one argmax).
            tokens = sample(logits, [p.temperature for p in sp], [p.top_p for p in sp],
                            [p.top_k for p in sp], [self._generator(item, logits.shape[-1]) for item in sample_items])
        except Exception:
            # The other ranks wait in the broadcast: release them, then fail this step's requests here.
            self.tp.broadcast_from_driver(torch.full((len(sample_items),), -1, dtype=torch.long, device=self.device))
            raise
        return self.tp.broadcast_from_driver(tokens)

    def _generator(self, item, vocab_size: int) -> torch.Generator | None:
        seed = item.sampling_params.seed
        if seed is None or item.sampling_params.is_greedy:
            return None
        gen = self.generators.get(item.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            # A request resumed here with tokens another instance sampled: continue its random stream
            # where that one stopped (a fresh request has none; a preempted one keeps its generator).
            skip_draws(gen, vocab_size, item.num_output_tokens, self.device)
            self.generators[item.request_id] = gen
        self._generator_states[item.request_id] = gen.get_state()  # host-side (seed, offset) on CUDA
        return gen
