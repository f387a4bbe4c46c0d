#!/usr/bin/env bash
# What the open issues still need from a machine of two GPUs (nvidia-h200-x2), as device calls of at most 10
# minutes each, in order of what they unblock. Every part writes under $OUT and ends within its budget.
#   OUT=/some/dir PART=tp bash benchmarks/gpu_x2_agenda.sh      (PART: tp, handoff, tp-handoff, compare)
#
#   tp          issue 17: the GPU tests on both GPUs (the TP ones need two), then benchmarks/gpu_tp.py: decode
#               step at batch 1 / 64 / 256 and an 8,192-token prefill at TP 1 and TP 2 beside the roofline
#   handoff     issue 16: pull, push and the store between the two GPUs, 128-8,192 tokens one at a time (the
#               targets: push TTFT <= pull at every length, >= 300 GB/s at 2,048 tokens), then under load
#   tp-handoff  issue 17: P TP 1 -> D TP 2 and P TP 2 -> D TP 1 beside 1 -> 1, 2,048 tokens, pull and push
#   compare     issue 14: 1P1D with the cost policy and conditional disaggregation (prefill-heavy), the run
#               docs/benchmarks.md says is owed; its colocated side is the 2026-11-29 run's (gpu-compare-*-s3)
set -u -o pipefail   # (each step's status shows in its log's tail; the call itself always ends 0)
: "${OUT:?set OUT to the output directory}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
case "${PART:?set PART to tp, handoff, tp-handoff or compare}" in
  tp)
    timeout 280 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider > "$OUT/gpu-tests.log" 2>&1
    tail -5 "$OUT/gpu-tests.log"
    timeout 290 python3 benchmarks/gpu_tp.py --tp 1,2 --out "$OUT/gpu-tp.json" 2>&1 | grep -v INFO | tail -20 ;;
  handoff)
    timeout 330 python3 benchmarks/push_vs_pull.py --gpus 0,1 --connectors nixl,nixl-push,store \
        --prompt-lens 128,512,2048,8192 --repeats 5 --out "$OUT/push-vs-pull-2gpu.json" --log-dir "$OUT/logs" \
        2>&1 | grep -v INFO | tail -30
    timeout 230 python3 benchmarks/push_vs_pull.py --gpus 0,1 --connectors nixl,nixl-push --prompt-lens 2048 \
        --repeats 16 --concurrency 8 --out "$OUT/push-vs-pull-2gpu-load.json" --log-dir "$OUT/logs-load" \
        2>&1 | grep -v INFO | tail -12 ;;
  tp-handoff)
    timeout 560 python3 benchmarks/push_vs_pull.py --gpus 0,1 --connectors nixl,nixl-push --tp-pairs 1:1,1:2,2:1 \
        --prompt-lens 2048 --repeats 5 --out "$OUT/push-vs-pull-tp.json" --log-dir "$OUT/logs-tp" \
        2>&1 | grep -v INFO | tail -30 ;;
  compare)
    timeout 580 python3 benchmarks/gpu_compare.py --workloads prefill-heavy --configs disaggregated \
        --router-args '--policy cost --pd-min-prompt-tokens 256' --time-limit 540 --out-dir "$OUT" \
        > "$OUT/compare.log" 2>&1
    tail -20 "$OUT/compare.log" ;;
  *) echo "PART: tp, handoff, tp-handoff or compare" >&2; exit 2 ;;
esac
exit 0
