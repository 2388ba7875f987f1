"""The ``cpu-native`` backend: the CPU without torch, plain 2-D weights through the compiled CPU kernel.

``--device cpu`` takes it whenever the run qualifies as the ``cuda`` backend's do (one process, every
quantized unit whole 2-D bf16/fp16/fp32 matrices: :meth:`CpuNativeBackend.supports` is that
backend's test): then the process never imports torch (4-5 s on the H100 machine, as long as a
whole conversion there), and every shape group of a batch is one call of the CPU kernel
(:mod:`fp4convert.kernels.cpu_lib`, vectorised and threaded inside, on every core this process may run
on) straight on the reader's buffer. Everything else (stacked experts, FP8 / MXFP4 inputs,
torchrun, or no C++ compiler to build the kernel) runs on the torch ``cpu`` backend, which calls the
same kernel (:mod:`fp4convert.kernels.cpu`) where it can; the bytes are the same either way
(tests/quantizer/test_backend_cpu_native.py).

Per batch (the reader filled one anonymous-memory buffer with its members, each shape group back to
back): pass 1, one amax call per shape group; each unit's amax on the host (``backend.two_passes``);
the global scales (the kernel's fp32 division, ``reference.global_scale``); pass 2, one quantize call
per shape group writing codes and scales (swizzled by the kernel when the format wants them so) into
one pooled output buffer, with a NaN/Inf flag per matrix. Both passes run on the run loop's thread
(ctypes releases the GIL), the writer thread meanwhile writes the previous batch. The kept tensors'
NaN/Inf scan is the kernel's too (one thread: the copy's loader runs it beside a quantize call, and
the kernel runs one threaded call at a time).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from array import array
from typing import ClassVar

from fp4convert import timing
from fp4convert.errors import ConfigError
from fp4convert.kernels import cpu_lib as cpu_kernel
from fp4convert.kernels.cuda.runtime import HOST_CHECK_CODES, size_class
from fp4convert.quantizer.backend import Context, Inputs, MatrixOut, Pending, Result, Settings, Staged, matrix_weights, two_passes
from fp4convert.quantizer.backends.cuda import CudaBackend, output_layout
from fp4convert.quantizer.items import Batch

KERNEL_DTYPES = {"F32": 0, "BF16": 1, "F16": 2}  # fp4c_cpu.cpp's dtype ints (not the CUDA launchers' order)
SCHEMES = cpu_kernel.SCHEMES
WIDTHS = {0: 4, 1: 2, 2: 2, 3: 8, 4: 1, 5: 1}  # bytes per element of each HOST_CHECK_CODES code


def cores() -> int:
    """The CPUs this process may run on (its affinity: ``taskset`` is honoured)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class HostBuffer:
    """Anonymous page-aligned memory (``ptr``, ``size``, ``view``); back in its pool once nothing references it."""

    def __init__(self, pool: _HostPool, mem: mmap.mmap) -> None:
        self._pool, self._mem = pool, mem
        self.size = len(mem)
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(mem))

    def view(self, offset: int = 0, n: int | None = None) -> memoryview:
        n = self.size - offset if n is None else n
        return memoryview(self._mem)[offset : offset + n]

    def __del__(self) -> None:
        self._pool.put(self._mem)


