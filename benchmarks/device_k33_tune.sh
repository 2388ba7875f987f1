#!/usr/bin/env bash
# Issue 33: the sm_90 search kernels' occupancy and work per thread, tuned by measurement. Builds the library
# once per (FP4C_SM90_SEARCH_CTAS, FP4C_SEARCH_GPT) pair (a wrapper around nvcc adds the -D flags; each pair
# its own cache folder), the builds side by side, then benchmarks/kernels.py --sizes 16384 --no-peers for
# each pair one after the other on the same GPU. Results: $OUT/k33_CTAS_GPT.json and a summary table.
#   CONFIGS="3,2 4,2 2,2 3,1 4,1 3,4" bash benchmarks/device_k33_tune.sh
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
configs="${CONFIGS:-3,2 4,2 2,2 3,1 4,1 3,4}"
for c in $configs; do
    ctas="${c%,*}"; gpt="${c#*,}"
    w="/tmp/nvcc_${ctas}_${gpt}"
    printf '#!/bin/sh\nexec "%s" -DFP4C_SM90_SEARCH_CTAS=%s -DFP4C_SEARCH_GPT=%s "$@"\n' "$NVCC" "$ctas" "$gpt" > "$w"
    chmod +x "$w"
    FP4CONVERT_NVCC="$w" FP4CONVERT_CACHE_DIR="/tmp/k33cache_${ctas}_${gpt}" python3 -c \
        "from fp4convert.kernels.cuda import ops; print('$c', ops.available())" > "$OUT/build_${ctas}_${gpt}.txt" 2>&1 &
done
wait
for c in $configs; do
    ctas="${c%,*}"; gpt="${c#*,}"
    echo "== CTAS=$ctas GPT=$gpt $(cat "$OUT/build_${ctas}_${gpt}.txt" | tail -n 1)"
    FP4CONVERT_NVCC="/tmp/nvcc_${ctas}_${gpt}" FP4CONVERT_CACHE_DIR="/tmp/k33cache_${ctas}_${gpt}" timeout 150 \
        python3 benchmarks/kernels.py --sizes 16384 --no-peers --json "$OUT/k33_${ctas}_${gpt}.json" > "$OUT/k33_${ctas}_${gpt}.txt" 2>&1
done
python3 - "$OUT" $configs <<'PY'
import json, sys
out, configs = sys.argv[1], sys.argv[2:]
rows = {}
for c in configs:
    ctas, gpt = c.split(",")
    try:
        d = json.load(open(f"{out}/k33_{ctas}_{gpt}.json"))
    except Exception as e:  # noqa: BLE001
        print(c, "no result", e); continue
    for r in d["rows"]:
        if any(k in r["pass"] for k in ("4over6", "mse", "wmse", "api", "fp4convert.quantize")):
            rows.setdefault(r["pass"], {})[c] = r["%copy"]
print("pass".ljust(60), *[c.rjust(8) for c in configs])
for p, v in rows.items():
    print(p[:60].ljust(60), *[f"{v.get(c, float('nan')):8.1f}" for c in configs])
PY
