"""Where a public-API call's host microseconds go (issue 10's given-amax row): each piece of
``fp4convert.quantize(x, "nvfp4", global_amax=a)`` timed alone on a tiny CUDA matrix, then a cProfile
of the whole call. ``python benchmarks/probes/api_overhead.py [--out FILE]``; needs a CUDA GPU."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import fp4convert
from fp4convert.kernels.cuda import ops


def per_call_us(fn, n: int = 20000) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(best)[len(best) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.randn(128, 256, device=dev).to(torch.bfloat16)
    a = torch.ones((), device=dev)
    lib = ops._lib(dev)
    m, k = x.shape
    rows = []

    def row(name: str, fn, n: int = 20000) -> None:
        us = per_call_us(fn, n)
        rows.append((name, us))
        print(f"{us:8.2f} us  {name}", flush=True)

    row("x.device", lambda: x.device)
    row("x.is_contiguous() + x.data_ptr()", lambda: (x.is_contiguous(), x.data_ptr()))
    row("torch.empty uint8 [M, K/2] on the GPU", lambda: torch.empty((m, k // 2), dtype=torch.uint8, device=dev))
    row("torch.empty float8 [M, K/16] on the GPU", lambda: torch.empty((m, k // 16), dtype=torch.float8_e4m3fn, device=dev))
    row("torch.empty fp32 [] on the GPU", lambda: torch.empty((), dtype=torch.float32, device=dev))
    row("3 x torch.empty (packed, scale, gs)", lambda: (torch.empty((m, k // 2), dtype=torch.uint8, device=dev),
                                                        torch.empty((m, k // 16), dtype=torch.uint8, device=dev),
                                                        torch.empty((), dtype=torch.float32, device=dev)))
    row("scale.view(float8)", lambda: x.view(torch.int16).view(torch.bfloat16))
    row("ops._lib(dev) (set device)", lambda: ops._lib(dev))
    row("ops._stream(dev)", lambda: ops._stream(dev))
    row("ctypes: fp4c_abi_version()", lambda: lib.fp4c_abi_version())
    row("ops._host_flags(lib, 1)", lambda: ops._host_flags(lib, 1))
    row("ops.quantize(host_flag) launch, no sync", lambda: ops.quantize(x, "nvfp4", a, None, False, host_flag=True), 5000)
    row("ops.quantize(host_flag) + sync", lambda: ops.quantize(x, "nvfp4", a, None, False, host_flag=True)[3](), 5000)
    from fp4convert.kernels.cuda import api_ext

    glue = api_ext.wait()
    saved = api_ext._state.get("module")
    api_ext._state["module"] = None
    row("fp4convert.quantize(x, 'nvfp4', global_amax=a), Python path",
        lambda: fp4convert.quantize(x, "nvfp4", global_amax=a), 5000)
    api_ext._state["module"] = saved
    row(f"fp4convert.quantize(x, 'nvfp4', global_amax=a), C++ glue{'' if glue else ' (not built)'}",
        lambda: fp4convert.quantize(x, "nvfp4", global_amax=a), 5000)
    row("torch.cuda.synchronize()", torch.cuda.synchronize)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5000):
        fp4convert.quantize(x, "nvfp4", global_amax=a)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(f"{us:8.2f} us  {name}" for name, us in rows) + "\n\n" + s.getvalue())


if __name__ == "__main__":
    main()
