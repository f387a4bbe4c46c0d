#!/usr/bin/env bash
# 1P1D through the proxy (`pdserve up --num-prefill 1 --num-decode 1`, NIXL over DRAM, one core each)
# against one colocated `pdserve serve` on both cores, the same client as cpu_serve_vs_vllm.sh (the
# vLLM-CPU anchor's `vllm bench serve`: 256 random tokens in, 128 out, ignore_eos, greedy): 64 requests
# at rate inf (seed 0), then 16 one at a time (seed 1). Colocated first, one server at a time. The issue's
# targets: 1P1D at rate inf >= 0.8x colocated, single-stream TTFT <= 1.3x and TPOT <= 1.1x colocated.
# Results: the client's JSON under $OUT (default benchmarks/results/cpu-pd-serve-DATE/).
#   bash benchmarks/cpu_pd_serve.sh [RUN_TAG]
# PREFILL_ARGS / DECODE_ARGS: extra flags for the P / D instance (`pdserve up --prefill-args`), e.g.
# '--cpu-cores 0,1 --num-threads 2' to let both share both cores; SKIP_COLOCATED=1 runs 1P1D alone.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ANCHOR=$HERE/../../shared/anchors/vllm-cpu
export ANCHORS=${ANCHORS:-$HOME/.cache/vllm-cpu-anchor}
TAG=${1:-1}
OUT=${OUT:-$HERE/results/cpu-pd-serve-$(date +%F)}
mkdir -p "$OUT"
COLO_PORT=18111 PD_PORT=18121
vllm_cli() { "$ANCHORS/vllm-venv/bin/python" "$ANCHOR/bin/vllm" "$@"; }

bench() {   # bench NAME PORT
  local name=$1 port=$2
  ( . "$ANCHOR/env.sh"
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

stop() {   # stop PID: SIGINT to its process group, then wait (up to 30 s) before SIGKILL
  kill -INT -- -"$1" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$1" 2>/dev/null; wait "$1" 2>/dev/null
}

if [ "${SKIP_COLOCATED:-0}" != 1 ]; then
  setsid .venv/bin/pdserve serve --host 127.0.0.1 --port $COLO_PORT --served-model-name smollm2 \
    > "$OUT/colocated_server_run$TAG.log" 2>&1 &
  PID=$!
  wait_ready $COLO_PORT 300 && bench colocated $COLO_PORT
  stop $PID
fi

UP_EXTRA=()
[ -n "${PREFILL_ARGS:-}" ] && UP_EXTRA+=(--prefill-args "$PREFILL_ARGS")
[ -n "${DECODE_ARGS:-}" ] && UP_EXTRA+=(--decode-args "$DECODE_ARGS")
setsid .venv/bin/pdserve up --host 127.0.0.1 --port $PD_PORT --num-prefill 1 --num-decode 1 \
  --served-model-name smollm2 "${UP_EXTRA[@]}" > "$OUT/1p1d_run$TAG.log" 2>&1 &
PID=$!
wait_ready $PD_PORT 300 && bench 1p1d $PD_PORT
stop $PID
