#!/usr/bin/env bash
# Issue 13's fault matrix (tests/e2e/test_fault_matrix.py) on one GPU: P, the two Ds (policies fail and
# recompute) and the colocated reference as four instances sharing the GPU, in float32 (so recompute and
# colocated are token-identical), with random weights of the default model's shape and its real tokenizer.
# Each transport named runs the whole matrix (default: cuda_ipc, which needs no nixl wheel; nixl reads VRAM
# when the nixl wheel travels in .whl). Per transport: $OUT/fault-matrix-T.json (each fault's measured time)
# and $OUT/fault-matrix-T.log (pytest's output, the instances' logs on failure).
#   here:  python benchmarks/export_model_shape.py .gpu-model; ../shared/tools/device-wheels.sh nixl-cu13==1.5.1 \
#          pydantic==2.12.5 pydantic-core==2.41.5 annotated-types typing-inspection && python benchmarks/slim_nixl_wheel.py
#   there: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#          OUT=/some/dir bash benchmarks/gpu_fault_matrix.sh [cuda_ipc] [nixl]
set -u
: "${OUT:?set OUT to the output directory}"
[ -f .gpu-model/config.json ] || { echo "no .gpu-model: run benchmarks/export_model_shape.py .gpu-model here" >&2; exit 2; }
[ -f .gpu-model/tokenizer.json ] || gunzip -k .gpu-model/tokenizer.json.gz
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
export PDSERVE_E2E_INSTANCE_ARGS="--model $PWD/.gpu-model --load-format dummy --dtype float32 --device cuda \
--served-model-name default --kv-cache-memory 1073741824"
export PDSERVE_FAULT_MATRIX_DECODE_TOKENS=400   # still decoding when P is killed: 32 tokens take 0.1 s here
status=0
for connector in "${@:-cuda_ipc}"; do
    PDSERVE_E2E_KV_CONNECTOR=$connector PDSERVE_FAULT_MATRIX_OUT="$OUT/fault-matrix-$connector.json" \
        timeout ${MATRIX_TIMEOUT_S:-280} python3 -m pytest -q -p no:cacheprovider tests/e2e/test_fault_matrix.py > "$OUT/fault-matrix-$connector.log" 2>&1
    rc=$?
    echo "$connector: pytest exit $rc"; tail -3 "$OUT/fault-matrix-$connector.log"
    if [ $rc -ne 0 ]; then   # the instances' own logs say why
        status=$rc
        tail -n 40 /tmp/pdserve-fm-*.log >> "$OUT/fault-matrix-$connector.log" 2>/dev/null
    fi
    rm -f /tmp/pdserve-fm-*.log
done
exit $status
