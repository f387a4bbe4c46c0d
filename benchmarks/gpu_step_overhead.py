"""What a decode step pays outside its CUDA graph, piece by piece, on the 8B shape.

    PYTHONPATH=$PWD python3 benchmarks/gpu_step_overhead.py --out-dir $OUT

Times back-to-back iterations (the host queues them all, as async scheduling does, then one sync) of:
the graph replay alone; the replay after its input copies (DecodeGraphs.run); after the copies and
the placeholder fill the engine does; after a small kernel or one memcpy alone (is the cost the copy
engine or any op?); after the inputs staged by a kernel that reads pinned host memory directly
(zero-copy: no copy engine). Then, each in a CUDA graph: the greedy argmax over the vocabulary
(torch, two passes of torch ops, model/triton_argmax.py) at batch 1, 64, 256, and the residual add +
RMSNorm (the torch.compile kernel, model/triton_norm.py) at 1 to 8,192 rows. Last, EngineCore.step()
at batch 1 before and after session 5's changes (64 splits of 64-token tiles, the argmax, the
placeholder fill as one copy, the RMSNorm kernel), added one at a time and alternated over two
rounds, below and just past 2,048 tokens of context.
Writes gpu-step-overhead-<date>.json.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl

from pdserve.model import layers, triton_argmax, triton_norm

from gpu_bench import MODEL, graph_median, machine, random_prompts, timed_steps, today, write_json


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def kernel_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst.copy_(src) by a kernel; src may be pinned host memory (read over PCIe by the SMs)."""
    n = src.numel()
    _copy_kernel[(triton.cdiv(n, 1024),)](src, dst, n, BLOCK=1024)


def two_pass_argmax(logits: torch.Tensor, chunks: int = 256) -> torch.Tensor:
    """Session 5 run 1's greedy argmax at <= 16 rows, in torch ops: the first maximum of each of 256
    chunks, then the first chunk holding the row's maximum (the vocabulary a multiple of 256)."""
    rows, vocab_size = logits.shape
    width = vocab_size // chunks
    values, within = logits.view(rows, chunks, width).max(dim=-1)
    best = values.argmax(dim=-1, keepdim=True)
    return (best * width + within.gather(1, best)).squeeze(1)


