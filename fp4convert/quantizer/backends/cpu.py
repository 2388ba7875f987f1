"""The ``cpu`` backend: the host's cores, each matrix in row slices run by a thread pool.

Every pool thread runs torch single-threaded (torch's intra-op threads are set to one while the
backend is open): torch ops release the GIL, so the cores are used without OpenMP's spin-waiting,
which beside the reader and writer threads (or any other load) burnt 2-6x the CPU time. Slices hold
``CHUNK_ELEMS / workers`` elements, so the pool's temporaries together stay those of one chunk, and
one item is in work at a time (its amax slices first, then its quantize slices). Slices are quantized
with linear scales and swizzled once, whole: the same bytes as one call (scales and codes are per
row block). The arithmetic is :mod:`fp4convert.kernels.cpu`'s, called through :data:`OPS`, which gives it the
signature of the CUDA ops (:mod:`fp4convert.kernels.cuda.ops`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import ClassVar

import torch

from fp4convert.kernels import cpu
from fp4convert.kernels.tensor import as_bytes
from fp4convert.numerics import reference as ref
from fp4convert.numerics.swizzle import swizzle_scales
from fp4convert.quantizer.backend import (
    Context,
    Inputs,
    InputWeight,
    MatrixOut,
    Pending,
    Result,
    Settings,
    Staged,
    matrix_weights,
    two_passes,
)
from fp4convert.quantizer.items import Batch, Item
from fp4convert.quantizer.matrices import TensorBuffer, kept_output, launch_groups, nonfinite_bytes, tensors, unit_weights


class CpuOps:
    """:mod:`fp4convert.kernels.cpu` with the CUDA ops' signature: ``[B, M, K]`` batches, an amax per matrix in,
    ``(packed, scale, gs, nonfinite flag per matrix)`` out. The global scale is computed here from
    the amax, as the CUDA kernel computes it (``reference.global_scale``: the same fp32 division)."""

    @staticmethod
    def amax(x: torch.Tensor, rotate: str | None) -> torch.Tensor:
        return cpu.amax(x, rotate)

    @staticmethod
    def quantize(x: torch.Tensor, scheme: str, amax: torch.Tensor | None, rotate: str | None, swizzle: bool,
                 scale_rule: str | None = None, *, input_weight: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``input_weight`` (fp32 [K], one for every matrix of x): the search rules' block error weighted
        per input channel, on :func:`fp4convert.kernels.cpu.quantize_input_weighted` (the torch path, which
        every CPU build has); None: the unweighted :func:`fp4convert.kernels.cpu.quantize`."""
        gs = None if amax is None else ref.global_scale(amax.to(torch.float32).reshape(-1))
        if x.shape[0] <= 1:
            if input_weight is None:
                p, s, f = cpu.quantize(x, scheme, gs, rotate, swizzle, scale_rule)
            else:
                p, s, f = cpu.quantize_input_weighted(x, scheme, gs, rotate, swizzle, scale_rule, input_weight)
            return p, s, gs, f.reshape(1).expand(x.shape[0]).to(torch.int32)
        parts = [OPS.quantize(x[i : i + 1], scheme, None if amax is None else amax[i : i + 1], rotate, swizzle,
                              scale_rule, input_weight=input_weight)
                 for i in range(x.shape[0])]  # one call per matrix: a flag per matrix
        return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                None if gs is None else torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts]))


OPS = CpuOps()


