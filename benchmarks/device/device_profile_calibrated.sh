#!/usr/bin/env bash
# Where a calibrated run's seconds go outside its stages: cProfile of `--input-weights random` on a 2-layer
# Llama-3-8B-shaped checkpoint (the data-free run beside it), after a warm-up. Results under $OUT.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FP4CONVERT_CACHE_DIR=/tmp/fp4convert-cache PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH="$PWD"
python3 -c "
import sys; sys.path.insert(0,'benchmarks'); import e2e_vs_copy, iw_cost
from pathlib import Path
src=Path('/tmp/pc/src'); e2e_vs_copy.dense(src, 2); iw_cost.char_tokenizer(src)"
for i in 1 2; do python3 -m fp4convert quantize /tmp/pc/src /tmp/pc/w --input-weights random -q --overwrite; done
for row in none random; do
  opts=""; [ "$row" = random ] && opts="--input-weights random"
  /usr/bin/time -f "$row wall %e s" python3 -m cProfile -o "$OUT/$row.prof" -m fp4convert quantize /tmp/pc/src /tmp/pc/o $opts --json --overwrite > "$OUT/$row.json" 2>> "$OUT/times.txt"
  python3 -c "
import pstats,sys; p=pstats.Stats('$OUT/$row.prof'); p.sort_stats('cumulative').print_stats(60)" > "$OUT/${row}_cum.txt" 2>&1
done
cat "$OUT/times.txt"
