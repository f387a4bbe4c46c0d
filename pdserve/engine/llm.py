"""Offline inference: LLM(...).generate(prompts, SamplingParams) runs the engine in this process."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.outputs import FinishReason
from pdserve.sampling_params import SamplingParams


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None


class LLM:
    def __init__(self, model: str = "default", *, dtype: str = "auto", device: str = "auto",
                 load_format: str = "auto", seed: int = 0, max_model_len: int | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True,
                 kv_cache_memory: int | None = None, num_blocks: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 enable_chunked_prefill: bool = True, async_scheduling: bool | None = None,
                 kv_transfer_config: KVTransferConfig | None = None,
                 num_threads: int | None = None, tensor_parallel_size: int = 1) -> None:
        config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, device=device, load_format=load_format,
                              max_model_len=max_model_len, seed=seed),
            cache=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                              kv_cache_memory=kv_cache_memory),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill,
                                      async_scheduling=async_scheduling),
            kv_transfer=kv_transfer_config or KVTransferConfig(),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            num_threads=num_threads,
        )
        self.engine = EngineCore(config, num_blocks=num_blocks)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return self.tokenizer(prompt).input_ids
        return list(prompt)

    def add(self, prompt: str | list[int], params: SamplingParams,
            kv_transfer_params: dict | None = None) -> GenerationResult:
        request_id = str(next(self._ids))
        ids = self.encode(prompt)
        self.engine.add_request(request_id, ids, params, kv_transfer_params)
        return GenerationResult(request_id, ids)

    def run(self, results: list[GenerationResult]) -> list[GenerationResult]:
        """Step the engine until every given request has finished (and no step is left in flight:
        under async scheduling a step launched for a request that has since stopped still lands)."""
        by_id = {r.request_id: r for r in results}
        pending = set(by_id)
        while pending or self.engine.step_in_flight:
            for out in self.engine.step():
                result = by_id.get(out.request_id)
                if result is None:
                    continue
                result.token_ids += out.new_token_ids
                result.text += out.new_text
                if out.finished:
                    result.finish_reason, result.error = out.finish_reason, out.error
                    result.num_cached_tokens = out.num_cached_tokens
                    result.kv_transfer_params = out.kv_transfer_params
                    pending.discard(out.request_id)
        return results

    def generate(self, prompts: list[str | list[int]] | str,
                 params: SamplingParams | None = None) -> list[GenerationResult]:
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        return self.run([self.add(p, params) for p in prompts])

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def shutdown(self) -> None:
        self.engine.shutdown()
