"""SchedulerOutput → tensors → model → sampler → ModelRunnerOutput.

Each step builds the flattened batch (no padding) as Python lists, moves it to the device in one
go, runs the model, samples the rows that asked for a token, and makes one host sync (`.tolist()`).
Around the forward pass it drives the connector's worker half; it does so on every step, also when
nothing is scheduled, so KV transfers advance while all requests wait for them.
"""
from __future__ import annotations

import torch

from pdserve.config import CacheConfig, ModelConfig
from pdserve.core.batch import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from pdserve.kv_transfer.base import KVConnectorWorker
from pdserve.model.attention import AttentionMetadata
from pdserve.model.loader import load_model
from pdserve.model.sampler import sample
from pdserve.worker.kv_cache import allocate_kv_cache

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
                 connector: KVConnectorWorker | None = None, num_blocks: int | None = None) -> None:
        self.device, self.dtype = resolve_device_and_dtype(model_config)
        self.block_size = cache_config.block_size
        self.model, self.info = load_model(model_config.model, self.dtype, self.device,
                                           model_config.load_format, model_config.seed)
        self.kv_cache = allocate_kv_cache(self.info, cache_config, self.dtype, self.device, num_blocks)
        self.num_blocks = self.kv_cache.shape[0]
        self.connector = connector
        if connector is not None:
            connector.register_kv_caches(self.kv_cache)
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in out.finished_request_ids:
            self.generators.pop(request_id, None)
        if self.connector is not None and out.connector_meta is not None:
            self.connector.start_load_kv(out.connector_meta)
        sampled: dict[str, int] = {}
        if not out.is_empty:
            sampled = self._run(out)
        if self.connector is None:
            return ModelRunnerOutput(sampled)
        self.connector.wait_for_save()
        finished_sending, finished_recving = self.connector.get_finished()
        return ModelRunnerOutput(sampled, KVConnectorOutput(
            finished_sending, finished_recving, self.connector.get_block_ids_with_load_errors()))

    def _run(self, out: SchedulerOutput) -> dict[str, int]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_rows: list[int] = []
        max_blocks = max(len(item.block_ids) for item in out.scheduled)
        block_tables: list[list[int]] = []
        for item in out.scheduled:
            start, n = item.num_computed_tokens, len(item.token_ids)
            input_ids.extend(item.token_ids)
            span = range(start, start + n)
            positions.extend(span)
            slot_mapping.extend(item.block_ids[p // bs] * bs + p % bs for p in span)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            query_lens.append(n)
            block_tables.append(item.block_ids + [0] * (max_blocks - len(item.block_ids)))
            if item.do_sample:
                logits_rows.append(query_start_loc[-1] - 1)

        dev = self.device
        md = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=torch.tensor(block_tables, dtype=torch.int32).to(dev, non_blocking=True),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64).to(dev, non_blocking=True),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, block_size=bs)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True),
                            torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True),
                            md, self.kv_cache)
        if not logits_rows:
            return {}
        sample_items = [item for item in out.scheduled if item.do_sample]
        logits = self.model.compute_logits(hidden[torch.tensor(logits_rows, device=dev)])
        sp = [item.sampling_params for item in sample_items]
        # Host lists let the sampler skip work it can see is not needed (an all-greedy batch is one argmax).
        token_ids = sample(logits, [p.temperature for p in sp], [p.top_p for p in sp],
                           [p.top_k for p in sp], [self._generator(item) for item in sample_items]).tolist()
        return {item.request_id: t for item, t in zip(sample_items, token_ids)}

    def _generator(self, item) -> torch.Generator | None:
        seed = item.sampling_params.seed
        if seed is None or item.sampling_params.is_greedy:
            return None
        gen = self.generators.get(item.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[item.request_id] = gen
        return gen
