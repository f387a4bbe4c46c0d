"""Where a CPU step's time goes, by the model's parts: wall time inside the linear layers, attention,
RMSNorm, SwiGLU, rotary + KV write and the LM head, against the whole step, on the default model
(float32). Two kinds of step:
  prefill  one prompt of --input-len tokens alone (`LLM.generate`, max_tokens 1), --repeats of them
  decode   --batch sequences of --input-len prompt tokens, every one decoding, --repeats steps

    .venv/bin/python benchmarks/cpu_step_breakdown.py prefill [--input-len 256] [--out F.json]
    .venv/bin/python benchmarks/cpu_step_breakdown.py decode [--batch 64] [--input-len 256] [--out F.json]

The parts are timed by wrapping the model's functions with a timer (time.perf_counter around each
call); on CPU every kernel finishes before it returns, so the wall times add up.
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np

import pdserve.model.llama as llama
from pdserve.engine.llm import LLM
from pdserve.sampling_params import SamplingParams

PARTS = collections.defaultdict(float)


def _timed(fn, part: str):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS[part] += time.perf_counter() - start
    return run


def instrument() -> None:
    for name in ("paged_attention", "rope_and_write_kv", "silu_and_mul"):
        setattr(llama, name, _timed(getattr(llama, name), name))
    for cls, method, part in ((llama.RMSNorm, "forward", "rms_norm"), (llama.Linear, "forward", "linear"),
                              (llama.LlamaModel, "forward", "model_forward"),
                              (llama.LlamaModel, "compute_logits", "lm_head")):
        setattr(cls, method, _timed(getattr(cls, method), part))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=["prefill", "decode"])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=None, help="prompts (prefill, default 8) or steps (decode, 40)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    instrument()
    llm = LLM("default", dtype="float32", enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    prompt = lambda: rng.integers(100, 49152, size=args.input_len).tolist()   # noqa: E731
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    if args.kind == "prefill":
        repeats = args.repeats or 8
        for _ in range(3):
            llm.generate([prompt()], greedy)
        prompts = [prompt() for _ in range(repeats)]
        PARTS.clear()
        start = time.perf_counter()
        for p_ in prompts:
            llm.generate([p_], greedy)
    else:
        repeats = args.repeats or 40
        engine = llm.engine
        for i in range(args.batch):
            engine.add_request(f"r{i}", prompt(), SamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True))
        while any(r.num_output_tokens < 2 for r in engine.scheduler.requests.values()):
            engine.step()
        for _ in range(5):
            engine.step()
        PARTS.clear()
        start = time.perf_counter()
        for _ in range(repeats):
            engine.step()
    per = (time.perf_counter() - start) / repeats
    result = {"kind": args.kind, "input_len": args.input_len, "batch": 1 if args.kind == "prefill" else args.batch,
              "repeats": repeats, "step_ms": round(per * 1e3, 2),
              "parts_ms": {k: round(v / repeats * 1e3, 2) for k, v in sorted(PARTS.items(), key=lambda kv: -kv[1])}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
