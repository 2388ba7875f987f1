"""CUDA without torch: the GPU, pinned and device buffers, a stream and events.

The converter's CUDA path for plain 2-D weights (:mod:`fp4convert.direct`) runs on this and the
kernel library alone, so a conversion never imports torch (4 s on the H100 machine: as long as
`cp -r` of the whole 5.6 GB test checkpoint). The device's compute capability comes from the
driver (``libcuda``), which every CUDA install has; everything else goes through the library's
own runtime (``csrc/fp4c_runtime.cu``). Pinned buffers are pooled: allocating pinned memory costs
~0.8 s per GB there, so a run allocates a few and reuses them.
"""

from __future__ import annotations

import ctypes
import functools
import threading

from fp4convert import timing
from fp4convert.errors import CUDAKernelError, CUDAUnavailableError

MIN_CAPABILITY = (8, 9)  # the E4M3 conversion instructions (as in ops.py)
H2D, D2H = 1, 2
HOST_CHECK_CODES = {"F32": 0, "F16": 1, "BF16": 2, "F64": 3, "F8_E4M3": 4, "F8_E5M2": 5}  # fp4c_host_nonfinite
ALIGN = 256  # every buffer region starts here: the kernels' 16-byte loads, and the copy engines' best case
SMALL = 64 << 10  # the smallest pinned buffer (a batch's few amax / unit-amax floats)


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def size_class(n: int) -> int:
    """The pinned size a request of ``n`` bytes gets: 64 KiB, or n rounded up to a quarter of its
    power of two (<= 25% waste). A request takes a free buffer of its own class or one at most 25%
    larger, so a batch's few-KB request never takes (and strands) a 64 MB input buffer."""
    if n <= SMALL:
        return SMALL
    step = 1 << max(16, (n - 1).bit_length() - 3)
    return -(-n // step) * step


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL | None:
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        return lib if lib.cuInit(0) == 0 else None
    return None


def device_count() -> int:
    """GPUs the driver sees (0 without a driver, or when it fails)."""
    drv = _driver()
    n = ctypes.c_int(0)
    if drv is None or drv.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return 0
    return n.value


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple[int, int] | None:
    """(major, minor) of GPU ``index`` from the driver; None without it."""
    drv = _driver()
    if drv is None or index >= device_count():
        return None
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if drv.cuDeviceGet(ctypes.byref(dev), index) != 0:
        return None
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
    if drv.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) or drv.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev):
        return None
    return major.value, minor.value


class HostBuffer:
    """A pinned host buffer from the pool; back in the pool once nothing references it."""

    def __init__(self, pool: _HostPool, ptr: int, size: int) -> None:
        self.ptr, self.size, self._pool = ptr, size, pool

    def view(self, offset: int = 0, n: int | None = None) -> memoryview:
        """Bytes ``[offset, offset + n)``: hold this buffer while the view is used (the view does not)."""
        n = self.size - offset if n is None else n
        return memoryview((ctypes.c_char * n).from_address(self.ptr + offset)).cast("B")

    def __del__(self) -> None:
        self._pool.put(self.ptr, self.size)


