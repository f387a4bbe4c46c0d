"""The whole engine on CUDA (Triton attention + decode CUDA graphs) against Hugging Face transformers
on tiny random models: token-identical greedy output in float32, and >= 99% next-token agreement in
bfloat16 under teacher forcing."""
from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.model import attention
from pdserve.model.loader import load_model
from pdserve.sampling_params import SamplingParams
from tests.helpers_models import PagedRunner, make_tiny_hf_model

pytestmark = pytest.mark.gpu
EOS_IDS = [258, 256]  # the tiny models' generation_config


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_gpu")
    return {arch: make_tiny_hf_model(root, arch) for arch in ("llama", "qwen2", "qwen3")}


def hf_model(path, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fp32_greedy_identical_to_transformers(tiny_paths, arch):
    prompts = prompts_of([3, 17, 40, 1, 64, 9, 23, 31, 5, 70])
    max_tokens = 24
    hf = hf_model(tiny_paths[arch], torch.float32)
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_tokens, pad_token_id=0, eos_token_id=EOS_IDS)
            tokens = out[0, len(p):].tolist()
            ends = [i for i, t in enumerate(tokens) if t in EOS_IDS]
            expected.append(tokens[:ends[0] + 1] if ends else tokens)
    assert sum(len(e) for e in expected) >= len(prompts) * max_tokens // 2  # mostly full length
    llm = LLM(tiny_paths[arch], device="cuda", dtype="float32", block_size=8, num_blocks=256,
              max_num_batched_tokens=64)  # prompts split into chunks over cached prefixes
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.graphs, "decode graphs were not captured"
    replays = []
    run = graphs.run
    graphs.run = lambda *a: replays.append(len(a[0])) or run(*a)
    results = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    assert replays, "no decode step went through a CUDA graph"
    got = [r.token_ids[:len(e)] for r, e in zip(results, expected)]  # we ignore EOS; HF stops there
    assert got == expected, [(i, g, e) for i, (g, e) in enumerate(zip(got, expected)) if g != e]


def test_bf16_teacher_forced_agreement(tiny_paths):
    """8 sequences: a prefill of 16..40 tokens, then every next true token fed as a decode step (the
    decode kernel with split-K); argmax at every position vs transformers in bfloat16 (the agreement
    with transformers in float32 is printed: on this 64-wide model bf16 rounding alone costs ~3%)."""
    path = tiny_paths["llama"]
    seqs = prompts_of([128] * 8, seed=1)
    prefill_lens = [16, 40, 23, 31, 17, 33, 25, 39]
    with torch.inference_mode():
        ref32 = hf_model(path, torch.float32)(torch.tensor(seqs, device="cuda")).logits.argmax(-1)  # [8, 128]
        ref = hf_model(path, torch.bfloat16)(torch.tensor(seqs, device="cuda")).logits.argmax(-1)
    model, _ = load_model(path, torch.bfloat16, torch.device("cuda"))
    runner = PagedRunner(model, num_blocks=8 * 17, block_size=8)
    tables = [runner.blocks_for(128) for _ in seqs]
    logits = runner.step([s[:n] for s, n in zip(seqs, prefill_lens)], prefill_lens, tables)
    ends = torch.tensor(prefill_lens).cumsum(0) - 1
    agree = total = agree32 = 0
    starts = [0] + ends.add(1).tolist()[:-1]
    for i, (n, start) in enumerate(zip(prefill_lens, starts)):
        ours = logits[start:start + n].argmax(-1)
        agree += int((ours == ref[i, :n]).sum())
        agree32 += int((ours == ref32[i, :n]).sum())
        total += n
    positions = list(prefill_lens)
    while min(positions) < 128:
        live = [i for i in range(8) if positions[i] < 128]
        step = runner.step([[seqs[i][positions[i]]] for i in live], [positions[i] + 1 for i in live],
                           [tables[i] for i in live]).argmax(-1)
        for row, i in enumerate(live):
            agree += int(step[row] == ref[i, positions[i]])
            agree32 += int(step[row] == ref32[i, positions[i]])
            total += 1
            positions[i] += 1
    rate = agree / total
    print(f"bf16 teacher-forced next-token agreement with transformers: bf16 {rate:.4f} ({agree}/{total}), "
          f"fp32 {agree32 / total:.4f}")
    assert total == 8 * 128
    assert rate >= 0.99


