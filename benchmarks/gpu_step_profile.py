"""Engine step times on one GPU over a grid of batch shapes: the profile `pdserve plan` simulates with.

    PYTHONPATH=$PWD python3 benchmarks/gpu_step_profile.py --out-dir $OUT [--quick]

Llama-3.1-8B shape, bf16, dummy weights, the engine as `pdserve serve` runs it (async scheduling, CUDA
graphs, a 9,216-token budget, up to 512 sequences: the configuration of the issue 5 comparison). Three
kinds of step, each timed as the wall time of EngineCore.step() calls between two device syncs (decode
steps with async scheduling, as served; a step with a prefill synchronously, so that the one timed step
is the one that holds the prompt):
  prefill  one fresh prompt of P tokens, alone in its step (P = 256 .. 8,192)
  decode   B sequences of about C tokens each, every one decoding (B x C up to ~600 K tokens of KV)
  mixed    B decoding sequences of about C tokens plus one fresh prompt of P tokens in the same step
  (with --mixed-lengths LO HI) decode batches whose contexts differ, drawn from [LO, HI]
  (with --decode-sweep LO:HI:B1/B2/...) decode-only steps only: max(B) sequences with contexts drawn from
  [LO, HI] are prefilled once, then timed at each batch size B, largest first, the sequences past B aborted
  between points (batches between CUDA-graph buckets without a prefill each); --repeats runs the sweeps
  again with new draws, --windows times each point over that many windows of 10 steps, and --deadline
  stops before a sweep that would not end in time. Writes gpu-decode-grid-<date>.json after every point.
Writes gpu-step-profile-<date>.json: every point (its prefill tokens, the prefill's attention work
sum(chunk x context), decode batch, the decodes' summed context, step seconds), and the fit of
pdserve/planner/profile.py over them.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from gpu_bench import MODEL, machine, timed_steps as sync_steps, today, write_json
from pdserve.engine.llm import LLM
from pdserve.planner.profile import StepPoint, fit_step_model
from pdserve.sampling_params import SamplingParams


def prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 100000) for _ in range(n)]


def drain(engine, ids: list[str]) -> None:
    engine.abort(ids)
    while engine.has_work():
        engine.step()


def prefill_point(engine, length: int, rng: random.Random, tag: str) -> StepPoint:
    engine.async_scheduling = False
    times = []
    for i in range(3):
        rid = f"{tag}-p{length}-{i}"
        engine.add_request(rid, prompt(length, rng), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        times.append(sync_steps(engine, 1))
        while engine.has_work():
            engine.step()
    engine.async_scheduling = True
    return StepPoint(prefill_tokens=length, prefill_attention=length * (length + 1) // 2, decode_batch=0,
                     decode_context=0, seconds=sorted(times)[1])


def decoding(engine, contexts: list[int], rng: random.Random, tag: str) -> tuple[list[str], list]:
    ids = [f"{tag}-d{len(contexts)}x{max(contexts)}-{i}" for i in range(len(contexts))]
    params = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    for rid, context in zip(ids, contexts):
        engine.add_request(rid, prompt(context, rng), params)
    requests = [engine.scheduler.requests[rid] for rid in ids]
    while any(r.num_output_tokens < 2 for r in requests):
        engine.step()
    return ids, requests


def decode_point(engine, requests) -> StepPoint:
    """Ten decode-only steps of `requests` after three to settle: context is taken halfway through."""
    sync_steps(engine, 3)
    ctx = sum(r.num_tokens for r in requests)
    longest = max(r.num_tokens for r in requests)
    seconds = sync_steps(engine, 10)
    return StepPoint(0, 0, len(requests), ctx + 5 * len(requests), seconds, decode_max_context=longest + 5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--quick", action="store_true", help="a few points only (a smoke run)")
    p.add_argument("--mixed-lengths", type=int, nargs=2, metavar=("LO", "HI"),
                   help="also decode batches of 8-128 sequences whose contexts are drawn uniformly from [LO, HI]"
                        " (a step lasts as long as its longest sequence's attention: docs/planner.md)")
    p.add_argument("--decode-only", metavar="B:LO:HI,...",
                   help="measure only these decode batches (B sequences, contexts uniform in [LO, HI]) and fit"
                        " nothing: a check of single points against a profile")
    p.add_argument("--decode-sweep", metavar="LO:HI:B1/B2/...,...",
                   help="decode-only steps at every batch B of each sweep (contexts uniform in [LO, HI], one"
                        " prefill per sweep), and fit nothing")
    p.add_argument("--repeats", type=int, default=1, help="--decode-sweep: run the sweeps this many times")
    p.add_argument("--windows", type=int, default=3, help="--decode-sweep: windows of 10 steps per point")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="--decode-sweep: seconds from the start after which no sweep is begun that its last"
                        " run says would not end in time (0: none)")
    args = p.parse_args()
    started = time.perf_counter()
    llm = LLM(MODEL, dtype="bfloat16", device="cuda", load_format="dummy", max_num_seqs=512,
              max_num_batched_tokens=9216, max_model_len=9216, enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(0)
    points: list[StepPoint] = []
    if args.decode_sweep:
        decode_sweeps(engine, rng, args, started)
        return
    if args.decode_only:
        for spec in args.decode_only.split(","):
            batch, lo, hi = map(int, spec.split(":"))
            ids, requests = decoding(engine, [rng.randint(lo, hi) for _ in range(batch)], rng, "only")
            points.append(decode_point(engine, requests))
            print("decode", points[-1], flush=True)
            drain(engine, ids)
        write_json(args.out_dir, f"gpu-decode-points-{today()}.json", {
            "date": today(), "machine": machine(), "model": MODEL + " (dummy weights), bf16",
            "points": [pt.as_dict() for pt in points]})
        return
    # --quick still measures more points than the model has terms, of every kind, or it cannot be fitted
    prefills = (512, 2048, 8192) if args.quick else (256, 512, 1024, 2048, 4096, 6144, 8192)
    for length in prefills:
        points.append(prefill_point(engine, length, rng, "warm" if length == prefills[0] else "pre"))
        print("prefill", points[-1], flush=True)
    points = points[1:] + [prefill_point(engine, prefills[0], rng, "pre")]   # the first ran cold
    # before the grid: a run cut short by a time limit keeps them
    if args.mixed_lengths:
        lo, hi = args.mixed_lengths
        for batch in (8, 16, 24, 32, 48, 64, 128):
            ids, requests = decoding(engine, [rng.randint(lo, hi) for _ in range(batch)], rng, "mixlen")
            points.append(decode_point(engine, requests))
            print("decode, mixed lengths", points[-1], flush=True)
            drain(engine, ids)
            save(args.out_dir, points)
    grid = [(1, 2048), (64, 2048), (256, 512)] if args.quick else [
        (1, 512), (1, 2048), (1, 8192), (16, 512), (16, 2048), (16, 8192), (64, 512), (64, 2048), (64, 8192),
        (128, 1024), (128, 4096), (256, 512), (256, 2048), (512, 512), (512, 1024)]
    for batch, context in grid:
        ids, requests = decoding(engine, [context] * batch, rng, "grid")
        points.append(decode_point(engine, requests))
        print("decode", points[-1], flush=True)
        for length in ((2048,) if args.quick else (512, 2048, 8192)):
            if (batch * context > 300_000 and length > 2048) or batch >= 512:   # 512: no room for one more
                continue
            rid = f"mix-{batch}x{context}-{length}"
            engine.async_scheduling = False
            sync_steps(engine, 1)   # the step in flight lands
            ctx = sum(r.num_tokens for r in requests)
            engine.add_request(rid, prompt(length, rng), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            seconds = sync_steps(engine, 1)
            engine.async_scheduling = True
            points.append(StepPoint(length, length * (length + 1) // 2, batch, ctx, seconds,
                                    decode_max_context=max(r.num_tokens for r in requests)))
            print("mixed", points[-1], flush=True)
            sync_steps(engine, 2)
        drain(engine, ids)
        save(args.out_dir, points)
    model = fit_step_model(points)
    print("fit:", model, flush=True)
    save(args.out_dir, points, model)


def decode_sweeps(engine, rng: random.Random, args, started: float) -> None:
    from pdserve.planner.simulator import padded_batches
    rows = padded_batches(512)
    sweeps = []
    for spec in args.decode_sweep.split(","):
        lo, hi, batches = spec.split(":")
        sweeps.append((int(lo), int(hi), sorted({int(b) for b in batches.split("/")}, reverse=True)))
    points, details, took = [], [], {}
    header = {"date": today(), "machine": machine(), "model": MODEL + " (dummy weights), bf16",
              "engine": "max_num_seqs 512, max_num_batched_tokens 9216, async scheduling, CUDA graphs",
              "method": f"per point: 3 steps to settle, then {args.windows} windows of 10 decode-only steps, each"
                        " timed between device syncs; seconds = median window; decode_context = summed"
                        " context halfway through the windows", "sweeps": args.decode_sweep}
    header["kv_capacity_tokens"] = engine.scheduler.kv.pool.num_blocks * engine.scheduler.block_size
    print(f"KV capacity: {header['kv_capacity_tokens']} tokens", flush=True)
    for rep in range(args.repeats):
        for index, (lo, hi, batches) in enumerate(sweeps):
            elapsed = time.perf_counter() - started
            if args.deadline and index in took and elapsed + took[index] > args.deadline:
                print(f"skip rep {rep} sweep {lo}:{hi}: {elapsed:.0f} s + {took[index]:.0f} s > deadline", flush=True)
                continue
            t0 = time.perf_counter()
            ids, requests = decoding(engine, [rng.randint(lo, hi) for _ in range(batches[0])], rng, f"sweep{rep}")
            print(f"rep {rep} sweep {lo}:{hi}: {len(ids)} prefilled in {time.perf_counter() - t0:.1f} s", flush=True)
            for batch in batches:
                if batch < len(ids):
                    engine.abort(ids[batch:])
                    ids, requests = ids[:batch], requests[:batch]
                sync_steps(engine, 3)
                contexts = [r.num_tokens for r in requests]
                half = 5 * args.windows
                windows = [sync_steps(engine, 10) for _ in range(args.windows)]
                # fewer than batch x 10 x windows tokens: a sequence was preempted or waited (KV full)
                decoded = sum(r.num_tokens for r in requests) - sum(contexts)
                point = StepPoint(0, 0, batch, sum(contexts) + half * batch, statistics.median(windows),
                                  decode_max_context=max(contexts) + half)
                points.append(point)
                details.append({"rep": rep, "sweep": f"{lo}:{hi}", "graph_rows": rows[batch], "windows": windows,
                                "tokens_decoded": decoded, "tokens_expected": batch * 10 * args.windows,
                                "contexts": [c + half for c in contexts]})
                print(f"  [{time.perf_counter() - started:5.0f} s] batch {batch:3d} (graph {rows[batch]:3d}) context"
                      f" {point.decode_context:7d} longest {point.decode_max_context:5d}: "
                      + " ".join(f"{w * 1e3:.3f}" for w in windows) + " ms", flush=True)
                args.out_dir.mkdir(parents=True, exist_ok=True)   # quietly, after every point
                (args.out_dir / f"gpu-decode-grid-{today()}.json").write_text(json.dumps(
                    {**header, "points": [pt.as_dict() for pt in points], "detail": details}) + "\n")
            drain(engine, ids)
            took[index] = time.perf_counter() - t0
    print(f"wrote {len(points)} points in {time.perf_counter() - started:.0f} s", flush=True)


def save(out_dir: Path, points: list[StepPoint], model=None) -> None:
    """Written after every decode batch too, so that a run cut short by a time limit keeps its points."""
    write_json(out_dir, f"gpu-step-profile-{today()}.json", {
        "date": today(), "machine": machine(), "model": MODEL + " (dummy weights), bf16",
        "engine": "max_num_seqs 512, max_num_batched_tokens 9216, async scheduling, CUDA graphs",
        "points": [pt.as_dict() for pt in points], **({"fit": model.as_dict()} if model else {})})


if __name__ == "__main__":
    main()
