#!/usr/bin/env bash
# Issue 21 item 8, one device call: at DEFAULT settings (no --max-shard-size), dense (8 Llama-3-8B layers) and
# MoE (64 experts x 8 layers), rows interleaved, median of 3, each command followed by `sync`:
#   cp -r + sync | write-only floor (the output's bytes copied from the page cache + sync) |
#   fp4convert --device cuda | fp4convert --device cpu        (+ every fp4convert run's --json stage times)
# Results in $OUT: e2e_vs_copy.{json,md,txt}, env.txt, and with TESTS=1 the GPU tests of every changed GPU path
# (tests.txt). The kernel build is cached in FP4CONVERT_CACHE_DIR.
#   TESTS=1 bash benchmarks/device/device_e2e.sh          # build, GPU tests, then the benchmark
#   E2E_ONLY=dense|moe, E2E_REPEATS=N, E2E_EXTRA="--shard 512MB --lane-rows 1,3 --torch-row" for more rows
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FP4CONVERT_CACHE_DIR="${FP4CONVERT_CACHE_DIR:-/tmp/fp4c-cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; lscpu | head -20; df -h /tmp | tail -1
  findmnt -no FSTYPE -T /tmp; git log -1 --oneline 2>/dev/null; } > "$OUT/env.txt" 2>&1
t0=$(date +%s)
python3 -c "import torch; from fp4convert.kernels.cuda import ops; ops.ensure_loaded(torch.device('cuda')); print('kernels ready')" 2>&1 | tail -2
python3 -c "from fp4convert import cpu_kernel; cpu_kernel.load(); print('cpu kernel ready')" 2>&1 | tail -2
echo "build: $(( $(date +%s) - t0 )) s"
if [ -n "${TESTS:-}" ]; then
    timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m cuda tests/quantizer/test_backend_cuda.py \
        tests/run/test_pipeline.py tests/run/test_convert.py tests/run/test_lanes.py ${TESTS_EXTRA:-} 2>&1 | tail -15 | tee "$OUT/tests.txt"
fi
timeout ${E2E_TIMEOUT:-540} python3 benchmarks/e2e_vs_copy.py --work /tmp/e2e --out "$OUT" --layers 8 --moe-layers 8 \
    --experts 64 --repeats "${E2E_REPEATS:-3}" --procs-per-gpu 0 --floor ${E2E_ONLY:+--only $E2E_ONLY} \
    ${E2E_EXTRA:-} 2>&1 | tee "$OUT/e2e_vs_copy.txt"
rm -rf /tmp/e2e
