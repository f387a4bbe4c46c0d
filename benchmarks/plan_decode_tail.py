"""Decode-only steps between CUDA-graph buckets and over unequal contexts: does the decode kernel's makespan
(planner/profile.py, decode_attention_context) predict them better than the summed context does?

    .venv/bin/python benchmarks/plan_decode_tail.py [--grid GRID.json] [--out OUT.json]

Reads the grid `benchmarks/gpu_step_profile.py --decode-sweep` measured (default: the H100 run of 2026-12-06,
benchmarks/results/gpu-decode-grid-2026-12-06/; docs/planner.md, "Decode steps between graph buckets and over
unequal contexts") and fits two models of a decode-only step to part of it, by
non-negative least squares on relative error, as planner/profile.py fits a profile:

  summed    fixed + per_token x graph rows + per_decode_seq x B + per_context_token x C       (the simulator's)
  kernel    the same with C replaced by decode_attention_context(B, C, longest, bucket; rho)
  programs  the same with C replaced by the makespan of the kernel's programs simulated one by one from
            each point's measured contexts (what decode_attention_context approximates from C and longest)

rho (bandwidth_programs) is picked on the training points (a grid of values); the other terms are fitted.
Each split trains on some sweeps and reports the error on the others (held out). Then, as a check that rho
carries over to the H200: the H200's kernel-level split sweep of 2026-11-30 (one program per (sequence, KV
head) at batch 1, 4, 16 against 64, context 2,048) gives rho directly, and the shipped H200 profile is
refitted with the term on its own points. Writes --out (JSON).
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from pdserve.planner.profile import (DecodeKernel, StepPoint, decode_attention_context, decode_num_splits,
                                     fit_step_model, nnls, padded_batches, step_seconds)

ROOT = Path(__file__).resolve().parent
GRID = ROOT / "results/gpu-decode-grid-2026-12-06/gpu-decode-grid-2026-12-06.json"
H200_SPLITS = ROOT / "results/gpu-2026-11-30-s5/run2/gpu-splits-2026-11-30.json"
H200_PROFILE = ROOT / "results/gpu-step-profile-2026-12-04/gpu-step-profile-2026-12-04.json"
KV_HEADS = 8
RHOS = tuple(range(100, 401, 10))
SPLITS = {
    "equal 5,120 / 2,048 / 1,024 -> uniform and 8,192": ("5120:5120", "2048:2048", "1024:1024"),
    "equal 8,192 / 2,048, uniform 1,024-4,096 -> the rest": ("8192:8192", "2048:2048", "1024:4096"),
    "equal 5,120 / 1,024, uniform 2,048-8,192 -> the rest": ("5120:5120", "1024:1024", "2048:8192"),
}


def load(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    rows = padded_batches(512)
    return [{**p, "sweep": d["sweep"], "rep": d["rep"], "rows": rows[p["decode_batch"]], "contexts": d["contexts"]}
            for p, d in zip(data["points"], data["detail"])]


def programs_makespan(contexts: list[int], splits: int, rho: float, slots: int) -> float:
    """The fluid model of decode_attention_context, run program by program: (sequence, KV head, split)
    programs start in the kernel's grid order (sequence fastest) while fewer than `slots` run; the k running
    each progress at 1 / max(rho, k) of the bandwidth. In context tokens at full bandwidth."""
    lengths = [math.ceil(c / splits) for _ in range(splits * KV_HEADS) for c in contexts]
    running: list[float] = []
    t = done = 0.0   # done: the tokens every running program has read since the start (virtual time)
    i = 0
    while i < len(lengths) and len(running) < slots:
        heapq.heappush(running, lengths[i])
        i += 1
    while running:
        t += (running[0] - done) * max(rho, len(running))
        done = running[0]
        while running and running[0] <= done:
            heapq.heappop(running)
        while i < len(lengths) and len(running) < slots:
            heapq.heappush(running, done + lengths[i])
            i += 1
    return t / KV_HEADS


_PROGRAMS: dict = {}


def features(p: dict, rho: float, programs: bool = False) -> list[float]:
    b, c = p["decode_batch"], p["decode_context"]
    if rho and programs:
        key = (id(p), rho)
        if key not in _PROGRAMS:
            _PROGRAMS[key] = programs_makespan(p["contexts"], decode_num_splits(p["rows"], KV_HEADS, 132), rho, 528)
        c = _PROGRAMS[key]
    elif rho:
        c = decode_attention_context(b, c, p["decode_max_context"], p["rows"], DecodeKernel(KV_HEADS, rho))
    return [1.0, p["rows"], b, c]


def fit(points: list[dict], rho: float, programs: bool = False) -> np.ndarray:
    a = np.array([features(p, rho, programs) for p in points])
    y = np.array([p["seconds"] for p in points])
    scale = a.max(axis=0)
    return nnls(a / scale / y[:, None], np.ones(len(y))) / scale


def errors(points: list[dict], coef: np.ndarray, rho: float, programs: bool = False) -> np.ndarray:
    return np.array([np.dot(features(p, rho, programs), coef) / p["seconds"] - 1 for p in points])


def summary(e: np.ndarray) -> dict:
    return {"rms_pct": float(np.sqrt((e ** 2).mean()) * 100), "max_abs_pct": float(np.abs(e).max() * 100),
            "points": len(e)}


def best_rho(train: list[dict], programs: bool = False) -> float:
    return min(RHOS, key=lambda r: float((errors(train, fit(train, r, programs), r, programs) ** 2).mean()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", type=Path, default=GRID)
    p.add_argument("--out", type=Path, default=ROOT / "results/gpu-decode-grid-2026-12-06/plan-decode-tail.json")
    args = p.parse_args()
    points = load(args.grid)
    report: dict = {"grid": str(args.grid), "splits": {}}
    for name, train_sweeps in SPLITS.items():
        train = [q for q in points if q["sweep"] in train_sweeps]
        held = [q for q in points if q["sweep"] not in train_sweeps]
        rho = best_rho(train)
        row = {"train": list(train_sweeps), "rho": rho}
        for model, r in (("summed", 0), ("kernel", rho)):
            coef = fit(train, r)
            row[model] = {"train": summary(errors(train, coef, r)), "held_out": summary(errors(held, coef, r)),
                          "coef": coef.tolist()}
        report["splits"][name] = row
        print(f"{name}: rho {rho}")
        for model in ("summed", "kernel"):
            t, h = row[model]["train"], row[model]["held_out"]
            print(f"  {model:6s}  train rms {t['rms_pct']:4.1f} % max {t['max_abs_pct']:4.1f} %"
                  f"   held out ({h['points']}) rms {h['rms_pct']:4.1f} % max {h['max_abs_pct']:4.1f} %")
    rho = best_rho(points)
    coefs = {"summed": fit(points, 0), "kernel": fit(points, rho)}
    report["all"] = {"rho": rho}
    for m, c in coefs.items():
        report["all"][m] = {"coef": c.tolist(), **summary(errors(points, c, 0 if m == "summed" else rho))}
    fixed, per_row, per_seq, per_ctx = coefs["kernel"]
    rho_p = best_rho(points, programs=True)
    e = errors(points, fit(points, rho_p, True), rho_p, True)
    report["all"]["programs"] = {"rho": rho_p, **summary(e)}
    print(f"all points, programs simulated one by one: rho {rho_p}, rms {summary(e)['rms_pct']:.1f} % max "
          f"{summary(e)['max_abs_pct']:.1f} %")
    kernel, summed = report["all"]["kernel"], report["all"]["summed"]
    print(f"all points: rho {rho}; kernel fit: fixed {fixed * 1e3:.2f} ms, per graph row {per_row * 1e6:.2f} us, "
          f"per sequence {per_seq * 1e6:.2f} us, per context token {per_ctx * 1e9:.1f} ns "
          f"({2 * KV_HEADS * 128 * 2 * 32 / per_ctx / 1e12:.2f} TB/s of KV); rms {kernel['rms_pct']:.1f} %"
          f" max {kernel['max_abs_pct']:.1f} % (summed: rms {summed['rms_pct']:.1f} %"
          f" max {summed['max_abs_pct']:.1f} %)")
    # per configuration, mean over the repeats
    table = defaultdict(list)
    for q in points:
        table[(q["sweep"], q["decode_batch"])].append(q)
    print(f"\n{'contexts':>10} {'batch':>5} {'graph':>5} {'summed ctx':>10} {'longest':>7} {'step ms':>8}"
          f" {'spread':>6} {'summed':>7} {'kernel':>7}")
    report["table"] = []
    for (sweep, batch), qs in table.items():
        secs = [q["seconds"] for q in qs]
        e = {m: float(np.mean(errors(qs, c, 0 if m == "summed" else rho))) * 100 for m, c in coefs.items()}
        row = {"sweep": sweep, "batch": batch, "graph_rows": qs[0]["rows"],
               "context": int(np.mean([q["decode_context"] for q in qs])),
               "longest": int(np.mean([q["decode_max_context"] for q in qs])), "ms": float(np.mean(secs)) * 1e3,
               "spread_pct": (max(secs) / min(secs) - 1) * 100, "summed_err_pct": e["summed"],
               "kernel_err_pct": e["kernel"]}
        report["table"].append(row)
        print(f"{sweep:>10} {batch:5d} {row['graph_rows']:5d} {row['context']:10,d} {row['longest']:7,d}"
              f" {row['ms']:8.2f} {row['spread_pct']:5.1f}% {e['summed']:+6.1f}% {e['kernel']:+6.1f}%")
    # rho on the H200, from its kernel-level split sweep: T(one program per (sequence, KV head), few of them)
    # / T(512 programs, at bandwidth) x 512, the same context
    if H200_SPLITS.exists():
        rows = {(r["batch"], r["splits"]): r["us_per_layer"] for r in json.loads(H200_SPLITS.read_text())["rows"]}
        full = rows[(64, 1)] / (64 * KV_HEADS)
        report["h200_split_sweep_rho"] = {f"batch {b} ({b * KV_HEADS} programs)": rows[(b, 1)] / full
                                          for b in (1, 4, 16)}
        print("\nH200 split sweep 2026-11-30, rho = one program's time / (time at 512 programs / 512): "
              + ", ".join(f"{k}: {v:.0f}" for k, v in report["h200_split_sweep_rho"].items()))
    # the shipped H200 profile, refitted with the term on its own points
    if H200_PROFILE.exists():
        data = json.loads(H200_PROFILE.read_text())
        pts = [StepPoint(**{k: float(v) if k == "seconds" else int(v) for k, v in q.items()})
               for q in data["points"]]
        old = fit_step_model(pts)
        new = fit_step_model(pts, decode_kernel=DecodeKernel(KV_HEADS, float(rho)), graph_max_num_seqs=512)
        rows512 = padded_batches(512)
        e_old = [step_seconds(old, q) / q.seconds - 1 for q in pts]
        e_new = [step_seconds(new, q, rows512) / q.seconds - 1 for q in pts]
        before, after = summary(np.array(e_old)), summary(np.array(e_new))
        report["h200_profile_refit"] = {"before": old.as_dict(), "after": new.as_dict(), "before_err": before,
                                        "after_err": after}
        print(f"H200 profile 2026-12-04 ({len(pts)} points) refitted with rho {rho}: rms {before['rms_pct']:.1f} -> "
              f"{after['rms_pct']:.1f} %, max {before['max_abs_pct']:.1f} -> {after['max_abs_pct']:.1f} %; "
              f"per_context_token {old.per_context_token * 1e9:.2f} -> {new.per_context_token * 1e9:.2f} ns, fixed "
              f"{old.fixed * 1e3:.3f} -> {new.fixed * 1e3:.3f} ms, per_token {old.per_token * 1e6:.2f} -> "
              f"{new.per_token * 1e6:.2f} us")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
