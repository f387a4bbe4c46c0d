#!/usr/bin/env bash
# 1P1D through the proxy (`pdserve up --num-prefill 1 --num-decode 1`) and one colocated `pdserve serve` up
# side by side on the default model, measured in turn so that this machine's drift (up to 20 % within
# minutes) falls on both alike; the ratios are 1P1D / colocated. First the single stream
# (benchmarks/single_stream_pair.py: ABBA, a fresh 256-token prompt per round, 128 tokens out, 2 s idle
# before each request; issue 15's targets TTFT <= 1.3, TPOT <= 1.1), then throughput at rate inf
# (benchmarks/rate_inf_pair.py: bursts of 64 requests, 256 tokens in, 128 out, AB BA ...; target >= 0.8).
# JSON and logs under $OUT (default benchmarks/results/cpu-pd-pair-DATE/).
#   bash benchmarks/cpu_pd_pair.sh [RUN_TAG] [extra single_stream_pair.py args]
# UP_ARGS: more `pdserve up` flags; COLOCATED_ARGS: more `pdserve serve` flags; RATE_INF_ROUNDS: bursts
# to each (default 4; 0 skips them).
set -u -o pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
TAG=${1:-1}
shift || true
OUT=${OUT:-$HERE/results/cpu-pd-pair-$(date +%F)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
COLO_PORT=18111 PD_PORT=18121
ANCHOR= ANCHORS=   # serve_bench_lib.sh's servers and waits only; no vLLM here
. "$HERE/serve_bench_lib.sh"
cd "$HERE/.."
# (the 1P1D cluster's instances take the two ports after its proxy's)
for port in $COLO_PORT $PD_PORT $((PD_PORT + 1)) $((PD_PORT + 2)); do
  if curl -s -o /dev/null "http://127.0.0.1:$port/health"; then
    echo "port $port already serves something: stop it first (this script would time it instead)"; exit 1
  fi
done
COLO_PID= PD_PID=
cleanup() { [ -n "$PD_PID" ] && stop "$PD_PID"; [ -n "$COLO_PID" ] && stop "$COLO_PID"; return 0; }
trap cleanup EXIT
trap 'exit 130' INT TERM

setsid .venv/bin/pdserve serve --host 127.0.0.1 --port $COLO_PORT --served-model-name smollm2 ${COLOCATED_ARGS:-} \
  > "$OUT/colocated_server_run$TAG.log" 2>&1 &
COLO_PID=$!
setsid .venv/bin/pdserve up --host 127.0.0.1 --port $PD_PORT --num-prefill 1 --num-decode 1 \
  --served-model-name smollm2 ${UP_ARGS:-} > "$OUT/1p1d_run$TAG.log" 2>&1 &
PD_PID=$!
wait_ready $COLO_PORT 300 && wait_ready $PD_PORT 300 \
  && .venv/bin/python "$HERE/single_stream_pair.py" --a 1p1d=$PD_PORT --b colocated=$COLO_PORT \
       --max-tokens 128 --out "$OUT/pd_pair_run$TAG.json" "$@" | tee "$OUT/pd_pair_run$TAG.log" \
  && { [ "${RATE_INF_ROUNDS:-4}" = 0 ] || .venv/bin/python "$HERE/rate_inf_pair.py" --a 1p1d=$PD_PORT \
         --b colocated=$COLO_PORT --rounds "${RATE_INF_ROUNDS:-4}" --out "$OUT/rate_inf_pair_run$TAG.json" \
         | tee "$OUT/rate_inf_pair_run$TAG.log"; }
exit   # with the status of the measurement (a failed wait or run is not a success); cleanup stops both
