"""The converter's I/O ceiling: the whole CPU pipeline (read-ahead, writer thread, NaN/Inf checks of
kept tensors, sha256, shards, index, manifest) with quantization replaced by zero outputs, beside
`cp -r` + `sync` of the same checkpoint. What stays when the kernels cost nothing (issue 10).

    python benchmarks/io_ceiling.py --work /tmp/ioc --layers 2 --repeats 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def stub_pipeline() -> None:
    import torch

    from fp4convert import pipeline

    def run(self, batch, hosts, s, free):
        n, bs = len(batch.members), s.scheme.block_size
        packed = [torch.zeros(x.shape[0], x.shape[1] // 2, dtype=torch.uint8) for x in hosts]
        scale = [torch.zeros(x.shape[0], x.shape[1] // bs, dtype=torch.uint8).view(torch.float8_e4m3fn)
                 for x in hosts]
        free(None)
        amax = torch.ones(n)
        return lambda: (packed, scale, [False] * n, amax, amax, amax * 2688, None)

    pipeline.CpuBackend.run = run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/ioc"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    import e2e_vs_copy

    src, out, cp = a.work / "src", a.work / "out", a.work / "cp"
    if not src.exists():
        e2e_vs_copy.dense(src, a.layers)
    e2e_vs_copy.warm(src)
    stub_pipeline()
    from fp4convert.config import ConvertConfig
    from fp4convert.convert import convert

    conv, copy = [], []
    for _ in range(a.repeats):
        shutil.rmtree(cp, ignore_errors=True)
        t0 = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(cp)], check=True)
        subprocess.run(["sync"], check=True)
        copy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        convert(src, out, ConvertConfig(device="cpu", overwrite=True))
        subprocess.run(["sync"], check=True)
        conv.append(time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in src.iterdir()) / 1e9
    print(f"{size:.2f} GB in; median of {a.repeats}: cp -r + sync {statistics.median(copy):.2f} s "
          f"({', '.join(f'{t:.2f}' for t in copy)}); converter with quantization stubbed + sync "
          f"{statistics.median(conv):.2f} s ({', '.join(f'{t:.2f}' for t in conv)}); "
          f"ratio {statistics.median(conv) / statistics.median(copy):.2f}x")
    shutil.rmtree(cp, ignore_errors=True)


if __name__ == "__main__":
    main()