class _HostPool:
    """Buffers by size class (:func:`fp4convert.kernels.cuda.runtime.size_class`, the pinned pool's rule): a
    request takes a free buffer of its class or one at most 25% larger."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self, n: int) -> HostBuffer:
        size = size_class(n)
        with self._lock:
            fits = [m for m in self._free if size <= len(m) <= size + size // 4]
            if fits:
                mem = min(fits, key=len)
                self._free.remove(mem)
                return HostBuffer(self, mem)
        timing.count("host_buffer_MB", size / 2**20)
        return HostBuffer(self, mmap.mmap(-1, size))

    def put(self, mem: mmap.mmap) -> None:
        with self._lock:
            self._free.append(mem)

    def close(self) -> None:
        with self._lock:
            self._free = []  # unmapped once the last view is gone




class CpuNativeBackend:
    """A batch's two passes through the CPU kernel on every core, without torch (see the module's docstring)."""

    name: ClassVar[str] = "cpu-native"
    # The cuda backend's batches: a shape group of a batch is one kernel call, and two 64 MB input sets
    # per lane keep the memory a few hundred MB.
    batch_units: ClassVar[int] = 128
    batch_bytes: ClassVar[int] = 64 << 20
    auto_lanes: ClassVar[int] = 2  # two shards written side by side; the kernel runs one threaded call at a time

    def __init__(self, settings: Settings, lib: ctypes.CDLL, threads: int, pool: _HostPool, owner: bool) -> None:
        self.s, self.lib, self.threads, self.pool, self.owner = settings, lib, threads, pool, owner

    @classmethod
    def supports(cls, plan) -> bool:
        """The ``cuda`` backend's runs (every quantized unit plain 2-D bf16/fp16/fp32 weights) without
        input weights: the CPU kernel has no input-weighted search (``--input-weights`` runs the model in
        torch anyway, so the torch ``cpu`` backend takes those runs)."""
        return CudaBackend.supports(plan) and plan.config.input_weight_source == "none"

    @classmethod
    def open(cls, ctx: Context) -> CpuNativeBackend:
        """ConfigError when it cannot run here: a GPU device, torchrun, or no kernel (no C++ compiler, or
        ``FP4CONVERT_CPU_KERNEL=0``; :func:`fp4convert.kernels.cpu_lib.get` warned once with the reason)."""
        if ctx.device != "cpu" or ctx.world.distributed:
            raise ConfigError(f"--backend {cls.name} runs in one process on the CPU (--device cpu); "
                              "choose --backend cpu for torchrun")
        s = ctx.settings
        lib = cpu_kernel.get()
        if lib is None:
            raise ConfigError(f"--backend {cls.name} needs the compiled CPU kernel, which is unavailable here "
                              "(see the warning above); choose --backend cpu")
        if not lib.fp4c_cpu_has_rule(SCHEMES[s.scheme.name], s.scheme.rule(s.rule).code):
            raise ConfigError(f"--backend {cls.name}: the CPU kernel lacks the {s.scheme.name} scale rule {s.rule!r}; "
                              "choose --backend cpu")
        return cls(s, lib, cores(), _HostPool(), owner=True)

    def lane(self) -> CpuNativeBackend:
        """Another lane: the same library, threads and buffer pool."""
        return CpuNativeBackend(self.s, self.lib, self.threads, self.pool, owner=False)

    def thread_init(self) -> None:
        pass

    def host_buffer(self, nbytes: int) -> HostBuffer:
        return self.pool.get(nbytes)

    def nonfinite(self, dtype: str, data: memoryview) -> bool:
        code = HOST_CHECK_CODES.get(dtype)
        n = 0 if code is None else len(data) // WIDTHS[code]
        if not n:
            return False
        buf = (ctypes.c_char * len(data)).from_buffer(data) if not data.readonly else ctypes.c_char_p(bytes(data))
        got = self.lib.fp4c_cpu_nonfinite(ctypes.cast(buf, ctypes.c_void_p), n, code, 1)
        _check(got in (0, 1), f"nonfinite returned {got}")
        return got == 1

    def close(self) -> None:
        if self.owner:
            self.pool.close()

    def stage(self, item: Batch, inputs: Inputs) -> Staged:
        """Nothing to copy: the kernel reads the reader's buffer in place."""
        return Staged(item, inputs)

    def quantize(self, staged: Staged) -> Pending:
        """``staged.inputs``: (buffer from :meth:`host_buffer`, [(offset, info)]), each shape group's members
        back to back; both passes run now, so the returned Pending is finished and its inputs are free."""
        item, inputs = staged.item, staged.inputs
        assert isinstance(item, Batch)
        lib, s, threads = self.lib, self.s, self.threads
        if any(w is not None for w in matrix_weights(item)):  # --backend cpu-native with --input-weights
            raise ConfigError(f"--backend {self.name} has no input-weighted search; choose --backend cpu for "
                              "--input-weights")
        buf = inputs[0]
        assert isinstance(buf, HostBuffer)
        n = len(item.members)
        nvfp4 = s.scheme.global_scale
        rotate = int(s.rotate == "had16")
        pos, where, launches, size = output_layout(item, inputs[1], s)
        order = [i for g in item.groups for i in g]

        def amax_pass() -> list[float]:
            slots = (ctypes.c_float * n)()
            with timing.timed("quantize_kernel"):
                for g, off, info, m, k, _, _ in launches:
                    status = lib.fp4c_cpu_amax(buf.ptr + off, KERNEL_DTYPES[info.dtype], rotate, len(g), m, k,
                                               ctypes.byref(slots, 4 * pos[g[0]]), threads)
                    _check(status == cpu_kernel.OK, f"amax returned {status} on {item.members[g[0]].name}")
            return [slots[pos[i]] for i in range(n)]

        def quantize_pass(ga: list[float] | None) -> Pending:
            out = self.pool.get(max(size, 1))
            flags = (ctypes.c_uint8 * n)()
            gs = (ctypes.c_float * n)()
            with timing.timed("quantize_kernel"):
                if ga is not None:
                    _check(lib.fp4c_cpu_global_scale((ctypes.c_float * n)(*[ga[i] for i in order]), gs, n) == 0,
                           "global scale")
                for g, off, info, m, k, p_off, s_off in launches:
                    if s.swizzle:  # the kernel writes no padding: zero the group's scales first
                        ctypes.memset(out.ptr + s_off, 0, len(g) * where[g[0]][3])
                    slot = pos[g[0]]
                    status = lib.fp4c_cpu_quantize(
                        buf.ptr + off, KERNEL_DTYPES[info.dtype], SCHEMES[s.scheme.name],
                        s.scheme.rule(s.rule).code, rotate, int(s.swizzle), len(g), m, k,
                        ctypes.byref(gs, 4 * slot) if nvfp4 else None, out.ptr + p_off, out.ptr + s_off,
                        ctypes.byref(flags, slot), threads)
                    _check(status == cpu_kernel.OK, f"quantize returned {status} on {item.members[g[0]].name}")
            gsv = array("f", bytes(gs)) if ga is not None else None
            matrices: list[MatrixOut | None] = []
            for i in range(n):
                p_off, p_n, s_off, s_n = where[i]
                matrices.append(MatrixOut(out.view(p_off, p_n), out.view(s_off, s_n),
                                          None if gsv is None else gsv[pos[i]], None if ga is None else ga[i]))
            result = Result(matrices, [bool(flags[pos[i]]) for i in range(n)], keep=out)
            return Pending(result, inputs_free=None)  # the inputs are consumed: the reader may refill the buffer

        return two_passes(item, s, amax_pass, quantize_pass)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"internal: the CPU kernel's {what}")


BACKEND = CpuNativeBackend
