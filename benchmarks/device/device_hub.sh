#!/usr/bin/env bash
# One device call (issue 21 item 7 + the GPU tests of main):
#   MODE="tests hub" runs both. MODE=tests: build the kernels, then every test module that touches the GPU (tests.txt; TESTS= other files);
#   MODE=hub:   a Hub conversion against the plain download of the same files on the H100 host, whose
#               converter outruns the link (benchmarks/hub_prefetch.py; hub_*.json / hub_*.txt).
#   HUB_RATE (MB/s, default 40), HUB_REPS (3), HUB_DEVICES ("cpu auto"), HUB_CHECKOUTS ("main=."; e.g.
#   "before=bench_main after=." with an older tree unpacked in bench_main/ by git archive; bench_main/ is
#   git-ignored, so pass it to the device with carry=["bench_main"]).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FP4CONVERT_CACHE_DIR="${FP4CONVERT_CACHE_DIR:-/tmp/fp4c-cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; df -h /tmp | tail -1; git log -1 --oneline; } > "$OUT/env.txt" 2>&1
t0=$(date +%s)
python3 -c "import torch; from fp4convert.kernels.cuda import ops; ops.ensure_loaded(torch.device('cuda')); print('kernels ready')" 2>&1 | tail -1
python3 -c "from fp4convert import cpu_kernel; cpu_kernel.load(); print('cpu kernel ready')" 2>&1 | tail -1
echo "build: $(( $(date +%s) - t0 )) s"
TESTS="${TESTS:-tests/kernels/test_cuda_kernels.py tests/quantizer/test_backend_cuda.py tests/run/test_pipeline.py tests/run/test_convert.py
    tests/run/test_lanes.py tests/quantizer/test_backend.py tests/kernels/test_cuda_build.py tests/kernels/test_tensor.py tests/kernels/test_api_ext.py
    tests/run/test_readahead.py tests/quantizer/test_backend_cpu_native.py}"
for mode in ${MODE:-tests}; do
case "$mode" in
tests)
    timeout ${TESTS_TIMEOUT:-480} python3 -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tail -25 | tee "$OUT/tests.txt" ;;
hub)
    r=${HUB_RATE:-40}
    timeout ${HUB_TIMEOUT:-540} python3 benchmarks/hub_prefetch.py $(for c in ${HUB_CHECKOUTS:-main=.}; do echo --checkout "$c"; done) --device ${HUB_DEVICES:-cpu auto} \
        --rate "$r" --hidden 2048 --layers 16 --shards 8 --reps ${HUB_REPS:-3} --work /tmp/hubw \
        --json "$OUT/hub_rate$r.json" 2>&1 | tee "$OUT/hub_rate$r.txt" ;;
esac
done
