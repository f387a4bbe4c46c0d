#!/bin/bash
# Where does a served decode step's time go? The same decode batches timed three ways on one GPU:
# the engine alone (gpu_step_profile.py --decode-only: equal and unequal contexts), and `pdserve serve`
# under the prefill-heavy workload with every step logged (PDSERVE_LOG_SLOW_STEP_MS=0) beside the
# client's inter-token latencies. docs/planner.md, "Why TPOT was low".
#   PYTHONPATH=$PWD:$PWD/benchmarks bash benchmarks/gpu_decode_gap.sh $OUT
set -u
OUT=${1:?usage: gpu_decode_gap.sh OUT_DIR}
mkdir -p "$OUT"
timeout 200 python3 benchmarks/gpu_step_profile.py --out-dir "$OUT" \
  --decode-only 16:5120:5120,16:2048:8192,36:5120:5120,36:2048:8192,36:4800:4800 > "$OUT/engine-points.log" 2>&1
tail -6 "$OUT/engine-points.log"
PORT=8300
PDSERVE_LOG_SLOW_STEP_MS=0 python3 -m pdserve serve --host 127.0.0.1 --port $PORT --model llama-3.1-8b \
  --load-format dummy --dtype bfloat16 --seed 0 --max-model-len 9216 --device cuda --no-prefix-caching \
  --no-chunked-prefill --max-num-batched-tokens 9216 --max-num-seqs 256 > "$OUT/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
for rate in 6 inf; do
  n=60; [[ $rate == inf ]] && n=36
  echo "=== rate $rate" >> "$OUT/serve.log"
  timeout 120 python3 -m pdserve bench serve --base-url http://127.0.0.1:$PORT --input-len 5120 --range-ratio 0.6 \
    --output-len 320 --num-prompts $n --request-rate $rate --slo-ttft-ms 2000 --slo-tpot-ms 30 --ignore-eos \
    --seed 0 --no-progress --out "$OUT/bench-rate-$rate.json" > "$OUT/bench-rate-$rate.log" 2>&1
  tail -12 "$OUT/bench-rate-$rate.log"
done
kill $SERVER; wait $SERVER
gzip -f "$OUT/serve.log"
