"""Fixtures shared across test packages: the default model's transformers reference."""
from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist (the README's test command runs two workers): each worker, and every server it
    starts, keeps to a core of its own. Two workers' engines would otherwise each run one OpenMP thread
    per core, and threads that outnumber cores wait on descheduled peers (docs/benchmarks.md, Threads)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        if count > 1 and len(cores) >= count:
            share = len(cores) // count
            index = int(worker[2:])
            os.sched_setaffinity(0, cores[index * share:(index + 1) * share])
            torch.set_num_threads(share)


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own GGUF path (its config mapping and Q/K un-permutation) for the default
    model: an independent fp32 reference. from_pretrained(gguf_file=) minus accelerate."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pdserve.model.loader import resolve_model_path
    path = resolve_model_path("default")
    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                        local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    return model.eval()


@pytest.fixture(scope="session")
def default_llm():
    from pdserve.engine.llm import LLM
    llm = LLM("default", kv_cache_memory=256 << 20)
    yield llm
    llm.shutdown()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids=()) -> list[int]:
    """transformers' greedy continuation, cut at the first EOS (kept), like the engine."""
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0,
                             eos_token_id=list(eos_token_ids) or None)
    tokens = out[0, len(prompt_ids):].tolist()
    for i, t in enumerate(tokens):
        if t in eos_token_ids:
            return tokens[:i + 1]
    return tokens
