#!/usr/bin/env bash
# One device call (issue 10): build the kernels, then side by side, median of 3, warm page cache:
# `cp -r` + `sync`, fp4convert on 1 GPU, on all visible GPUs (torchrun, when more than one), on 1 GPU
# with 4 torchrun processes, and --device cpu; for a dense Llama-3-8B-shaped 8-layer checkpoint (5.6 GB)
# and a 64-expert x 8-layer MoE (~3 GB), both generated here. JSON + markdown table in $OUT.
# Budget: < 9 min on an H100 with 16 cores and 64 GB disk (E2E_REPEATS / E2E_LAYERS shrink it).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FP4CONVERT_CACHE_DIR="${FP4CONVERT_CACHE_DIR:-/tmp/fp4c-cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
WORK="${E2E_WORK:-/tmp/e2e}"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  python3 -c "import torch, os; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'cpus', os.cpu_count())"
  df -h "$(dirname "$WORK")" | tail -1; git log -1 --oneline 2>/dev/null || true; } | tee "$OUT/env.txt"
t0=$(date +%s)
python3 -c "import torch; from fp4convert.kernels.cuda import ops; ops.ensure_loaded(torch.device('cuda')); print('kernels ready')" \
    2>&1 | tail -3 | tee "$OUT/build.txt"
echo "build: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/build.txt"
python3 benchmarks/e2e_vs_copy.py --work "$WORK" --out "$OUT" --layers "${E2E_LAYERS:-8}" \
    --repeats "${E2E_REPEATS:-3}" --procs-per-gpu "${E2E_PROCS_PER_GPU:-4}" 2>&1 | tee "$OUT/e2e_vs_copy.txt"
echo "total: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/e2e_vs_copy.txt"
rm -rf "$WORK"
