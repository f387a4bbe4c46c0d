#!/usr/bin/env bash
# Session 30's GPU check on one H200: the GPU tests on this code, then 1P1D on the one GPU through the
# router (nixl and cuda_ipc pull: the decode side's worker half is now kv_transfer/nixl_tp.py's for nixl).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
mkdir -p $OUT
timeout 250 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc=$?"; tail -1 $OUT/gpu-tests.log
timeout 300 python3 benchmarks/push_vs_pull.py --gpus 0,0 --connectors nixl,cuda_ipc --prompt-lens 128,2048 --repeats 3 \
    --out $OUT/push-vs-pull-1gpu.json > $OUT/push-vs-pull.log 2>&1; echo "push_vs_pull rc=$?"; tail -30 $OUT/push-vs-pull.log
