#!/usr/bin/env bash
# One device call: the GPU pipeline tests, the many-expert MoE end to end beside `cp -r` + sync
# (GPU rows, bytes compared across runs), and an A/B of the CPU converter's single malloc arena on a
# 2-layer dense checkpoint with 16 cores (the 16-core --device cpu row fell from 22.9 s to 80 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FP4CONVERT_CACHE_DIR="${FP4CONVERT_CACHE_DIR:-/tmp/fp4c-cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
python3 -c "import torch; from fp4convert.kernels.cuda import ops; ops.ensure_loaded(torch.device('cuda'))"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/run/test_pipeline.py tests/run/test_convert.py -k cuda 2>&1 | tail -2 | tee "$OUT/pipeline_tests.txt"
timeout 200 python3 benchmarks/e2e_vs_copy.py --work /tmp/e2e --out "$OUT" --only moe --repeats 3 --no-cpu \
    --procs-per-gpu 0 2>&1 | tail -8 | tee "$OUT/moe.txt"
rm -rf /tmp/e2e
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import e2e_vs_copy as e; e.dense(Path('/tmp/d2'), 2)"
cat /tmp/d2/*.safetensors > /dev/null
for arena in one default one default; do
    python3 -c "
import sys, time
from fp4convert import cli
from fp4convert.quantizer.backends import cpu as pipeline
if '$arena' == 'default':
    pipeline._one_malloc_arena = lambda: None
sys.argv = ['fp4convert', 'quantize', '/tmp/d2', '/tmp/d2out', '--device', 'cpu', '-q', '--overwrite']
t0 = time.perf_counter()
try:
    cli.main()
except SystemExit as e:
    assert not e.code, e.code
print('cpu 16 cores, dense 2 layers, malloc arena $arena: %.2f s' % (time.perf_counter() - t0))
" 2>&1 | tail -1 | tee -a "$OUT/cpu_arena.txt"
done
