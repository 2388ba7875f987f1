#!/usr/bin/env bash
# Compile-check every kernel file (csrc/*.cu, with the headers) for sm_90 (software E2M1), sm_100a and
# sm_120a (hardware E2M1) with the local nvcc and the library's own flags; no GPU needed. Fails on any
# warning, spill or local-memory use, and checks in the PTX that the E2M1 conversion instruction is
# used exactly where the target has it and that no division is approximate. Also links the whole
# library once (all files, one nvcc call, as fp4convert/kernels/cuda/build.py does). ~1-2 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")"
NVCC="${NVCC:-nvcc}"
SRCS=(*.cu)
FLAGS=(-O3 -std=c++17 -fmad=false -Xptxas -warn-spills,-warn-lmem-usage -Werror all-warnings)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$NVCC" --version | tail -n 2

check() {  # arch, expect_hw (1/0)
    local arch="$1" hw="$2" src n kernels=0 cvt=0
    for src in "${SRCS[@]}"; do
        local base="${src%.cu}"
        "$NVCC" "${FLAGS[@]}" -gencode "arch=compute_${arch},code=sm_${arch}" -cubin -o "$tmp/$arch-$base.cubin" \
            "$src" 2> "$tmp/$arch-$base.log" || { cat "$tmp/$arch-$base.log"; echo "FAIL: $src for sm_$arch does not compile"; return 1; }
        if grep -Ei "warning|spill|lmem" "$tmp/$arch-$base.log"; then echo "FAIL: $src sm_$arch warnings/spills"; return 1; fi
        "$NVCC" -std=c++17 -fmad=false -arch="compute_${arch}" -ptx -o "$tmp/$arch-$base.ptx" "$src"
        if grep -q "rcp.approx\|div.approx\|div.full" "$tmp/$arch-$base.ptx"; then
            echo "FAIL: $src sm_$arch approximate division"; return 1
        fi
        n=$(grep -c "cvt.rn.satfinite.e2m1x2.f32" "$tmp/$arch-$base.ptx" || true)
        if [ "$hw" = 0 ] && [ "$n" != 0 ]; then echo "FAIL: $src sm_$arch must not use cvt e2m1x2"; return 1; fi
        if [ "$hw" = 0 ] && grep -q "e2m1x2" "$tmp/$arch-$base.ptx"; then echo "FAIL: $src sm_$arch uses an e2m1 cvt"; return 1; fi
        cvt=$((cvt + n))
        kernels=$((kernels + $(grep -c '^.visible .entry\|^.entry' "$tmp/$arch-$base.ptx" || true)))
    done
    # The quantize and self-test files encode E2M1: on a hardware target they must use the cvt.
    if [ "$hw" = 1 ]; then
        for base in fp4c_quantize fp4c_selftest; do
            grep -q "cvt.rn.satfinite.e2m1x2.f32" "$tmp/$arch-$base.ptx" \
                || { echo "FAIL: $base sm_$arch should use the hardware E2M1 conversion"; return 1; }
        done
    fi
    echo "ok: sm_$arch (${#SRCS[@]} files, $kernels kernels, e2m1 cvt x$cvt)"
}

pids=()
check 90 0 & pids+=($!)
check 100a 1 & pids+=($!)
wait "${pids[0]}"; wait "${pids[1]}"
check 120a 1
# The library as build.py makes it: every file in one nvcc call, one shared object.
"$NVCC" -O3 -std=c++17 -fmad=false -shared -Xcompiler -fPIC -gencode arch=compute_90,code=sm_90 \
    -o "$tmp/lib.so" "${SRCS[@]}"
syms="$(nm -D "$tmp/lib.so")"  # (not piped into grep -q: with pipefail, nm's SIGPIPE would fail the check)
for f in fp4c_abi_version fp4c_amax fp4c_quantize fp4c_dequantize fp4c_decode_fp8_block fp4c_decode_mxfp4_blocks \
         fp4c_e2m1_selftest fp4c_gptq_sweep; do
    grep -q " T $f\$" <<< "$syms" || { echo "FAIL: library lacks $f"; exit 1; }
done
echo "compile check passed"
