"""The overlapped work loop: read, quantize and write of successive batches run at the same time.

Three stages, each in its own thread, joined by bounded queues (so host memory stays bounded):

- reading (:class:`fp4convert.readahead.ReadAhead`): the next batch's source tensors, in pinned
  buffers for CUDA;
- quantizing (the calling thread): a *batch* is one work unit or, on CUDA, several consecutive
  units (all experts of a layer); its tensors are grouped by shape and each group is one batched
  ``[B, M, K]`` launch of pass 1 (amax per matrix) and pass 2 (quantize with the unit's global
  amax). On CUDA the host-to-device copies run on a copy stream, the passes and the device-to-host
  copies (into pinned memory) on a compute stream; nothing waits for the GPU here. On the CPU each
  matrix is cut into row slices that a pool of single-threaded-torch workers runs (:class:`CpuBackend`);
- writing (:class:`WriteBehind`): waits for the batch's CUDA event (the one host sync per batch),
  checks the non-finite flags, then streams the tensors into their shards in plan order (file
  writes and sha256 release the GIL, so they overlap the next batch's quantization on the CPU too).

The CPU path runs the same scheduling (batches, deferred checks, ordered write-behind), and the
tests run the CUDA backend's stacking logic on the CPU (:class:`StackedBackend` with a CPU device). The bytes never depend on how units are batched:
amax and quantization are per matrix, and the global amax per unit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from . import reference as ref
from . import stages
from .errors import nonfinite_error
from .swizzle import swizzle_scales
from .tensor import QuantizedTensor

# The torch-free parts (the writer thread, batching) live in fp4convert.schedule; re-exported here.
from .schedule import (CPU_BATCH_BYTES, CPU_BATCH_UNITS, CUDA_BATCH_BYTES, CUDA_BATCH_UNITS,  # noqa: F401
                       WRITE_DEPTH, Batch, Job, Settings, WriteBehind, make_batches)


class CpuBackend:
    """Same scheduling on host tensors, each member split into row slices run by a thread pool.

    Every pool thread runs torch single-threaded (the caller sets one intra-op thread): torch ops
    release the GIL, so the cores are used without OpenMP's spin-waiting, which beside the reader
    and writer threads (or any other load) burnt 2-6x the CPU time. Slices hold ``CHUNK_ELEMS /
    workers`` elements, so the pool's temporaries together stay those of one chunk, and one unit is
    in work at a time (its amax slices first, then its quantize slices, while the next unit's amax
    may start). Slices are quantized with linear scales and swizzled once, whole: the same bytes.
    """

    def __init__(self, workers: int = 1) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from . import cpu

        self.ops = cpu
        self.workers = max(1, workers)
        if self.workers <= 4:  # a small machine: memory first (a 16-core H100 host ran 13% faster without)
            _one_malloc_arena()
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="fp4convert-quantize")

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _slices(self, x: torch.Tensor) -> list[tuple[int, int]]:
        # CHUNK_ELEMS / workers elements per slice, but never below a quarter chunk: each slice is a few
        # dozen torch calls whose dispatch holds the GIL, and 16 threads on 64K-element slices likely
        # queue on it (suspected, not yet measured, cause of the 16-core H100 host's --device cpu row
        # falling from 22.9 s to 80 s; a 2-4 core machine keeps its slices, and its memory, as before).
        m, k = x.shape
        rows = max(1, max(self.ops.CHUNK_ELEMS // self.workers, self.ops.CHUNK_ELEMS // 4) // max(k, 1))
        return [(r0, min(m, r0 + rows)) for r0 in range(0, m, rows)]

    def run(self, batch: Batch, hosts: list[torch.Tensor], s: Settings, free: Callable) -> Callable[[], tuple]:
        """Pass 1 here (waits for its slices), pass 2 started; ``free(None)`` once the inputs are done."""
        n = len(batch.members)
        parts = [(i, r0, r1) for i, x in enumerate(hosts) for r0, r1 in self._slices(x)]
        amax = torch.zeros(n, dtype=torch.float32)
        ga = gs = None
        if s.scheme.global_scale:
            futs = [self.pool.submit(self.ops.amax, hosts[i][r0:r1].unsqueeze(0), s.rotate) for i, r0, r1 in parts]
            for (i, _, _), f in zip(parts, futs):
                amax[i] = torch.maximum(amax[i], f.result()[0])  # NaN propagates, as in cpu.amax
            ga = unit_amax(amax, batch)
            gs = ref.global_scale(ga)
        bs = s.scheme.block_size
        packed = [torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.uint8) for x in hosts]
        scale = [torch.empty(x.shape[0], x.shape[1] // bs, dtype=torch.uint8) for x in hosts]

        def part(i: int, r0: int, r1: int) -> bool:
            p, sc, flag = self.ops.quantize(hosts[i][r0:r1].unsqueeze(0), s.scheme.name,
                                            None if gs is None else gs[i : i + 1], s.rotate, False, **s.extra)
            packed[i][r0:r1] = p[0]
            scale[i][r0:r1] = sc[0].view(torch.uint8)
            return bool(flag)

        futs = [self.pool.submit(part, i, r0, r1) for i, r0, r1 in parts]
        left = [len(futs)]
        lock = threading.Lock()

        def one_done(_f) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                free(None)

        for f in futs:
            f.add_done_callback(one_done)
        if not futs:
            free(None)

        def result() -> tuple:
            flags = [False] * n
            for (i, _, _), f in zip(parts, futs):
                flags[i] |= f.result()
            scales = []
            for sc in scale:
                sc = sc.view(torch.float8_e4m3fn) if s.scheme.name == "nvfp4" else sc
                scales.append(swizzle_scales(sc.unsqueeze(0))[0] if s.swizzle else sc)
            return packed, scales, flags, amax, ga, gs, None

        return result


def _one_malloc_arena() -> None:
    """glibc gives each new thread its own malloc arena, which keeps its freed chunk temporaries:
    with the pool, reader and writer threads that was ~45 MB more peak RSS on a 317M-param model
    (371 -> 323 MB, measured). One arena for threads created from now on; the lock costs nothing
    at these allocation sizes. No-op where glibc's mallopt is absent."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-8, 1)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


