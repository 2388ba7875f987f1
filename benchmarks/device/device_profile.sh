#!/usr/bin/env bash
# One device call (issue 10): where the end-to-end time goes. Optional parts by environment:
# HOST_IO=1 the host's own ceilings (benchmarks/probes/host_io.py); TESTS="pytest args" GPU tests first;
# API=1 the public-API rows and benchmarks/probes/api_overhead.py; then the dense and MoE checkpoints beside `cp -r` + sync with every
# fp4convert run's --json stage times (e2e_vs_copy.py; E2E_ONLY=dense|moe, TORCH_ROW=1 adds the stacked
# backend's row, LANE_ROWS=1,4 rows with those --lanes); CPU_ROW=1 one 16-core --device cpu run of the dense checkpoint. Results in $OUT.
# Next call for issue 10: E2E_ONLY=moe API=1 HOST_IO=1 TESTS="-m cuda tests/quantizer/test_backend_cuda.py" bash benchmarks/device/device_profile.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FP4CONVERT_CACHE_DIR="${FP4CONVERT_CACHE_DIR:-/tmp/fp4c-cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; lscpu | head -20; df -h /tmp | tail -1
  git log -1 --oneline 2>/dev/null; } > "$OUT/env.txt" 2>&1
[ -n "${HOST_IO:-}" ] && python3 benchmarks/probes/host_io.py --pinned --work /tmp/hostio 2>&1 | tee "$OUT/host_io.json"
t0=$(date +%s)
python3 -c "import torch; from fp4convert.kernels.cuda import ops; ops.ensure_loaded(torch.device('cuda')); print('kernels ready')" 2>&1 | tail -2
echo "build: $(( $(date +%s) - t0 )) s"
if [ -n "${TESTS:-}" ]; then
    timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -x $TESTS 2>&1 | tail -15 | tee "$OUT/tests.txt"
fi
if [ -n "${API:-}" ]; then  # issue 10's public-API rows only (~20 s), and where a call's microseconds go
    python3 benchmarks/kernel_speed.py --sizes 16384 --no-peers --api-only --json "$OUT/api.json" 2>&1 | grep -i "api\|copy" | tee "$OUT/api.txt"
    python3 benchmarks/probes/api_overhead.py --out "$OUT/api_overhead.txt" 2>&1 | head -20
fi
python3 -X importtime -c "import torch" 2> "$OUT/importtime.txt"; tail -1 "$OUT/importtime.txt"
python3 -c "
import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); torch.cuda.init(); torch.zeros(1, device='cuda'); t2 = time.perf_counter()
from fp4convert.kernels.cuda import ops; ops.ensure_loaded(torch.device('cuda')); t3 = time.perf_counter()
print(f'import torch {t1 - t0:.2f} s, CUDA context {t2 - t1:.2f} s, kernels from cache {t3 - t2:.2f} s')"
timeout ${E2E_TIMEOUT:-300} python3 benchmarks/e2e_vs_copy.py --work /tmp/e2e --out "$OUT" --layers "${E2E_LAYERS:-8}" \
    --repeats "${E2E_REPEATS:-3}" --procs-per-gpu 0 --no-cpu ${TORCH_ROW:+--torch-row} ${LANE_ROWS:+--lane-rows $LANE_ROWS} ${E2E_ONLY:+--only $E2E_ONLY} 2>&1 | tee "$OUT/e2e_vs_copy.txt"
if [ -n "${CPU_ROW:-}" ] && [ -d /tmp/e2e/dense ]; then
    rm -rf /tmp/e2e/cpuout; t0=$(date +%s.%N)
    timeout 150 python3 -m fp4convert quantize /tmp/e2e/dense /tmp/e2e/cpuout --device cpu --json --max-shard-size 512MB \
        > "$OUT/cpu_dense.json" 2> "$OUT/cpu_dense.err"; sync
    python3 -c "
import json; d = json.load(open('$OUT/cpu_dense.json')); print(d['wall_s'], d['stages_s'])" || tail -5 "$OUT/cpu_dense.err"
fi
rm -rf /tmp/e2e /tmp/hostio
