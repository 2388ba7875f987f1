#!/usr/bin/env bash
# One device call: the whole test suite on the GPU, then the end-to-end converter benchmark
# (--device cuda vs --device cpu) on a Llama-8B-shaped checkpoint. Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FP4CONVERT_CACHE_DIR=/tmp/fp4c-cache
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cpus', __import__('os').cpu_count())" | tee -a "$OUT/env.txt"
python3 -m pytest -q -x tests/ -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/tests.txt"
python3 benchmarks/converter.py --workdir /tmp/e2e --device cuda --device cpu \
    --layers "${E2E_LAYERS:-8}" --hidden 4096 --inter 14336 --vocab 128256 --shards 4 \
    --repeats "${E2E_REPEATS:-2}" --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.txt"
