"""Tensor parallelism on CUDA (NCCL, one GPU per rank; needs two GPUs): the CPU identities of
tests/parallel/test_tensor_parallel.py in float32, with CUDA graphs on. Two ranks give one rank's tokens, or
part from them only at a near-tie (the all-reduce sums in another order), and decode steps replay graphs
captured with the collectives inside."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.sampling_params import SamplingParams
from tests.helpers_models import make_tiny_hf_model
from tests.parallel.test_tensor_parallel import assert_same_or_near_tie

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL, a GPU per rank)")]

PROMPTS = [[1, 2, 3, 4, 5], list(range(40, 100)), [7] * 33, list(range(3, 200, 3))]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_gpu")
    return {"llama": make_tiny_hf_model(root, "llama"), "qwen2": make_tiny_hf_model(root, "qwen2")}


def generate(path: str, tp: int) -> tuple[list, list[int]]:
    """(outputs, the decode batch sizes rank 0 replayed as CUDA graphs)."""
    llm = LLM(path, device="cuda", dtype="float32", tensor_parallel_size=tp, block_size=8, num_blocks=256,
              max_num_batched_tokens=64)   # chunked prompts: steps that mix prefill and decode
    try:
        runner = llm.engine.runner.runner if tp > 1 else llm.engine.runner   # (rank 0's ModelRunner)
        graphs = runner.decode_graphs
        assert graphs is not None and graphs.graphs, "decode graphs were not captured"
        replays: list[int] = []
        run = graphs.run
        graphs.run = lambda *a: replays.append(len(a[0])) or run(*a)
        outputs = llm.generate(PROMPTS, GREEDY) + llm.generate(PROMPTS, SEEDED)
        return outputs, replays
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_two_ranks_on_two_gpus_give_one_ranks_tokens_with_cuda_graphs(tiny_paths, name):
    from transformers import AutoModelForCausalLM
    want, _ = generate(tiny_paths[name], 1)
    got, replays = generate(tiny_paths[name], 2)
    assert replays, "no decode step of the two ranks went through a CUDA graph"
    hf = AutoModelForCausalLM.from_pretrained(tiny_paths[name], dtype=torch.float32).eval()
    for w, g in zip(want[:len(PROMPTS)], got[:len(PROMPTS)]):   # greedy: a difference must be a near-tie
        assert_same_or_near_tie(w.token_ids, g.token_ids, w.prompt_token_ids, hf)
    # seeded: the same draws from logits equal to the last bits (as on CPU, where both sets are identical)
    assert [r.token_ids for r in got[len(PROMPTS):]] == [r.token_ids for r in want[len(PROMPTS):]]
