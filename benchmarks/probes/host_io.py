"""The host's own ceilings for the converter's stages, one number each (issue 10's design inputs).

sha256 per thread, memcpy, reading from the page cache (pageable and pinned buffers), writing into
the page cache, and fsync of what was written: the converter's reader, writer and hash threads
cannot beat these. Prints JSON.

    python benchmarks/probes/host_io.py --work /tmp/hostio [--pinned]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable


def _fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/hostio"))
    ap.add_argument("--mb", type=int, default=1024, help="data size per measurement, MB")
    ap.add_argument("--pinned", action="store_true", help="also read into CUDA pinned memory")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    n = a.mb << 20
    gb = n / 1e9
    out: dict = {"cpus": os.cpu_count()}
    try:
        flags = Path("/proc/cpuinfo").read_text()
        out["cpu"] = next((ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("model name")), "?")
        out["sha_ni"] = " sha_ni " in flags or " sha_ni\n" in flags
    except OSError:
        pass
    data = os.urandom(64 << 20) * (n // (64 << 20))
    chunk = 16 << 20
    view = memoryview(data)

    def sha() -> None:
        h = hashlib.sha256()
        for i in range(0, n, chunk):
            h.update(view[i : i + chunk])

    out["sha256_1thread_GBps"] = round(gb / best(sha), 2)

    def sha4() -> None:
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda k: hashlib.sha256(view[k * n // 4 : (k + 1) * n // 4]).digest(), range(4)))

    out["sha256_4threads_GBps"] = round(gb / best(sha4), 2)
    dst = bytearray(n)
    out["memcpy_GBps"] = round(gb / best(lambda: dst.__setitem__(slice(None), data)), 2)
    path = a.work / "blob"

    def write() -> None:
        with open(path, "wb") as f:
            for i in range(0, n, chunk):
                f.write(view[i : i + chunk])

    def write_fsync() -> None:
        with open(path, "wb") as f:
            for i in range(0, n, chunk):
                f.write(view[i : i + chunk])
            f.flush()
            os.fsync(f.fileno())

    os.sync()
    out["write_pagecache_GBps"] = round(gb / best(write), 2)
    os.sync()
    out["write_fsync_GBps"] = round(gb / best(write_fsync), 2)

    def write4() -> None:  # four files side by side: does writing into the page cache scale with threads?
        def one(k: int) -> None:
            with open(a.work / f"blob{k}", "wb") as f:
                for i in range(k * n // 4, (k + 1) * n // 4, chunk):
                    f.write(view[i : min(i + chunk, (k + 1) * n // 4)])

        with ThreadPoolExecutor(4) as ex:
            list(ex.map(one, range(4)))

    os.sync()
    out["write_pagecache_4threads_GBps"] = round(gb / best(write4), 2)

    def write4_fsync() -> None:  # the same, each file synced: the disk's rate with four writers
        write4()
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda k: _fsync_path(a.work / f"blob{k}"), range(4)))

    os.sync()
    out["write_fsync_4threads_GBps"] = round(gb / best(write4_fsync), 2)
    for k in range(4):
        (a.work / f"blob{k}").unlink()

    def write8_fsync() -> None:
        def one(k: int) -> None:
            with open(a.work / f"blob{k}", "wb") as f:
                for i in range(k * n // 8, (k + 1) * n // 8, chunk):
                    f.write(view[i : min(i + chunk, (k + 1) * n // 8)])
                f.flush()
                os.fsync(f.fileno())

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(one, range(8)))

    os.sync()
    out["write_fsync_8threads_GBps"] = round(gb / best(write8_fsync), 2)
    for k in range(8):
        (a.work / f"blob{k}").unlink()

    # O_DIRECT: the disk reads the buffer itself (no copy into the page cache, nothing dirty to sync).
    import mmap

    aligned = mmap.mmap(-1, n)  # page-aligned, as O_DIRECT needs
    aligned[:] = data
    av = memoryview(aligned)

    def write_direct(threads: int) -> Callable[[], None]:
        def one(k: int) -> None:
            fd = os.open(a.work / f"direct{k}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                for i in range(k * n // threads, (k + 1) * n // threads, chunk):
                    os.write(fd, av[i : min(i + chunk, (k + 1) * n // threads)])
                os.fdatasync(fd)
            finally:
                os.close(fd)

        def run() -> None:
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(one, range(threads)))

        return run

    try:
        out["write_odirect_GBps"] = round(gb / best(write_direct(1)), 2)
        out["write_odirect_4threads_GBps"] = round(gb / best(write_direct(4)), 2)
        out["write_odirect_8threads_GBps"] = round(gb / best(write_direct(8)), 2)
    except OSError as exc:
        out["write_odirect_error"] = str(exc)
    for k in range(8):
        (a.work / f"direct{k}").unlink(missing_ok=True)
    with open(path, "wb") as f:  # the source of the in-kernel copy below
        f.write(view)

    def copy_range() -> None:  # what `cp` does on Linux: an in-kernel copy, no user-space buffer
        with open(path, "rb") as fin, open(a.work / "copy", "wb") as fout:
            done = 0
            while done < n:
                done += os.copy_file_range(fin.fileno(), fout.fileno(), n - done, done, done)
            fout.flush()
            os.fsync(fout.fileno())

    os.sync()
    out["copy_file_range_fsync_GBps"] = round(gb / best(copy_range), 2)
    (a.work / "copy").unlink()
    buf = bytearray(n)

    def read() -> None:
        with open(path, "rb") as f:
            f.readinto(memoryview(buf))

    read()
    out["read_pagecache_GBps"] = round(gb / best(read), 2)
    if a.pinned:
        import torch

        from fp4convert.storage.safetensors import tensor_memoryview

        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pv = tensor_memoryview(pinned)

        def read_pinned() -> None:
            with open(path, "rb") as f:
                f.readinto(pv)

        out["read_pagecache_pinned_GBps"] = round(gb / best(read_pinned), 2)

        def read_pinned4() -> None:
            def part(k: int) -> None:
                with open(path, "rb") as f:
                    f.seek(k * n // 4)
                    f.readinto(pv[k * n // 4 : (k + 1) * n // 4])

            with ThreadPoolExecutor(4) as ex:
                list(ex.map(part, range(4)))

        out["read_pagecache_pinned_4threads_GBps"] = round(gb / best(read_pinned4), 2)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")

        def h2d() -> None:
            dev.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

        h2d()
        out["h2d_pinned_GBps"] = round(gb / best(h2d), 2)
        t0 = time.perf_counter()
        torch.empty(n, dtype=torch.uint8, pin_memory=True)
        out["pin_alloc_1GB_s"] = round(time.perf_counter() - t0, 3)
    path.unlink()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
