#!/usr/bin/env bash
# One device call: where the threads of a CUDA conversion spend their time (py-spy, carried as a
# wheel in .whl/), on the dense 8-layer checkpoint of e2e_vs_copy.py; raw samples in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FP4CONVERT_CACHE_DIR="${FP4CONVERT_CACHE_DIR:-/tmp/fp4c-cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-deps .whl/py_spy-*.whl 2>&1 | tail -1
python3 -c "import torch; from fp4convert.kernels.cuda import ops; ops.ensure_loaded(torch.device('cuda')); print('kernels ready')" 2>&1 | tail -1
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import e2e_vs_copy as e; e.dense(Path('/tmp/pd'), ${LAYERS:-8}); print(e.warm(Path('/tmp/pd')))"
q="python3 -m fp4convert quantize /tmp/pd /tmp/pdo --json --max-shard-size 512MB --device cuda"
for mode in idle gil; do
    rm -rf /tmp/pdo; sync
    flag=--idle; [ $mode = gil ] && flag=--gil
    py-spy record -r 200 --threads $flag -f raw -o "$OUT/direct_$mode.txt" -- $q > "$OUT/direct_$mode.json" 2> "$OUT/direct_$mode.err"
    sync; python3 -c "import json; d = json.load(open('$OUT/direct_$mode.json')); print('$mode', d['wall_s'], d['stages_s'])" || tail -5 "$OUT/direct_$mode.err"
done
for i in 1 2; do
    rm -rf /tmp/pdo; sync; t0=$(date +%s%N); $q > "$OUT/direct_plain.json"; sync; t1=$(date +%s%N)
    python3 -c "import json; d = json.load(open('$OUT/direct_plain.json')); print('direct, no profiler: process', ($t1 - $t0) / 1e9, 'convert()', d['wall_s'], d['stages_s'])"
done
rm -rf /tmp/pdo /tmp/pd
