#!/usr/bin/env bash
# One device call after a change to the backends or the pipeline: the GPU tests in one process, then the dense
# end-to-end row beside `cp -r` + sync (defaults). Results under $OUT.  bash benchmarks/device/device_gpu_suite.sh
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FP4CONVERT_CACHE_DIR=/tmp/fp4convert-cache
if ls .whl/*.whl >/dev/null 2>&1; then   # compressed-tensors and its needs (not installed on the GPU host)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PWD:/tmp/site"
else
    export PYTHONPATH="$PWD"
fi
{ date -u; nvidia-smi -L; python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'; } 2>&1 | tee "$OUT/env.txt"
timeout "${TEST_S:-420}" python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/kernels/test_cuda_kernels.py tests/quantizer/test_backend_cuda.py \
    tests/run/test_pipeline.py tests/kernels/test_api_ext.py tests/kernels/test_cuda_build.py tests/kernels/test_tensor.py tests/run/test_lanes.py \
    tests/quantizer/test_backend.py tests/run/test_readahead.py tests/calibrate/test_layerwise.py} 2>&1 | tee "$OUT/gpu_tests.txt"
rc=${PIPESTATUS[0]}
if [ "${E2E:-1}" = 1 ]; then
    timeout "${E2E_S:-150}" python3 benchmarks/e2e_vs_copy.py --work /tmp/e2e --out "$OUT" --only dense --repeats 3 \
        --procs-per-gpu 0 --no-cpu 2>&1 | tail -n 30 | tee "$OUT/e2e.txt"
fi
exit $rc
