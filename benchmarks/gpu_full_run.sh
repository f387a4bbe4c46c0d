#!/usr/bin/env bash
# One device call for the GPU issue: gpu_bench (split-K sweep, decode, prefill, engine decode, offline) on
# one GPU with the GPU tests beside it on the other, then the 1P1D end-to-end run on both (SKIP_E2E=1: not). With 4 GPUs visible the decode-heavy comparison of issue 5
# (benchmarks/gpu_compare.py) runs beside them on GPUs 0,1 while these use GPUs 2,3.
#   OUT=/some/dir bash benchmarks/gpu_full_run.sh
set -u
: "${OUT:?set OUT to the output directory}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PDSERVE_LOG_SLOW_STEP_MS=${PDSERVE_LOG_SLOW_STEP_MS:-500}
num_gpus=$(nvidia-smi -L | grep -c '^GPU ')
if [ "$num_gpus" -ge 4 ]; then
    CUDA_VISIBLE_DEVICES=0,1 python3 benchmarks/gpu_compare.py --workloads decode-heavy --out-dir "$OUT" \
        --time-limit "${COMPARE_TIME_LIMIT:-470}" ${COMPARE_ARGS:-} > "$OUT/compare.log" 2>&1 &
    compare=$!
    a=2 b=3
else
    compare=""
    a=0 b=1
fi
bench=/tmp/gpu-bench && mkdir -p $bench
# The GPU tests run beside the benchmark, on the other GPU (the host has cores to spare for both).
CUDA_VISIBLE_DEVICES=$b timeout 200 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider > $bench/gpu-tests.log 2>&1 &
tests=$!
CUDA_VISIBLE_DEVICES=$a timeout 400 python3 benchmarks/gpu_bench.py splits,decode,prefill,engine,offline --out-dir $bench \
    --tests-log $bench/gpu-tests.log 2>&1 | tee $bench/gpu-bench.log | tail -70
wait $tests
tail -5 $bench/gpu-tests.log
[ "${SKIP_E2E:-0}" = 1 ] || timeout 140 python3 benchmarks/gpu_e2e.py --model llama-3.1-8b --num-requests 64 --input-len 1024 --output-len 128 \
    --request-rate 8 --kv-connector cuda_ipc --gpus $a,$b --out $bench/gpu-e2e.json --log-dir $bench/e2e-logs \
    2>&1 | tail -40
tar czf "$OUT/gpu-bench.tar.gz" -C /tmp gpu-bench
[ -n "$compare" ] && wait $compare
tail -3 "$OUT/compare.log" 2>/dev/null
exit 0
