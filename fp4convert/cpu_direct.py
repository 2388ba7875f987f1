"""``--device cpu`` without torch: the torch-free path's batches through the compiled CPU kernel.

The torch-free CUDA path (:mod:`fp4convert.direct`) reads each batch into one host buffer, runs the two
passes on it and hands the writer one output buffer; this module gives that path a CPU: a
:class:`CpuRuntime` (host buffers, the writer's NaN/Inf check of kept tensors, no streams) and a
:class:`CpuDirectBackend` whose passes are the CPU kernel (:mod:`fp4convert.cpu_kernel`) called on
the buffers' raw memory, every shape group one ``[B, M, K]`` call on all cores. The same runs qualify
as on CUDA (one process, every quantized unit plain 2-D bf16/fp16/fp32 weights); the process then
never imports torch (4-5 s on the H100 machine), and the outputs are the torch pipeline's bytes
(tests/test_cpu_direct.py).

Wiring (fp4convert/convert.py, not done here): ``_direct_runtime`` returns :func:`runtime` for a CPU
device, and the lanes take ``rt.backend()`` instead of ``direct.DirectBackend(rt)``.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
from array import array
from collections.abc import Callable

from . import stages
from .direct import DTYPE_CODES as _KERNEL_DTYPES
from .direct import _rule_code, _unit_amax
from .schedule import Batch, Settings
from .swizzle import padded_shape

# The CPU kernel's dtype ints (fp4c_cpu.cpp), by safetensors dtype.
CPU_DTYPES = {"F32": 0, "BF16": 1, "F16": 2}
NONFINITE_CODES = {"F32": 0, "F16": 1, "BF16": 2, "F64": 3, "F8_E4M3": 4, "F8_E5M2": 5}  # fp4c_cpu_nonfinite
FMT_CODES = {"nvfp4": 0, "mxfp4": 1}
ALIGN = 256
assert set(CPU_DTYPES) == set(_KERNEL_DTYPES)  # the runs that qualify are the CUDA direct path's


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class HostBuffer:
    """Anonymous page-aligned host memory with the torch-free path's buffer interface (ptr, size,
    view); back in its pool once nothing references it."""

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
    """Buffers by size class (fp4convert.cuda.runtime.size_class's rule): a request takes a free one
    of its class or at most 25% larger."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self, n: int) -> HostBuffer:
        from .cuda.runtime import size_class  # torch-free: ctypes and the stages module only

        size = size_class(n)
        with self._lock:
            fits = [m for m in self._free if size <= len(m) <= size + size // 4]
            if fits:
                mem = min(fits, key=len)
                self._free.remove(mem)
                return HostBuffer(self, mem)
        stages.count("host_buffer_MB", size / 2**20)
        return HostBuffer(self, mmap.mmap(-1, size))

    def put(self, mem: mmap.mmap) -> None:
        with self._lock:
            self._free.append(mem)

    def close(self) -> None:
        with self._lock:
            self._free = []  # unmapped when the last view is gone


class CpuRuntime:
    """The torch-free path's runtime on the CPU: the kernel library, a host buffer pool, no device."""

    def __init__(self, lib: ctypes.CDLL, threads: int | None = None) -> None:
        self.lib = lib
        self.threads = threads or cores()
        self.pool = _HostPool()

    def lane(self) -> CpuRuntime:
        """Another lane: the same library and pool (the kernel runs one threaded call at a time)."""
        other = object.__new__(CpuRuntime)
        other.lib, other.threads, other.pool = self.lib, self.threads, self.pool
        return other

    def backend(self) -> CpuDirectBackend:
        return CpuDirectBackend(self)

    def set_device(self) -> None:
        """Nothing to select on the CPU (the lanes call this first in each of their threads)."""

    def host_check(self, dtype: str, data: memoryview) -> bool:
        """The writer's NaN/Inf check of kept tensors' bytes (safetensors dtype names; others: False)."""
        code = NONFINITE_CODES.get(dtype)
        width = {0: 4, 1: 2, 2: 2, 3: 8, 4: 1, 5: 1}.get(code or 0, 1)
        n = len(data) // width
        if code is None or not n:
            return False
        buf = (ctypes.c_char * len(data)).from_buffer(data) if not data.readonly else ctypes.c_char_p(bytes(data))
        return self.lib.fp4c_cpu_nonfinite(ctypes.cast(buf, ctypes.c_void_p), n, code, self.threads) == 1

    def close(self) -> None:
        self.pool.close()


class CpuDirectBackend:
    """A batch's two passes on the CPU kernel, straight on the reader's buffer (see DirectBackend)."""

    def __init__(self, rt: CpuRuntime) -> None:
        self.rt = rt

    def close(self) -> None:
        pass

    def run(self, batch: Batch, hosts, s: Settings, free: Callable) -> Callable[[], tuple]:
        """``hosts``: (buffer, [(offset, info)]), each shape group's members back to back; computes the
        batch now (the kernel's threads) and returns the writer's result() (direct.write_batch's)."""
        rt, lib = self.rt, self.rt.lib
        buf, items = hosts
        n = len(batch.members)
        fmt = s.scheme.name
        nvfp4 = s.scheme.global_scale
        rotate = int(s.rotate == "had16")
        bs = s.scheme.block_size
        rule = _rule_code(s.scheme, s.extra.get("scale_rule"))
        groups = batch.groups
        order = [i for g in groups for i in g]
        pos = [0] * n
        for k, i in enumerate(order):
            pos[i] = k
        layout: list = [None] * n
        launches, size = [], 0
        for g in groups:
            info = items[g[0]][1]
            m, k = info.shape
            rows, cols = padded_shape(m, k // bs) if s.swizzle else (m, k // bs)
            p_n, s_n = m * k // 2, rows * cols
            p_off = size
            s_off = _align(p_off + len(g) * p_n)
            size = _align(s_off + len(g) * s_n)
            for j, i in enumerate(g):
                layout[i] = (p_off + j * p_n, p_n, s_off + j * s_n, s_n)
            launches.append((g, items[g[0]][0], info, m, k, p_off, s_off))
        out = rt.pool.get(max(size, 1))
        if s.swizzle:  # the kernel writes no padding: zero it (scales only; a few % of the output)
            for g, _, info, m, k, _, s_off in launches:
                rows, cols = padded_shape(m, k // bs)
                ctypes.memset(out.ptr + s_off, 0, len(g) * rows * cols)
        amax = ga = gsv = None
        bad = [False] * n
        flags = (ctypes.c_uint8 * max(n, 1))()
        with stages.timed("quantize_kernel"):
            if nvfp4:
                slots = (ctypes.c_float * n)()
                for g, off, info, m, k, _, _ in launches:
                    _check(lib.fp4c_cpu_amax(buf.ptr + off, CPU_DTYPES[info.dtype], rotate, len(g), m, k,
                                             ctypes.byref(slots, 4 * pos[g[0]]), rt.threads), "amax")
                amax = [slots[pos[i]] for i in range(n)]
                bad = [not math.isfinite(a) for a in amax]
                ga = _unit_amax(amax, batch)
                ga_slots = (ctypes.c_float * n)(*[ga[i] for i in order])
                gs_slots = (ctypes.c_float * n)()
                _check(lib.fp4c_cpu_global_scale(ga_slots, gs_slots, n), "global scale")
                gsv = [gs_slots[pos[i]] for i in range(n)]
            if not any(bad):
                for g, off, info, m, k, p_off, s_off in launches:
                    slot = pos[g[0]]
                    _check(lib.fp4c_cpu_quantize(buf.ptr + off, CPU_DTYPES[info.dtype], FMT_CODES[fmt], rule, rotate,
                                                 int(s.swizzle), len(g), m, k,
                                                 ctypes.byref(gs_slots, 4 * slot) if nvfp4 else None,
                                                 out.ptr + p_off, out.ptr + s_off, ctypes.byref(flags, slot),
                                                 rt.threads), "quantize")
                bad = [bool(flags[pos[i]]) for i in range(n)]
        free(None)  # the inputs are consumed: the reader may refill the buffer

        def result() -> tuple:
            return out, layout, bad, amax, ga, gsv

        return result


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"internal: the CPU kernel's {what} returned status {status}")


def runtime(config, world, plan) -> CpuRuntime | None:
    """The torch-free CPU runtime when this run can use it: one process, a CPU device, every quantized
    unit plain 2-D bf16/fp16/fp32 weights (as on CUDA), ``FP4CONVERT_TORCH_PIPELINE`` not set, and the
    kernel built. None otherwise (the torch pipeline runs, with the same bytes)."""
    from . import cpu_kernel
    from .convert import _simple
    from .plan import QUANTIZE

    if world.distributed or config.device != "cpu" or os.environ.get("FP4CONVERT_TORCH_PIPELINE") == "1":
        return None
    for unit in plan.units():
        if unit[0].decode is not None:
            return None
        if unit[0].action == QUANTIZE and not (_simple(unit) and all(d.info.dtype in CPU_DTYPES for d in unit)):
            return None
    lib = cpu_kernel.get()
    return None if lib is None else CpuRuntime(lib)
