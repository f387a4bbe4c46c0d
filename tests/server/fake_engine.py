"""A deterministic stand-in for pdserve.engine.async_engine.AsyncEngine, plus a tiny tokenizer.

Output i of a request with a P-token prompt is token (P + i) % 100 with text "t{token} ", one every
`token_delay_s`. Stop strings end a request with "stop"; max_tokens ends it with "length".
Every call is recorded, and a request the caller stops iterating early shows up in `aborted`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pdserve.outputs import FinishReason, RequestOutput
from pdserve.sampling_params import SamplingParams

WORDS = "hello world the a of is user assistant system : how are you".split()
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")


def make_tiny_tokenizer() -> Any:
    """A whitespace WordLevel tokenizer with a chat template; unknown words become <unk> (id 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@dataclass
class GenerateCall:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: dict | None
    resumed_token_ids: list[int] | None = None


@dataclass
class FakeEngine:
    served_model_name: str = "fake-model"
    max_model_len: int = 64
    tokenizer: Any = None
    token_delay_s: float = 0.002
    kv_transfer_params_out: dict | None = None    # returned on the final output
    num_cached_tokens: int = 0
    error_after: int | None = None                # emit an error output after this many tokens
    raise_after: int | None = None                # raise RuntimeError after this many tokens
    refuse_with: str | None = None                # raise ValueError before the first output
    healthy: bool = True
    vocab_size: int | None = None                 # the server refuses token ids >= this
    extra_stats: dict[str, Any] = field(default_factory=dict)

    calls: list[GenerateCall] = field(default_factory=list)
    running: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)       # closed early by the caller
    abort_calls: list[str] = field(default_factory=list)  # engine.abort(request_id) calls
    load_report_calls: list[int | None] = field(default_factory=list)  # events_after of each call

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 kv_transfer_params: dict | None = None,
                 resumed_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        self.calls.append(GenerateCall(request_id, list(prompt_token_ids), params, kv_transfer_params,
                                       resumed_token_ids))
        return self._generate(request_id, prompt_token_ids, params, len(resumed_token_ids or ()))

    async def _generate(self, request_id: str, prompt_token_ids: list[int],
                        params: SamplingParams, num_resumed: int = 0) -> AsyncIterator[RequestOutput]:
        """A resumed request (num_resumed tokens generated elsewhere) goes on with output num_resumed."""
        if self.refuse_with is not None:
            raise ValueError(self.refuse_with)
        num_prompt = len(prompt_token_ids)
        max_tokens = params.max_tokens or self.max_model_len - num_prompt
        self.running.add(request_id)
        text, num_sent_chars = "", 0
        try:
            for i in range(num_resumed, max_tokens):
                await asyncio.sleep(self.token_delay_s)
                if self.raise_after is not None and i == self.raise_after:
                    raise RuntimeError("fake engine exploded")
                if self.error_after is not None and i == self.error_after:
                    yield RequestOutput(request_id, [], "", num_prompt, i, FinishReason.ERROR,
                                        error="fake KV load failed")
                    self.finished.add(request_id)
                    return
                token_id = (num_prompt + i) % 100
                text += f"t{token_id} "
                finish = FinishReason.LENGTH if i == max_tokens - 1 else None
                stop_at = min((text.find(s) for s in params.stop if s in text), default=-1)
                if stop_at >= 0:
                    text, finish = text[:stop_at], FinishReason.STOP
                new_text, num_sent_chars = text[num_sent_chars:], len(text)
                yield RequestOutput(
                    request_id, [token_id], new_text, num_prompt, i + 1, finish,
                    num_cached_tokens=self.num_cached_tokens,
                    kv_transfer_params=self.kv_transfer_params_out if finish else None)
                if finish is not None:
                    self.finished.add(request_id)
                    return
        finally:
            self.running.discard(request_id)
            if request_id not in self.finished:
                self.aborted.add(request_id)

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)

    def stats(self) -> dict[str, Any]:
        return {"num_requests_running": len(self.running), "num_requests_waiting": 0,
                "kv_cache_usage_perc": 0.25, "prefix_cache_queries_total": 10, "prefix_cache_hits_total": 4,
                "kv_transfer_seconds": {"buckets": [0.01, 0.1, 1.0], "counts": [1, 3, 3], "sum": 0.2,
                                        "count": 4},
                **self.extra_stats}

    def is_healthy(self) -> bool:
        return self.healthy

    def load_report(self, events_after: int | None = None) -> dict[str, Any]:
        """AsyncEngine.load_report's shape, with one stored batch (seq 1) of hashes 11 and 12."""
        self.load_report_calls.append(events_after)
        reset = events_after is None or not 0 <= events_after <= 1
        return {"boot_id": "fake-boot", "kv_role": None, "healthy": self.healthy,
                "health": "ok" if self.healthy else "fake engine is unhealthy",
                "num_requests_running": len(self.running), "num_requests_waiting": 0, **self.extra_stats,
                "kv_events": {"last_seq": 1, "reset": reset, "snapshot": [11, 12] if reset else None,
                              "batches": [] if reset or events_after == 1 else [[1, "stored", [11, 12]]]}}