class CpuBackend:
    """Row slices of every matrix on a pool of single-threaded workers (see the module's docstring)."""

    name: ClassVar[str] = "cpu"
    batch_units: ClassVar[int] = 1  # one unit at a time, each member quantized in place (stacking only copies)
    batch_bytes: ClassVar[int] = 0
    auto_lanes: ClassVar[int] = 1

    def __init__(self, settings: Settings, workers: int, threads: int, owner: bool) -> None:
        self.s = settings
        self.workers = max(1, workers)
        self.threads = threads  # torch's intra-op threads before (restored at close; complex units use them)
        self.owner = owner
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="fp4convert-quantize")

    @classmethod
    def supports(cls, plan) -> bool:
        return True

    @classmethod
    def open(cls, ctx: Context) -> CpuBackend:
        import os

        threads = torch.get_num_threads()
        world = ctx.world
        cores = threads if not (world.distributed and world.local_size > 1) else max(
            1, (os.cpu_count() or 1) // world.local_size)  # CPU ranks on one machine share its cores
        cores = max(1, cores // max(1, ctx.lanes))
        if cores <= 4:  # a small machine: memory first (a 16-core H100 host ran 13% faster without)
            _one_malloc_arena()
        torch.set_num_threads(1)  # parallel over row slices instead; restored by close()
        return cls(ctx.settings, cores, threads, owner=True)

    def lane(self) -> CpuBackend:
        return CpuBackend(self.s, self.workers, self.threads, owner=False)

    def thread_init(self) -> None:
        pass

    def host_buffer(self, nbytes: int) -> TensorBuffer:
        return TensorBuffer(nbytes, pinned=False)

    def nonfinite(self, dtype: str, data: memoryview) -> bool:
        return nonfinite_bytes(dtype, data)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.owner:
            torch.set_num_threads(self.threads)

    @contextmanager
    def _all_threads(self):
        """A complex unit's decoding and slicing (one thread would run it) with the machine's threads."""
        torch.set_num_threads(self.workers)
        try:
            yield
        finally:
            torch.set_num_threads(1)

    def _slices(self, x: torch.Tensor) -> list[tuple[int, int]]:
        # CHUNK_ELEMS / workers elements per slice, but never below a quarter chunk: each slice is a few
        # dozen torch calls whose dispatch holds the GIL, and 16 threads on 64K-element slices likely
        # queue on it (suspected, not yet measured, cause of the 16-core H100 host's --device cpu row
        # falling from 22.9 s to 80 s; a 2-4 core machine keeps its slices, and its memory, as before).
        m, k = x.shape
        rows = max(1, max(cpu.CHUNK_ELEMS // self.workers, cpu.CHUNK_ELEMS // 4) // max(k, 1))
        return [(r0, min(m, r0 + rows)) for r0 in range(0, m, rows)]

    def stage(self, item: Item, inputs: Inputs) -> Staged:
        """Nothing to copy: the pool reads the reader's buffer in place (the Pending says until when)."""
        return Staged(item, inputs)

    def quantize(self, staged: Staged) -> Pending:
        """Pass 1 now; pass 2's slices submitted to the pool: the Pending's ``inputs_free`` completes
        with the last of them (the slices read the inputs in place), its result waits for them all."""
        item, inputs = staged.item, staged.inputs
        s = self.s
        if isinstance(item, Batch):
            mats = tensors(inputs)  # each member one 2-D matrix, in item.matrices order
        else:
            with self._all_threads():
                weights = unit_weights(item, tensors(inputs))
                if item.kept:  # a kept quantized input: written as the fp32 weight it encodes (--kept-dtype bf16: BF16)
                    w = kept_output(item.members[0], weights[0]).contiguous()
                    return Pending(Result([], [], [(item.members[0].name, as_bytes(w))], keep=w), inputs_free=None)
                mats = [None] * len(item.matrices)
                for x, idx in launch_groups(item, weights):
                    for j, i in enumerate(idx):
                        mats[i] = x[j] if x[j].is_contiguous() else x[j].contiguous()
        n = len(mats)
        parts = [(i, r0, r1) for i, x in enumerate(mats) for r0, r1 in self._slices(x)]

        def amax_pass() -> list[float]:
            amax = torch.zeros(n, dtype=torch.float32)
            futs = [self.pool.submit(OPS.amax, mats[i][r0:r1].unsqueeze(0), s.rotate) for i, r0, r1 in parts]
            for (i, _, _), f in zip(parts, futs):
                amax[i] = torch.maximum(amax[i], f.result()[0])  # NaN propagates, as in cpu.amax
            return amax.tolist()

        def quantize_pass(ga: list[float] | None) -> Pending:
            bs = s.scheme.block_size
            packed = [torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.uint8) for x in mats]
            scale = [torch.empty(x.shape[0], x.shape[1] // bs, dtype=torch.uint8) for x in mats]
            ga_t = None if ga is None else torch.tensor(ga, dtype=torch.float32)
            iw = weight_tensors(matrix_weights(item))

            def part(i: int, r0: int, r1: int) -> bool:
                p, sc, _, flag = OPS.quantize(mats[i][r0:r1].unsqueeze(0), s.scheme.name,
                                              None if ga_t is None else ga_t[i : i + 1], s.rotate, False, s.rule,
                                              input_weight=iw[i])
                packed[i][r0:r1] = p[0]
                scale[i][r0:r1] = sc[0].view(torch.uint8)
                return bool(flag.any())

            futs = [self.pool.submit(part, i, r0, r1) for i, r0, r1 in parts]
            return _Slices(s, futs, [i for i, _, _ in parts], packed, scale, ga)

        return two_passes(item, s, amax_pass, quantize_pass)


class _Done:
    """An :class:`~fp4convert.quantizer.backend.Event` for pool work: complete once every future is done
    (finished, failed or cancelled), which ``synchronize()`` waits for."""

    def __init__(self, futures: list[Future]) -> None:
        self.futures = futures

    def synchronize(self) -> None:
        wait(self.futures)


class _Slices(Pending):
    """An item's pass 2 on the pool: the inputs are free once every slice is done (``inputs_free``);
    :meth:`result` waits for the slices, then swizzles the scales when the format wants them so."""

    def __init__(self, s: Settings, futs: list[Future], owners: list[int], packed: list[torch.Tensor],
                 scale: list[torch.Tensor], ga: list[float] | None) -> None:
        super().__init__(inputs_free=_Done(futs) if futs else None)
        self.s, self.futs, self.owners, self.packed, self.scale, self.ga = s, futs, owners, packed, scale, ga

    def result(self) -> Result:
        s, ga, n = self.s, self.ga, len(self.packed)
        refused = [False] * n
        for i, f in zip(self.owners, self.futs):
            refused[i] |= f.result()
        gs = None if ga is None else ref.global_scale(torch.tensor(ga, dtype=torch.float32)).tolist()
        outs: list[MatrixOut | None] = []
        keep = []
        for i in range(n):
            sc = self.scale[i]
            if s.swizzle:
                sc = swizzle_scales(sc.view(torch.float8_e4m3fn).unsqueeze(0) if s.scheme.name == "nvfp4"
                                    else sc.unsqueeze(0))[0].view(torch.uint8)
            keep += [self.packed[i], sc]
            outs.append(MatrixOut(as_bytes(self.packed[i]), as_bytes(sc), None if gs is None else gs[i],
                                  None if ga is None else ga[i]))
        return Result(outs, refused, keep=keep)


def weight_tensors(weights: list[InputWeight | None], device: torch.device | None = None) -> list[torch.Tensor | None]:
    """Each matrix's input weight as an fp32 [K] tensor (on ``device``; one tensor per key, shared)."""
    made: dict[str, torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    for w in weights:
        if w is not None and w.key not in made:
            t = torch.frombuffer(bytearray(w.data), dtype=torch.float32)
            made[w.key] = t if device is None or device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)
        out.append(None if w is None else made[w.key])
    return out


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


BACKEND = CpuBackend