def test_triton_and_reference_paths_give_the_same_fp32_logits(tiny_paths, monkeypatch):
    from pdserve.model import triton_attention
    assert triton_attention.is_available()  # else "triton" would quietly run the reference path
    calls = []
    kernel = triton_attention.paged_attention_triton
    monkeypatch.setattr(triton_attention, "paged_attention_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    model, _ = load_model(tiny_paths["qwen3"], torch.float32, torch.device("cuda"))
    seqs = prompts_of([37, 5, 64, 12])
    out = {}
    for backend in ("reference", "triton"):
        attention.BACKEND = backend
        try:
            runner = PagedRunner(model, num_blocks=64, block_size=8)
            tables = [runner.blocks_for(70) for _ in seqs]
            first = runner.step([s[:-3] for s in seqs], [len(s) - 3 for s in seqs], tables)
            mixed = runner.step([s[-3:-1] if i % 2 else s[-3:-2] for i, s in enumerate(seqs)],
                                [len(s) - 1 if i % 2 else len(s) - 2 for i, s in enumerate(seqs)], tables)
            out[backend] = torch.cat([first, mixed])
        finally:
            attention.BACKEND = "auto"
    assert calls, "the triton backend never ran the Triton kernel"
    torch.testing.assert_close(out["triton"], out["reference"], atol=2e-4, rtol=2e-4)


def _compiled_variants() -> dict[str, int]:
    """How many variants of each Triton kernel this process has compiled (JITFunction.device_caches:
    device -> (kernel_cache, ...))."""
    from pdserve.model import triton_argmax, triton_linear, triton_norm
    from pdserve.model import triton_attention as ta
    kernels = {"attn": ta._attn_kernel, "reduce": ta._reduce_kernel, "rope_write_kv": ta._rope_write_kv_kernel,
               "gemv": triton_linear._gemv_kernel, "rms_norm": triton_norm._rms_norm_kernel,
               "chunk_argmax": triton_argmax._chunk_argmax_kernel, "row_argmax": triton_argmax._row_argmax_kernel}
    return {name: sum(len(entry[0]) for entry in k.device_caches.values()) for name, k in kernels.items()}


def test_serving_new_batch_shapes_after_start_up_compiles_nothing(tiny_paths, monkeypatch):
    """A compile met while serving stalls one step for about a second (seen as a 2 s TTFT stall in
    the first P/D run). Start-up warms every tile shape; batch size and block-table width are not
    specialized on."""
    from pdserve.model import layers, triton_linear
    # This 64-wide model is too narrow for the small-batch matmul to be chosen (enough_programs):
    # route it there anyway, so that its warm-up is checked too.
    monkeypatch.setattr(triton_linear, "enough_programs", lambda *args, **kwargs: True)
    monkeypatch.setattr(layers, "SMALL_BATCH_TRITON_LINEAR", True)
    llm = LLM(tiny_paths["llama"], device="cuda", dtype="bfloat16", block_size=16, num_blocks=512)
    before = _compiled_variants()
    assert all(count > 0 for count in before.values()), before  # every kernel ran at start-up
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, ignore_eos=True)
    for lengths in ([1], [5, 16], [17, 33, 100], [3] * 16, [2, 7, 31, 64, 129, 200] * 3, [250]):
        llm.generate(prompts_of(lengths, seed=len(lengths)), greedy)  # 1..18 sequences, 1..14 blocks wide
    llm.generate(prompts_of([4, 40], seed=1), sampled)  # sampling ends in the same argmax kernels
    assert _compiled_variants() == before
    llm.shutdown()


def test_async_scheduling_gives_the_synchronous_tokens(tiny_paths):
    """On CUDA the engine schedules step N+1 while step N runs (placeholders filled on the device,
    through the decode graphs and the eager path alike): same tokens as the synchronous loop."""
    llm = LLM(tiny_paths["llama"], device="cuda", dtype="float32", block_size=8, num_blocks=256,
              max_num_batched_tokens=64)
    assert llm.engine.async_scheduling  # the CUDA default
    prompts = prompts_of([3, 17, 40, 1, 64, 9, 23, 31, 5, 70], seed=3)
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0) for i in range(6)] + [
        SamplingParams(max_tokens=30, temperature=0.9, top_p=0.8, seed=11),
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[prompts[7][0]]),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)]

    def run():
        return [r.token_ids for r in llm.run([llm.add(p, sp) for p, sp in zip(prompts, params)])]
    fills = []
    graphs_run = llm.engine.runner.decode_graphs.run
    llm.engine.runner.decode_graphs.run = lambda *a: fills.append(a[5] is not None) or graphs_run(*a)
    asynchronous = run()
    assert any(fills), "no graph replay took its input tokens from the step before on the device"
    llm.engine.async_scheduling = False
    assert run() == asynchronous


def test_a_step_that_samples_nothing_is_still_waited_for(tiny_paths):
    """A prompt chunk samples no token, but landing its step must still wait for its kernels: the
    scheduler frees blocks when a step lands, and a remote load may be given them next."""
    from pdserve.core.batch import ScheduledRequest, SchedulerOutput
    llm = LLM(tiny_paths["llama"], device="cuda", dtype="float32", block_size=8, num_blocks=64)
    runner = llm.engine.runner
    chunk = ScheduledRequest("chunk", list(range(40)), 0, list(range(5)), SamplingParams(), do_sample=False)
    handle = runner.launch(SchedulerOutput([chunk], 40))
    assert handle.ready is not None and not handle.request_ids
    assert runner.collect(handle).sampled_token_ids == {}
    assert handle.ready.query()