def per_iteration_ms(fn, iters: int = 60) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--context", type=int, default=2040)
    args = parser.parse_args()
    from pdserve.engine.llm import LLM
    from pdserve.model import sampler
    from pdserve.sampling_params import SamplingParams

    llm = LLM(MODEL, dtype="bfloat16", device="cuda", load_format="dummy", max_num_seqs=64,
              max_num_batched_tokens=8192, max_model_len=args.context + 512)
    engine, runner = llm.engine, llm.engine.runner
    graphs, bs = runner.decode_graphs, runner.block_size
    vocab = runner.model.config.vocab_size
    result = {"date": today(), "machine": machine(), "context": args.context, "replay": {}, "argmax_us": {},
              "engine_step_ms": {}}

    blocks_per_seq = triton.cdiv(args.context + 1, bs)
    for batch in (1, 64):
        # Inputs of a decode batch on distinct blocks (the cache is empty: nothing is overwritten that matters).
        tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
        tables = tables.pin_memory()
        ids, pos = [7] * batch, [args.context] * batch
        slots = [int(tables[r, -1]) * bs + args.context % bs for r in range(batch)]
        lens = [args.context + 1] * batch
        graph = graphs.graphs[graphs.bucket(batch)]
        previous = torch.full((batch,), 5, dtype=torch.long, device="cuda")

        def run():
            graphs.run(ids, pos, slots, lens, tables)

        def run_fill():
            rows = torch.tensor(list(range(batch)), pin_memory=True).cuda(non_blocking=True)
            src = torch.tensor(list(range(batch)), pin_memory=True).cuda(non_blocking=True)
            graphs.run(ids, pos, slots, lens, tables, (rows, previous[src]))

        scratch = torch.zeros(16, dtype=torch.long, device="cuda")
        host_one = torch.zeros(16, dtype=torch.long).pin_memory()

        def kernel_then_replay():
            scratch.add_(1)
            graph.replay()

        def memcpy_then_replay():
            scratch.copy_(host_one, non_blocking=True)
            graph.replay()

        size = graphs.bucket(batch)
        packed = torch.tensor(ids + pos + slots, dtype=torch.long).pin_memory()
        lens_host = torch.tensor(lens, dtype=torch.int32).pin_memory()

        # The static block table is [max batch, max width]: stage whole rows from a pinned image.
        table_image = torch.zeros(batch, graphs.max_blocks_per_seq, dtype=torch.int32).pin_memory()
        table_image[:, :blocks_per_seq] = tables

        def zero_copy_inputs_then_replay():
            kernel_copy(packed, graphs.token_inputs[:3 * size])
            kernel_copy(lens_host, graphs.seq_lens[:size])
            kernel_copy(table_image, graphs.block_tables[:batch])
            graph.replay()

        run()  # the static buffers hold this batch's inputs from here on
        variants = {"replay alone": graph.replay, "DecodeGraphs.run (3 copies + replay)": run,
                    "run with the placeholder fill (engine path)": run_fill,
                    "one small kernel + replay": kernel_then_replay,
                    "one small H2D memcpy + replay": memcpy_then_replay,
                    "inputs staged by zero-copy kernels + replay": zero_copy_inputs_then_replay}
        rows = {}
        for _ in range(2):  # two rounds, interleaved, against drift
            for name, fn in variants.items():
                rows.setdefault(name, []).append(per_iteration_ms(fn))
        result["replay"][str(batch)] = {name: min(v) for name, v in rows.items()}
        print(batch, result["replay"][str(batch)], flush=True)

    for batch in (1, 64, 256):
        logits = torch.randn(batch, vocab, device="cuda")
        ref = logits.argmax(-1)
        assert torch.equal(two_pass_argmax(logits), ref) and torch.equal(triton_argmax.argmax_triton(logits), ref)
        result["argmax_us"][str(batch)] = {
            "torch.argmax": graph_median(lambda: logits.argmax(-1), 50) * 1e6,
            "two passes of torch ops (session 5 run 1)": graph_median(lambda: two_pass_argmax(logits), 50) * 1e6,
            "triton_argmax (now)": graph_median(lambda: triton_argmax.argmax_triton(logits), 50) * 1e6}
        print(batch, result["argmax_us"][str(batch)], flush=True)

    hidden = runner.model.config.hidden_size
    result["rms_norm_us"] = {}
    for rows in (1, 64, 256, 8192):
        x, residual = (torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        result["rms_norm_us"][str(rows)] = {
            "torch.compile add_rms_norm": graph_median(lambda: layers.add_rms_norm(x, residual, weight, 1e-5), 50) * 1e6,
            "triton_norm (now)": graph_median(lambda: triton_norm.rms_norm_triton(x, weight, 1e-5, residual), 50) * 1e6}
        print(rows, result["rms_norm_us"][str(rows)], flush=True)

    # EngineCore.step() at batch 1, in two context windows (below 2,048 tokens, and just past it where
    # a 128-token split walked a second tile), before and after session 5's changes, one at a time.
    from pdserve.model import triton_attention as ta
    from pdserve.worker import model_runner
    new_split = (ta.MAX_SPLITS, dict(ta.DECODE_SPLIT_CONFIG))
    old_split = (16, {"BLOCK_N": 128, "num_warps": 2, "num_stages": 1})
    triton_rows, contiguous_run = sampler.argmax_rows, model_runner.contiguous_run
    torch_argmax = lambda logits: logits.argmax(dim=-1)  # noqa: E731
    two_pass = lambda logits: two_pass_argmax(logits) if logits.shape[0] <= 16 else logits.argmax(-1)  # noqa: E731
    no_run = lambda values: None  # noqa: E731
    variants = {  # cumulative: (splits, Triton RMSNorm, argmax, fill)
        "session 4: 16 splits x 128-token tiles, torch.argmax, indexed fill": (old_split, False, torch_argmax, no_run),
        "+ 64 splits x 64-token tiles": (new_split, False, torch_argmax, no_run),
        "+ two-pass argmax": (new_split, False, two_pass, no_run),
        "+ placeholder fill as one copy (session 5 run 1)": (new_split, False, two_pass, contiguous_run),
        "+ triton_argmax instead of two passes": (new_split, False, triton_rows, contiguous_run),
        "+ triton_norm (now)": (new_split, True, triton_rows, contiguous_run),
    }
    params = SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True)
    engine.add_request("b1", random_prompts(1, 1840, vocab)[0], params)
    request = engine.scheduler.requests["b1"]
    while request.num_output_tokens < 2:
        engine.step()

    captured = None
    for window in ("1850-2040", "2060-2250"):
        low = int(window.split("-")[0])
        while request.num_tokens < low:
            engine.step()
        times = {name: [] for name in variants}
        for _ in range(2):
            for name, (split, norm, argmax, fill) in variants.items():
                if (split, norm) != captured:
                    torch.cuda.synchronize()  # the step in flight has run: its graph can go
                    ta.MAX_SPLITS, ta.DECODE_SPLIT_CONFIG = split[0], dict(split[1])
                    layers.TRITON_RMS_NORM = norm
                    runner.capture_decode_graphs()
                    captured = (split, norm)
                sampler.argmax_rows, model_runner.contiguous_run = argmax, fill
                timed_steps(engine, 3)
                times[name].append(timed_steps(engine, 10) * 1e3)
        result["engine_step_ms"][window] = {"rounds": times, "min": {k: min(v) for k, v in times.items()},
                                            "context_after": request.num_tokens}
        print(window, result["engine_step_ms"][window]["min"], flush=True)
    ta.MAX_SPLITS, ta.DECODE_SPLIT_CONFIG = new_split[0], dict(new_split[1])
    layers.TRITON_RMS_NORM = True
    sampler.argmax_rows, model_runner.contiguous_run = triton_rows, contiguous_run
    engine.abort(["b1"])
    write_json(args.out_dir, f"gpu-step-overhead-{today()}.json", result)


if __name__ == "__main__":
    main()
