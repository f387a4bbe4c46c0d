#!/bin/bash
# One colocated instance on one GPU (Llama-3.1-8B shape, bf16, dummy weights), swept over the two
# workloads of the issue 5 comparison, so that `pdserve plan`'s simulator can be checked against the
# same code its step profile (benchmarks/gpu_step_profile.py) was measured on:
#   PYTHONPATH=$PWD bash benchmarks/gpu_plan_validate.sh $OUT
# then here: .venv/bin/python benchmarks/plan_validate.py --sweep DIR/prefill-heavy.json ... (see its --help)
set -u
OUT=${1:?usage: gpu_plan_validate.sh OUT_DIR}
mkdir -p "$OUT"
PORT=8300
COMMON=(--host 127.0.0.1 --port $PORT --model llama-3.1-8b --load-format dummy --dtype bfloat16 --seed 0
        --max-model-len 9216 --device cuda --no-prefix-caching --no-chunked-prefill --max-num-batched-tokens 9216)
SLO=(--slo-ttft-ms 2000 --slo-tpot-ms 30 --ignore-eos --seed 0 --no-progress)

serve() {   # $1: log name, then extra flags
  local name=$1; shift
  python3 -m pdserve serve "${COMMON[@]}" "$@" > "$OUT/$name-serve.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0
    kill -0 $SERVER 2> /dev/null || { echo "server $name died"; tail -20 "$OUT/$name-serve.log"; return 1; }
    sleep 1
  done
  echo "server $name not healthy in 300 s"; return 1
}
stop() { kill $SERVER; wait $SERVER; }
slim() {    # per-token latencies make a sweep too large to bring back; the simulator needs none of them
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [r.pop('itls', None) for x in d['results'] for r in x['requests']]; json.dump(d, open(sys.argv[1], 'w'))" "$1"
}
WORKLOADS=${WORKLOADS:-prefill-heavy,decode-heavy}

if [[ $WORKLOADS == *prefill-heavy* ]]; then
serve prefill-heavy --max-num-seqs 256 || exit 1
timeout 240 python3 -m pdserve bench sweep --base-url http://127.0.0.1:$PORT --input-len 5120 --range-ratio 0.6 \
  --output-len 320 --num-prompts 60 --request-rates 3,4,5,6,7 "${SLO[@]}" --out "$OUT/prefill-heavy.json"
slim "$OUT/prefill-heavy.json"
stop
fi
if [[ $WORKLOADS == *decode-heavy* ]]; then
serve decode-heavy --max-num-seqs 512 || exit 1
timeout 200 python3 -m pdserve bench sweep --base-url http://127.0.0.1:$PORT --input-len 640 --range-ratio 0.6 \
  --output-len 768 --output-range-ratio 0.33333334 --num-prompts 360 --request-rates 20,40,60 "${SLO[@]}" \
  --out "$OUT/decode-heavy.json"
slim "$OUT/decode-heavy.json"
stop
fi
