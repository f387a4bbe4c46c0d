cd /work/main
for t in 2 1 2 1; do
  .venv/bin/python -m pdserve serve --port 29500 --num-threads $t > /tmp/thr/serve-$t.log 2>&1 &
  pid=$!
  for i in $(seq 120); do curl -sf http://127.0.0.1:29500/health >/dev/null && break; sleep 1; done
  .venv/bin/python -m pdserve bench serve --base-url http://127.0.0.1:29500 --num-prompts 8 --max-concurrency 1 --request-rate inf --input-len 256 --output-len 64 --range-ratio 0 --ignore-eos --temperature 0 --no-progress --out /tmp/thr/single-$t-$RANDOM.json > /dev/null
  .venv/bin/python -m pdserve bench serve --base-url http://127.0.0.1:29500 --num-prompts 32 --request-rate inf --input-len 256 --output-len 64 --range-ratio 0 --ignore-eos --temperature 0 --no-progress --out /tmp/thr/inf-$t-$RANDOM.json > /dev/null
  kill $pid; wait $pid
done
echo finished