class StackedBackend:
    """Each shape group stacked into one ``[B, M, K]`` launch; CUDA: streams, pinned memory, events.

    On CUDA the host-to-device copies go on a copy stream, the passes and the device-to-host copies
    on a compute stream, and the only host sync is the writer's wait for the batch's event. On the
    CPU (``device='cpu'``: the tests) the same code runs with no streams, so it is checked there.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            from .cuda import ops

            self.copy = torch.cuda.Stream(device)
            self.compute = torch.cuda.Stream(device)
        else:
            from . import cpu as ops
        self.ops = ops
        self.h2d_done = None  # CUDA: the last batch's input copies (its pinned set may be refilled after)

    def close(self) -> None:
        pass

    def _stream(self, which: str):
        return torch.cuda.stream(getattr(self, which)) if self.cuda else contextlib.nullcontext()

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def _upload(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.int64)
        return t.pin_memory().to(self.device, non_blocking=True) if self.cuda else t

    def run(self, batch: Batch, hosts: list[torch.Tensor], s: Settings, free: Callable) -> Callable[[], tuple]:
        """``free(event)``: the inputs' pinned set may be refilled once ``event`` (the copies) completed."""
        dev = self.device
        n = len(batch.members)
        with self._stream("compute"):
            # Host-to-device: each shape group into one [B, M, K] tensor (no stacking copy on the host).
            # The inputs are allocated on the copy stream, which writes them: a block the caching
            # allocator hands out there is free of every earlier copy-stream use, and of the compute
            # kernels that read earlier inputs (record_stream below). Allocated on the compute stream,
            # a block last used by the previous batch's still-queued kernels (its packed outputs)
            # could be overwritten by this batch's copies before those kernels ran (seen on the H100:
            # a 64-expert MoE refused for NaN that was not in the source).
            with self._stream("copy"):
                xs = [torch.empty((len(g), *hosts[g[0]].shape), dtype=hosts[g[0]].dtype, device=dev)
                      for g in batch.groups]
                for x, g in zip(xs, batch.groups):
                    for j, i in enumerate(g):
                        x[j].copy_(hosts[i], non_blocking=self.cuda)
                    if self.cuda:
                        x.record_stream(self.compute)
                if self.cuda:
                    self.h2d_done = torch.cuda.Event()
                    self.h2d_done.record(self.copy)
            if self.cuda:
                self.compute.wait_event(self.h2d_done)
            free(self.h2d_done)
            # Member order <-> group order, as one small asynchronous index upload.
            order = [i for g in batch.groups for i in g]
            pos = [0] * n
            for k, i in enumerate(order):
                pos[i] = k
            index = self._upload(pos + order)
            to_member, to_group = index[:n], index[n:]
            flags = []
            if s.scheme.global_scale:
                amax = torch.cat([self.ops.amax(x, s.rotate) for x in xs])[to_member]
                ga = unit_amax(amax, batch, self._upload)
                # CUDA: the kernel takes the (unit's) amax and computes gs itself; the CPU ops take gs.
                given = ga[to_group] if self.cuda else ref.global_scale(ga)[to_group]
                flags.append((~torch.isfinite(amax)).any().to(torch.int32).reshape(1))
            else:
                amax = ga = given = None
            outs, gss, start = [], [], 0
            for x, g in zip(xs, batch.groups):
                per = None if given is None else given[start : start + len(g)].contiguous()
                start += len(g)
                if self.cuda:
                    p, sc, gsg, flag = self.ops.quantize(x, s.scheme.name, per, s.rotate, s.swizzle, **s.extra)
                else:
                    p, sc, flag = self.ops.quantize(x, s.scheme.name, per, s.rotate, s.swizzle, **s.extra)
                    gsg = per
                gss.append(gsg)
                flags.append(flag.reshape(-1).to(torch.int32))  # CUDA: one per matrix; CPU ops: one
                outs.append((self._to_host(p), self._to_host(sc.view(torch.uint8)), sc.dtype))
            gs = torch.cat(gss)[to_member] if amax is not None else None
            nflags = sum(f.numel() for f in flags)
            meta = [torch.cat(flags).to(torch.float32)]
            if amax is not None:
                meta += [amax, ga, gs]
            meta_h = self._to_host(torch.cat(meta))
            done = None
            if self.cuda:
                done = torch.cuda.Event()
                done.record(self.compute)

        def result() -> tuple:
            if done is not None:
                with stages.timed("write_waits_gpu"):
                    done.synchronize()  # the batch's one host sync, in the writer thread
            bad = bool(meta_h[:nflags].any())
            m = meta_h[nflags:]
            amax_h, ga_h, gs_h = (m[:n], m[n : 2 * n], m[2 * n :]) if amax is not None else (None, None, None)
            packed: list = [None] * n
            scale: list = [None] * n
            for (p, sc, dt), g in zip(outs, batch.groups):
                for j, i in enumerate(g):
                    packed[i], scale[i] = p[j], sc[j].view(dt)
            flags_h = _which_nonfinite(xs, batch, amax_h) if bad else [False] * n
            return packed, scale, flags_h, amax_h, ga_h, gs_h, None

        return result


