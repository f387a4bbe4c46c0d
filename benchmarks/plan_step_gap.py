"""Where the simulator's TPOT gap sits: the decode-only step time that a measured sweep implies, against
the step profile's, per rate (docs/planner.md, "Why TPOT was low").

    .venv/bin/python benchmarks/plan_step_gap.py benchmarks/results/gpu-plan-validate-2026-12-04/prefill-heavy.json=256 ...

For every measured request (every n-th with --every): its decode span (first token to the end of the
stream) holds its n - 1 later tokens' steps; the prefill steps inside it are those whose first token
(another request's) lands in the span, each costed by the profile at the batch then decoding. What is left
of the span over the decode-only steps left is the implied decode step; set beside the profile's decode
step at the same batch and context (averaged over the span), without and with the CUDA-graph padding of
the batch (planner/simulator.py: padded_batches). No simulation and no fit: the requests' own times.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from pdserve.planner.profile import load_step_model
from pdserve.planner.simulator import padded_batches

PROFILE = "benchmarks/results/gpu-step-profile-2026-12-04/gpu-step-profile-2026-12-04.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", nargs="+", metavar="FILE=MAX_NUM_SEQS")
    p.add_argument("--profile", default=PROFILE)
    p.add_argument("--every", type=int, default=0, help="every n-th request (default: about 30 per rate)")
    args = p.parse_args()
    m = load_step_model(args.profile)
    for item in args.sweeps:
        file, _, seqs = item.partition("=")
        rows = padded_batches(int(seqs or 256))
        data = json.loads(open(file).read())
        for res in data["results"]:
            q = [r for r in res["requests"] if r["success"] and r["output_tokens"] and r["output_tokens"] > 1]
            st = np.array([r["start_time"] for r in q])
            first, end = st + np.array([r["ttft"] for r in q]), st + np.array([r["e2e"] for r in q])
            prompt, out = np.array([r["prompt_tokens"] for r in q]), np.array([r["output_tokens"] for r in q])

            def batch_at(t):
                live = np.where((first <= t) & (end >= t))[0]
                ctx = float(np.sum(prompt[live] + out[live] * (t - first[live]) / (end[live] - first[live])))
                return len(live), ctx

            implied, plain, padded, batches = [], [], [], []
            for i in range(0, len(q), args.every or max(1, len(q) // 30)):
                inside = np.where((first > first[i]) & (first < end[i]))[0]
                prefill_s = 0.0
                for j in inside:
                    b, c = batch_at(first[j])
                    prefill_s += m.seconds(int(prompt[j]), int(prompt[j]) * (int(prompt[j]) + 1) // 2, b, c)
                steps = out[i] - 1 - len(inside)
                if steps <= 0:
                    continue
                implied.append((end[i] - first[i] - prefill_s) / steps)
                shapes = [batch_at(t) for t in np.linspace(first[i], end[i], 20)]
                plain.append(np.mean([m.seconds(0, 0, b, c) for b, c in shapes]))
                padded.append(np.mean([m.seconds(0, 0, b, c) + m.per_token * (rows[min(b, len(rows) - 1)] - b)
                                       for b, c in shapes]))
                batches.append(np.mean([b for b, _ in shapes]))
            implied, plain, padded = (np.array(x) * 1e3 for x in (implied, plain, padded))
            print(f"{file} rate {res['request_rate']}: batch ~{np.median(batches):.0f}; implied decode step "
                  f"{np.median(implied):.2f} ms; profile {np.median(plain):.2f} ms ({np.median(implied / plain) - 1:+.1%}), "
                  f"with graph padding {np.median(padded):.2f} ms ({np.median(implied / padded) - 1:+.1%}); "
                  f"measured ITL p50 {res['metrics']['itl_ms']['p50']:.1f} ms")


if __name__ == "__main__":
    main()
