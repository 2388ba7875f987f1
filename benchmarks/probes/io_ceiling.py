"""The converter's I/O ceiling: the whole CPU pipeline (read-ahead, writer thread, NaN/Inf checks of
kept tensors, sha256, shards, index, manifest) with quantization replaced by zero outputs, beside
`cp -r` + `sync` of the same checkpoint. What stays when the kernels cost nothing (issue 10).

    python benchmarks/probes/io_ceiling.py --work /tmp/ioc --layers 2 --repeats 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def stub_pipeline() -> None:
    import torch

    from fp4convert.quantizer.backend import MatrixOut, Result
    from fp4convert.quantizer.backends.cpu import CpuBackend
    from fp4convert.kernels.tensor import as_bytes

    def quantize(self, item, inputs, release):
        bs = self.s.scheme.block_size
        outs = []
        for _, info in inputs[1]:
            m, k = info.shape
            outs.append(MatrixOut(as_bytes(torch.zeros(m, k // 2, dtype=torch.uint8)),
                                  as_bytes(torch.zeros(m, k // bs, dtype=torch.uint8)), 1.0, 2688.0))
        release(None)
        return lambda: Result(outs, [False] * len(outs))

    CpuBackend.quantize = quantize


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
    from fp4convert.run.convert import convert

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
