"""Does the first token depend on where the last prompt position is computed? (the push GPU mismatch)

With pull and the store, D takes P's first token, sampled from P's prefill of the whole prompt. With push,
D computed the last prompt position itself, in a one-token step over the KV P wrote. This script runs a P
and a D engine in one process (the loopback connector copies the KV) and, per prompt, decodes on D both
ways: with P's token ("pull") and without it ("push": D recomputes the last position). It records each
path's tokens and the top-2 logit gap of the step that sampled the first token.

    PYTHONPATH=$PWD python3 benchmarks/gpu_first_token_paths.py --out $OUT/first-token-paths.json

The prompts are push_vs_pull.py's (same --seed, --prompt-lens, --repeats): random token ids.
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-lens", default="2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--extra-prompts", type=int, default=0, help="more random prompts per length, after those")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", default=str(16 << 30))
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from pdserve.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.sampling_params import SamplingParams
    from pdserve.worker import model_runner

    lens = [int(x) for x in args.prompt_lens.split(",")]
    rng = random.Random(args.seed)
    prompts = {n: [[rng.randrange(1000, 30000) for _ in range(n)]
                   for _ in range(args.repeats + 1 + args.extra_prompts)] for n in lens}
    seen: list[tuple[int, float, int, float]] = []
    original = model_runner.ModelRunner._sample

    def recording(self, logits, sample_items):
        top = logits.float().topk(2, dim=-1)
        seen.extend((int(i[0]), float(v[0]), int(i[1]), float(v[1]))
                    for v, i in zip(top.values.tolist(), top.indices.tolist()))
        return original(self, logits, sample_items)

    model_runner.ModelRunner._sample = recording

    def engine(role: str) -> EngineCore:
        # P and D in one process, KV copied by the loopback connector; the same seed gives the same weights.
        cfg = EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device,
                                             load_format="dummy", max_model_len=max(lens) + 64, seed=args.seed),
                           cache=CacheConfig(kv_cache_memory=int(args.kv_cache_memory), enable_prefix_caching=False),
                           scheduler=SchedulerConfig(async_scheduling=False),
                           kv_transfer=KVTransferConfig(kv_connector="loopback", kv_role=role, engine_id=role))
        return EngineCore(cfg)

    def run(core: EngineCore, rid: str, prompt: list[int], sp: SamplingParams, kv: dict | None) -> tuple[list, dict]:
        seen.clear()
        core.add_request(rid, prompt, sp, kv)
        ids: list[int] = []
        for _ in range(10_000):
            for o in core.step():
                if o.request_id == rid:
                    ids += o.new_token_ids
                    if o.finished:
                        if o.error:
                            raise RuntimeError(o.error)
                        return ids, {"first_sampled": seen[0] if seen else None, "kv": o.kv_transfer_params}
        raise RuntimeError(f"{rid} did not finish")

    prefill, decode = engine("producer"), engine("consumer")
    greedy = dict(temperature=0.0, ignore_eos=True)
    rows = []
    for n, group in prompts.items():
        for k, prompt in enumerate(group):
            rid = f"{n}-{k}"
            p_ids, p_info = run(prefill, rid, prompt, SamplingParams(max_tokens=1, **greedy),
                                {"do_remote_decode": True})
            params = dict(p_info["kv"])
            runs = {}
            for label, kv in (("pull", params),   # D takes P's token
                              ("push", {k2: v for k2, v in params.items() if k2 != "first_token_ids"})):
                ids, info = run(decode, f"{rid}-{label}", prompt,
                                SamplingParams(max_tokens=args.max_tokens, **greedy), kv)
                runs[label] = {"token_ids": ids}
                if label == "push":   # D's own one-token step over P's KV sampled the first token
                    top1, v1, top2, v2 = info["first_sampled"]
                    runs[label].update(top1=top1, top2=top2, gap=v1 - v2)
                if label == "pull":   # the first step is after P's token; keep the same request on P ready
                    p_ids, p_info = run(prefill, rid + "-again", prompt, SamplingParams(max_tokens=1, **greedy),
                                        {"do_remote_decode": True})
                    params = dict(p_info["kv"])
            top1, v1, top2, v2 = p_info["first_sampled"]
            runs["prefill"] = {"token_ids": p_ids, "top1": top1, "top2": top2, "gap": v1 - v2}
            rows.append({"prompt_len": n, "index": k, "runs": runs,
                         "first_token_same": runs["pull"]["token_ids"][:1] == runs["push"]["token_ids"][:1],
                         "tokens_same": runs["pull"]["token_ids"] == runs["push"]["token_ids"]})
            print(n, k, {lab: (r["token_ids"], round(r.get("gap", float("nan")), 4)) for lab, r in runs.items()},
                  flush=True)
    rows_gap = [r["runs"]["prefill"]["gap"] for r in rows]
    gaps = sorted(rows_gap)
    out = {"date": datetime.date.today().isoformat(), "args": vars(args), "rows": rows,
           "first_token_differs": sum(not r["first_token_same"] for r in rows), "prompts": len(rows),
           "cold_gap_quartiles": [gaps[len(gaps) // 4], gaps[len(gaps) // 2], gaps[3 * len(gaps) // 4]]}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
