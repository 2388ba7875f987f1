"""Throughput of the compiled CPU kernel per thread count, beside memcpy bandwidth (and the torch path).

For one bf16 weight (default 4096 x 8192, 64 MiB, fresh random values), for each thread count: the
kernel's amax pass and its quantize pass under every scale rule, as GB/s of bf16 input (best of
``--repeats`` wall-clock runs, outputs allocated per call as the converter does), and a memcpy of the
same bytes on the same number of threads (the kernel's own threaded memcpy, so both sides have the
same job split). ``--torch`` adds the torch path (``FP4CONVERT_CPU_KERNEL=0``'s code) at the same
torch thread counts, ``--build`` times a cold build of the kernel into a temporary cache.

    python benchmarks/cpu_kernel.py --threads 1,2 --json /tmp/cpu_kernel.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RULES = [("nvfp4", "max"), ("nvfp4", "4over6"), ("nvfp4", "mse"), ("nvfp4", "wmse"),
         ("mxfp4", "floor"), ("mxfp4", "rceil"), ("mxfp4", "mse"), ("mxfp4", "wmse")]


def best(fn, repeats: int) -> float:
    fn()  # warm: page faults of fresh outputs, thread start-up
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--threads", default="", help="comma-separated thread counts (default 1, 2, 4, ... up to the cores)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rotate", action="store_true", help="with Had16")
    ap.add_argument("--torch", action="store_true", help="also time the torch path")
    ap.add_argument("--build", action="store_true", help="time a cold build of the kernel (temporary cache)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch

    from fp4convert.kernels import cpu, cpu_lib as cpu_kernel
    from fp4convert.numerics import reference as ref

    info = {"cpus": os.cpu_count(), "shape": [args.rows, args.cols], "rotate": args.rotate}
    if args.build:
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["FP4CONVERT_CACHE_DIR"] = tmp
            t0 = time.perf_counter()
            cpu_kernel.load()
            info["cold_build_s"] = round(time.perf_counter() - t0, 2)
            del os.environ["FP4CONVERT_CACHE_DIR"]
        print(f"cold build: {info['cold_build_s']} s", flush=True)
    lib = cpu_kernel.load()
    cores = os.cpu_count() or 1
    counts = [int(t) for t in args.threads.split(",") if t] or sorted({1, 2, 4, 8, 16, 32, cores} & set(range(1, cores + 1)))
    rot = "had16" if args.rotate else None
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1, args.rows, args.cols, generator=g) * 0.02).to(torch.bfloat16)
    gb = x.numel() * 2 / 1e9
    gs = ref.global_scale(cpu_kernel.amax(lib, x, rot, cores))
    dst = torch.empty_like(x)
    results = []
    for n in counts:
        row = {"threads": n}
        row["memcpy"] = gb / best(lambda: lib.fp4c_cpu_memcpy(dst.data_ptr(), x.data_ptr(), x.numel() * 2, n), args.repeats)
        row["amax"] = gb / best(lambda: cpu_kernel.amax(lib, x, rot, n), args.repeats)
        for scheme, rule in RULES:
            g_ = gs if scheme == "nvfp4" else None
            row[f"{scheme}:{rule}"] = gb / best(lambda: cpu_kernel.quantize(lib, x, scheme, g_, rot, True, rule, n),
                                                args.repeats)
        if args.torch:
            before = torch.get_num_threads()
            torch.set_num_threads(n)
            try:
                for scheme, rule in (("nvfp4", "4over6"), ("mxfp4", "wmse")):
                    g_ = gs if scheme == "nvfp4" else None
                    row[f"torch {scheme}:{rule}"] = gb / best(
                        lambda: cpu._quantize_torch(x, scheme, g_, rot, True, rule), max(1, args.repeats // 2))
            finally:
                torch.set_num_threads(before)
        results.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    cols = [k for k in results[0] if k != "threads"]
    lines = [f"{args.rows}x{args.cols} bf16{' + Had16' if args.rotate else ''}, {cores} CPUs; GB/s of bf16 input "
             f"(best of {args.repeats}); scales swizzled", "",
             "| threads | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in results:
        lines.append(f"| {r['threads']} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({**info, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
