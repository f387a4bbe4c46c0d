"""Where a small decode step's time goes between the CUDA graph and the engine: host phases of
EngineCore.step() and idle gaps on the GPU, from a profiler trace of consecutive steps.

    PYTHONPATH=$PWD python3 benchmarks/gpu_engine_profile.py --out-dir $OUT [--batch 1]

Llama-3.1-8B shape, bf16, dummy weights, greedy, ~2,048-token contexts, async scheduling (the CUDA
default). Reports: the step time with and without the profiler, the graph replay alone, host seconds
per step by phase (schedule / launch / wait for the previous step / land), GPU busy and idle time per
step, the largest idle gaps with the GPU operations around them, CUDA runtime calls by total time, and
the GPU operations that run outside the graph. Writes gpu-engine-profile-<date>.json.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import tempfile
import time
from pathlib import Path

from gpu_bench import MODEL, gpu_median, machine, random_prompts, timed_steps, today, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from pdserve.engine.llm import LLM
    from pdserve.sampling_params import SamplingParams
    llm = LLM(MODEL, dtype="bfloat16", device="cuda", load_format="dummy", max_num_seqs=max(16, args.batch),
              max_num_batched_tokens=8192, max_model_len=2048 + 512)
    engine, runner = llm.engine, llm.engine.runner
    vocab = runner.model.config.vocab_size
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    ids = [f"p{i}" for i in range(args.batch)]
    for rid, prompt in zip(ids, random_prompts(args.batch, 2040, vocab)):
        engine.add_request(rid, prompt, params)
    requests = [engine.scheduler.requests[rid] for rid in ids]
    while any(r.num_output_tokens < 2 for r in requests):
        engine.step()
    for _ in range(5):
        engine.step()
    result = {"date": today(), "machine": machine(), "batch": args.batch, "steps": args.steps}
    result["step_ms"] = timed_steps(engine, args.steps) * 1e3
    graphs = runner.decode_graphs
    result["graph_replay_ms"] = gpu_median(graphs.graphs[graphs.bucket(args.batch)].replay, 20) * 1e3

    # Host phases: wrap the engine's collaborators for a timed window.
    phases: dict[str, float] = collections.defaultdict(float)

    def wrap(obj, name, phase):
        original = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                phases[phase] += time.perf_counter() - t0
        setattr(obj, name, timed)
        return lambda: delattr(obj, name)
    undo = [wrap(engine.scheduler, "schedule", "schedule"), wrap(runner, "launch", "launch"),
            wrap(runner, "collect", "collect (waits for the step)"),
            wrap(engine.scheduler, "update_from_output", "update_from_output"),
            wrap(engine, "_make_output", "make outputs")]
    total = timed_steps(engine, args.steps) * args.steps
    for u in undo:
        u()
    result["host_ms_per_step"] = {k: v / args.steps * 1e3 for k, v in phases.items()}
    result["host_ms_per_step"]["step total"] = total / args.steps * 1e3

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result["profiled_step_ms"] = timed_steps(engine, args.steps) * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        with gzip.open(args.out_dir / f"gpu-engine-profile-trace-b{args.batch}.json.gz", "wt") as f:
            json.dump(trace, f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                 key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in gpu)
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    gaps = []
    end = gpu[0]["ts"] + gpu[0]["dur"]
    for prev, e in zip(gpu, gpu[1:]):
        gap = e["ts"] - end
        if gap > 2.0:
            gaps.append({"gap_us": gap, "after": prev["name"][:80], "before": e["name"][:80]})
        end = max(end, e["ts"] + e["dur"])
    idle_by_pair = collections.Counter()
    for g in gaps:
        idle_by_pair[(g["after"], g["before"])] += g["gap_us"]
    result["gpu"] = {"busy_ms_per_step": busy / args.steps / 1e3, "span_ms_per_step": span / args.steps / 1e3,
                     "idle_gaps_over_2us_ms_per_step": sum(g["gap_us"] for g in gaps) / args.steps / 1e3,
                     "num_gpu_ops_per_step": len(gpu) / args.steps,
                     "idle_us_per_step_by_neighbours": [
                         {"after": a, "before": b, "us_per_step": v / args.steps}
                         for (a, b), v in idle_by_pair.most_common(15)]}
    runtime = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and "dur" in e:
            runtime[e["name"]][0] += 1
            runtime[e["name"]][1] += e["dur"]
    result["cuda_runtime_per_step"] = sorted(
        ({"name": k, "calls": v[0] / args.steps, "us": v[1] / args.steps} for k, v in runtime.items()),
        key=lambda r: -r["us"])[:20]
    # GPU ops not launched by cudaGraphLaunch: matched by correlation id to their runtime call.
    launcher = {e["args"].get("correlation"): e["name"] for e in events
                if e.get("cat") == "cuda_runtime" and "args" in e}
    outside = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu:
        via = launcher.get(e.get("args", {}).get("correlation"), "?")
        if via != "cudaGraphLaunch":
            outside[f"{e['name'][:70]} via {via}"][0] += 1
            outside[f"{e['name'][:70]} via {via}"][1] += e["dur"]
    result["gpu_ops_outside_graph_per_step"] = sorted(
        ({"op": k, "count": v[0] / args.steps, "us": v[1] / args.steps} for k, v in outside.items()),
        key=lambda r: -r["us"])[:25]
    engine.abort(ids)
    while engine.has_work():
        engine.step()
    write_json(args.out_dir, f"gpu-engine-profile-b{args.batch}-{today()}.json", result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
