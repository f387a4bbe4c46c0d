"""Offline throughput on CPU: pdserve's LLM.generate beside Hugging Face transformers' batched
generate, same weights (the default model's GGUF, dequantized), same prompts, same run.

    .venv/bin/python benchmarks/cpu_offline_throughput.py [--num-prompts 64 --input-len 256 --output-len 128]

Prints both figures and writes benchmarks/results/cpu-offline-<date>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import time
from pathlib import Path

import torch


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 20000) for _ in range(length)] for _ in range(n)]


def run_pdserve(prompts, output_len: int, threads: int) -> dict:
    from pdserve.engine.llm import LLM
    from pdserve.sampling_params import SamplingParams
    llm = LLM("default", num_threads=threads, max_num_seqs=len(prompts))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(r.token_ids) for r in results)
    return {"seconds": elapsed, "output_tokens": num_out, "output_tokens_per_s": num_out / elapsed,
            "token_ids": [r.token_ids for r in results]}


def run_transformers(prompts, output_len: int, threads: int, batch_size: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from pdserve.model.loader import resolve_model_path
    torch.set_num_threads(threads)
    # transformers' own GGUF path (from_pretrained(gguf_file=) minus its accelerate requirement)
    path = resolve_model_path("default")
    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                        local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"],
                          strict=False)
    model.eval()
    outputs = []
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i:i + batch_size])
            out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
            outputs += out[:, batch.shape[1]:].tolist()
    elapsed = time.perf_counter() - start
    num_out = sum(len(o) for o in outputs)
    return {"seconds": elapsed, "output_tokens": num_out, "output_tokens_per_s": num_out / elapsed,
            "token_ids": outputs, "batch_size": batch_size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for both (default: pdserve's, one per allowed core)")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    if args.threads is None:
        from pdserve.worker.cpu_threads import allowed_cores
        args.threads = allowed_cores()
    prompts = random_prompts(args.num_prompts, args.input_len, args.seed)
    ours = run_pdserve(prompts, args.output_len, args.threads)
    print(f"pdserve:      {ours['output_tokens']} tokens in {ours['seconds']:.1f} s = "
          f"{ours['output_tokens_per_s']:.1f} output tokens/s", flush=True)
    hf = run_transformers(prompts, args.output_len, args.threads, args.hf_batch_size)
    print(f"transformers: {hf['output_tokens']} tokens in {hf['seconds']:.1f} s = "
          f"{hf['output_tokens_per_s']:.1f} output tokens/s", flush=True)
    same = sum(a == b for a, b in zip(ours.pop("token_ids"), hf.pop("token_ids")))
    speedup = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
    print(f"speedup: {speedup:.2f}x; identical greedy outputs: {same}/{len(prompts)}")
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} "
              f"{os.cpu_count()} cores (CPU)", "model": "SmolLM2-135M-Instruct Q4_1 GGUF, float32",
              "workload": vars(args), "pdserve": ours, "transformers": hf, "speedup": speedup,
              "identical_outputs": same, "torch": torch.__version__}
    out = Path(args.out or f"benchmarks/results/cpu-offline-{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