def _which_nonfinite(xs: list[torch.Tensor], batch: Batch, amax_h: torch.Tensor | None) -> list[bool]:
    """The error path only: which members hold NaN/Inf (their amax, or a check on the device)."""
    if amax_h is not None and not bool(torch.isfinite(amax_h).all()):
        return [not bool(torch.isfinite(a)) for a in amax_h]
    bad = [False] * len(batch.members)
    for x, g in zip(xs, batch.groups):
        per = (~torch.isfinite(x)).flatten(1).any(1).tolist()
        for j, i in enumerate(g):
            bad[i] = per[j]
    return bad


def unit_amax(amax: torch.Tensor, batch: Batch, upload: Callable[[list], torch.Tensor] | None = None) -> torch.Tensor:
    """Per member: the max amax over its unit (a fused group shares one global scale); NaN propagates."""
    if all(len(u) == 1 for u in batch.units):
        return amax
    width = max(len(u) for u in batch.units)
    rows, start = [], 0
    for u in batch.units:
        idx = list(range(start, start + len(u)))
        rows.append(idx + [idx[0]] * (width - len(u)))  # padding repeats a member: the max is unchanged
        start += len(u)
    flat = upload([i for r in rows for i in r] + batch.unit_of) if upload else torch.tensor(
        [i for r in rows for i in r] + batch.unit_of, dtype=torch.int64)
    index, unit_of = flat[: len(rows) * width].reshape(len(rows), width), flat[len(rows) * width :]
    return amax[index].amax(1)[unit_of]


def write_batch(batch: Batch, result: Callable[[], tuple], s: Settings, fmt, writers, records: dict) -> Job:
    """The writer-thread job of a batch: wait for its results, refuse NaN/Inf, fill records, write."""

    def job() -> None:
        packed, scale, bad, amax, ga, gs, _ = result()
        for i, d in enumerate(batch.members):
            if bad[i]:
                raise nonfinite_error(d.name, d.info.file, s.rotate)
        for i, d in enumerate(batch.members):
            g = None if gs is None else gs[i].clone().reshape(())
            q = QuantizedTensor(packed[i], scale[i], g, s.scheme.name, s.rotate,
                                "swizzled" if s.swizzle else "linear", s.extra.get("scale_rule"))
            if g is not None:
                records[d.name]["global_scale"] = float(g)
                records[d.name]["amax"] = float(ga[i])
            for name, t in fmt.tensors(d.module, q):
                writers.tensor(name, t)

    return job