class _HostPool:
    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._free: list[tuple[int, int]] = []
        self._all: list[int] = []
        self._lock = threading.Lock()

    def get(self, n: int) -> HostBuffer:
        size = size_class(n)
        with self._lock:
            fits = [(sz, ptr) for ptr, sz in self._free if size <= sz <= size + size // 4]
            if fits:
                sz, ptr = min(fits)
                self._free.remove((ptr, sz))
                return HostBuffer(self, ptr, sz)
        with timing.timed("pin_alloc"):
            self._rt.set_device()  # the calling thread's (the reader's, say) device is this one
            p = ctypes.c_void_p()
            self._rt.check(self._rt.lib.fp4c_host_alloc(ctypes.byref(p), size), f"pinned host memory ({size} B)")
        timing.count("pinned_MB", size / 2**20)
        with self._lock:
            self._all.append(p.value)
        return HostBuffer(self, p.value, size)

    def put(self, ptr: int, size: int) -> None:
        with self._lock:
            self._free.append((ptr, size))

    def close(self) -> None:
        with self._lock:
            for ptr in self._all:
                self._rt.lib.fp4c_host_free(ctypes.c_void_p(ptr))
            self._all, self._free = [], []


class DeviceArena:
    """One device allocation, grown on demand (the stream orders every use, so it is reused freely)."""

    def __init__(self, rt: Runtime) -> None:
        self._rt, self.ptr, self.size = rt, 0, 0

    def at_least(self, n: int) -> int:
        if n > self.size:
            self.free()
            p = ctypes.c_void_p()
            self.size = max(align(n), 1 << 20)
            self._rt.check(self._rt.lib.fp4c_malloc(ctypes.byref(p), self.size), f"device memory ({self.size} B)")
            self.ptr = p.value
        return self.ptr

    def free(self) -> None:
        if self.ptr:
            self._rt.lib.fp4c_free(ctypes.c_void_p(self.ptr))  # synchronizes the device: only when growing
            self.ptr, self.size = 0, 0


class Event:
    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        p = ctypes.c_void_p()
        rt.check(rt.lib.fp4c_event_create(ctypes.byref(p)), "an event")
        self.handle = p.value

    def record(self, stream: int) -> Event:
        self._rt.check(self._rt.lib.fp4c_event_record(self.handle, stream), "recording an event")
        return self

    def synchronize(self) -> None:
        self._rt.check(self._rt.lib.fp4c_event_sync(self.handle), "waiting for the GPU")

    def __del__(self) -> None:
        self._rt.lib.fp4c_event_destroy(ctypes.c_void_p(self.handle))


_warming: dict[int, threading.Thread] = {}


def prewarm(index: int) -> None:
    """Start the driver, the kernel library and GPU ``index``'s context in a background thread (~0.3 s
    on the H100 machine), so they overlap the planning; :class:`Runtime` waits for it. Errors are
    left for :class:`Runtime` (or torch) to report."""
    if index in _warming:
        return

    def warm() -> None:
        try:
            cap = capability(index)
            if cap is None or cap < MIN_CAPABILITY:
                return
            from fp4convert.kernels.cuda.build import load_library

            load_library(cap).fp4c_set_device(index)  # creates the primary context (torch shares it)
        except Exception:  # noqa: BLE001 - reported by whoever needs the GPU, with context
            pass

    t = _warming[index] = threading.Thread(target=warm, name="fp4convert-cuda-warm", daemon=True)
    t.start()


class Runtime:
    """GPU ``index`` through the kernel library: buffers, one stream, events, copies, launches."""

    def __init__(self, index: int) -> None:
        from fp4convert.kernels.cuda.build import load_library

        warm = _warming.get(index)
        if warm is not None:
            warm.join()  # one thread builds or loads the library, never two at once

        cap = capability(index)
        if cap is None:
            raise CUDAUnavailableError(f"no CUDA GPU {index} is visible to the driver")
        if cap < MIN_CAPABILITY:
            raise CUDAUnavailableError(f"the CUDA kernels need compute capability >= 8.9, GPU {index} has "
                                       f"{cap[0]}.{cap[1]}")
        self.index, self.capability = index, cap
        self.lib = load_library(cap)
        self.set_device()
        self.pool = _HostPool(self)
        self._owner = True  # closes the pool; a lane() closes only its stream
        self.stream = self._new_stream()

    def _new_stream(self) -> int:
        p = ctypes.c_void_p()
        self.check(self.lib.fp4c_stream_create(ctypes.byref(p)), "a stream")
        return p.value

    def lane(self) -> Runtime:
        """This GPU with a stream of its own (a lane of the converter, fp4convert.lanes): the same
        library and pinned pool; its close() destroys only its stream."""
        other = object.__new__(Runtime)
        other.index, other.capability, other.lib, other.pool = self.index, self.capability, self.lib, self.pool
        other._owner = False
        other.stream = self._new_stream()
        return other

    def check(self, code: int, what: str = "a CUDA call") -> None:
        if code != 0:
            raise CUDAKernelError(f"CUDA error {code} ({what}): {self.lib.fp4c_error_string(code).decode()}")

    def set_device(self) -> None:
        """The calling thread's device (each thread that launches or allocates calls this first)."""
        self.check(self.lib.fp4c_set_device(self.index), f"selecting GPU {self.index}")

    def event(self) -> Event:
        return Event(self)

    def copy(self, dst: int, src: int, n: int, kind: int) -> None:
        if n:
            self.check(self.lib.fp4c_memcpy_async(dst, src, n, kind, self.stream), "an asynchronous copy")

    def memset(self, dst: int, value: int, n: int) -> None:
        if n:
            self.check(self.lib.fp4c_memset_async(dst, value, n, self.stream), "an asynchronous memset")

    def sync(self) -> None:
        self.check(self.lib.fp4c_stream_sync(self.stream), "waiting for the GPU")

    def nonfinite(self, data: memoryview, dtype: int) -> bool:
        """NaN/Inf anywhere in ``data`` (elements of ``dtype``: see fp4c_host_nonfinite); host code."""
        width = {0: 4, 1: 2, 2: 2, 3: 8, 4: 1, 5: 1}[dtype]
        n = len(data) // width
        if not n:
            return False
        buf = (ctypes.c_char * len(data)).from_buffer(data) if not data.readonly else ctypes.c_char_p(bytes(data))
        return bool(self.lib.fp4c_host_nonfinite(ctypes.cast(buf, ctypes.c_void_p), n, dtype))

    def host_check(self, dtype: str, data: memoryview) -> bool:
        """The writer's NaN/Inf check of kept tensors' bytes (safetensors dtype names; others: False)."""
        code = HOST_CHECK_CODES.get(dtype)
        return False if code is None else self.nonfinite(data, code)

    def close(self) -> None:
        self.sync()
        self.lib.fp4c_stream_destroy(ctypes.c_void_p(self.stream))
        if self._owner:
            self.pool.close()
