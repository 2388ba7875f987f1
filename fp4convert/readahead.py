"""Read-ahead: the next work units' source tensors are read while the current one is quantized.

File reads release the GIL, so a background thread hides disk (or page-cache) time behind
quantization and writing. Host memory holds at most ``SETS`` batches (the one in work and the
next). For CUDA the bytes land in pinned buffers, two sets used in turn, so host-to-device copies
run asynchronously at full speed; a set is refilled only after its copies completed (the consumer
hands :meth:`ReadAhead.release` the CUDA event recorded after them, and the reader waits on it).

:func:`advise` asks the kernel to start reading the source (``posix_fadvise(WILLNEED)``) in plan
order: it imports nothing heavy, so the converter calls it before torch and CUDA initialise.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from . import stages

if TYPE_CHECKING:
    import torch

    from .safetensors_io import TensorInfo

SETS = 2  # buffer sets: the batch in work and the next one
READ_THREADS = 4  # a pinned batch is read by this many threads (page-cache copies scale to ~4)
ADVISE_LIMIT = 8 << 30  # never ask the kernel to cache more than this ahead of the work


def advise(ranges: Iterable[tuple[Path, int, int]], limit: int = ADVISE_LIMIT) -> int:
    """posix_fadvise(WILLNEED) on (path, begin, end) ranges, in order, up to ``limit`` bytes.

    The kernel reads them asynchronously (cold cache: the disk starts working while Python and
    CUDA start up; warm cache: a no-op). Returns the bytes advised; silently 0 where unsupported.
    """
    if not hasattr(os, "posix_fadvise"):
        return 0
    done = 0
    fds: dict[Path, int] = {}
    try:
        for path, begin, end in ranges:
            if done >= limit:
                break
            n = min(end - begin, limit - done)
            try:
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, begin, n, os.POSIX_FADV_WILLNEED)
            except OSError:
                continue  # a missing or odd file is reported by the real read, with context
            done += n
    finally:
        for fd in fds.values():
            os.close(fd)
    return done


class ReadAhead:
    """Yields each batch's source tensors (host memory, in order) from a background reader.

    ``units``: one list of tensor infos per batch (a work unit, or several units batched together).
    """

    def __init__(self, units: list[list[TensorInfo]], locate: Callable[[str], Path], pinned: bool,
                 device: torch.device | None = None, host: Callable[[int], object] | None = None) -> None:
        self._device = device  # CUDA: this rank's GPU, so pinned memory never opens a context on GPU 0
        # The torch-free CUDA path: pinned buffers from fp4convert.cuda.runtime (``host(nbytes)``); a
        # batch is then (buffer, [(offset, info)...]) instead of tensors.
        self._host = host
        self._units = units
        # Each set's buffer is allocated once, for the largest batch (growing it batch by batch cost
        # more pinned allocations, ~0.8 s per GB on the H100 machine).
        from .schedule import grouped_offsets

        self._set_bytes = max((grouped_offsets(u)[1] for u in units), default=0) if pinned or host else 0
        self._locate = locate
        self._pinned = pinned
        self._buffers: dict[int, object] = {}  # set -> its pinned buffer
        self._pending: dict[int, object] = {}  # set -> CUDA event its last consumer recorded
        self._lock = threading.Lock()
        self._ready: queue.Queue = queue.Queue(maxsize=1)
        self._free = threading.Semaphore(SETS)
        self._stop = threading.Event()
        self._released = 0
        self.wait_s = 0.0  # how long the consumer waited for data: ~0 when reading is fully hidden
        self._thread = threading.Thread(target=self._run, name="fp4convert-readahead", daemon=True)
        self._thread.start()

    def _read_set(self, set_index: int, unit: list[TensorInfo]):
        if self._host is not None:  # the torch-free path: (buffer, [(offset, info)])
            buf, offsets = self._fill(set_index, unit, self._host)
            return buf, list(zip(offsets, unit))
        from .safetensors_io import DTYPES, read_tensor  # DTYPES imports torch
        if not self._pinned:
            with stages.timed("read"):
                return [read_tensor(self._locate(info.file), info) for info in unit]
        buf, offsets = self._fill(set_index, unit, _PinnedTensor)
        return [buf.tensor[off : off + info.nbytes].view(DTYPES[info.dtype]).reshape(info.shape)
                for info, off in zip(unit, offsets)]

    def _fill(self, set_index: int, unit: list[TensorInfo], alloc: Callable[[int], object]) -> tuple[object, list[int]]:
        """Read a batch into set ``set_index``'s pinned buffer (one per set, grown by ``alloc(nbytes)``)
        at :func:`~fp4convert.schedule.grouped_offsets`, once the set's last copies have finished."""
        from .safetensors_io import read_many
        from .schedule import grouped_offsets

        with self._lock:
            event = self._pending.pop(set_index, None)
        if event is not None:
            with stages.timed("read_wait_copies"):
                event.synchronize()  # the host-to-device copies out of this set have finished
        offsets, total = grouped_offsets(unit)
        buf = self._buffers.get(set_index)
        if buf is None or buf.size < total:
            buf = self._buffers[set_index] = alloc(max(total, self._set_bytes))
        with stages.timed("read"):
            read_many([(self._locate(info.file), info, buf.view(off, info.nbytes)) for info, off in zip(unit, offsets)],
                      READ_THREADS)
        return buf, offsets

    def _run(self) -> None:
        try:
            if self._host is None and self._pinned and self._device is not None and self._device.type == "cuda":
                import torch

                torch.cuda.set_device(self._device)
            for i, unit in enumerate(self._units):
                t0 = time.perf_counter()
                while not self._free.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                stages.add("read_waits_buffer", time.perf_counter() - t0)  # both sets still in use
                if self._stop.is_set():
                    return
                got = self._read_set(i % SETS, unit)
                t0 = time.perf_counter()
                self._put(("ok", got))
                stages.add("read_waits_consumer", time.perf_counter() - t0)
        except BaseException as exc:  # handed to the consumer, which raises it with its context
            self._put(("error", exc))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> list[torch.Tensor]:
        """The next batch's tensors; call :meth:`release` once they are no longer needed."""
        t0 = time.perf_counter()
        kind, value = self._ready.get()
        self.wait_s += time.perf_counter() - t0
        stages.add("quantize_waits_read", time.perf_counter() - t0)
        if kind == "error":
            raise value
        return value

    def release(self, after: object | None = None) -> None:
        """The oldest batch's buffers may be refilled: now, or (CUDA) once event ``after`` completed."""
        if after is not None:
            with self._lock:
                self._pending[self._released % SETS] = after
        self._released += 1
        self._free.release()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class _PinnedTensor:
    """A torch pinned uint8 buffer with the torch-free path's buffer interface (size, view)."""

    def __init__(self, n: int) -> None:
        import torch

        with stages.timed("pin_alloc"):
            self.tensor = torch.empty(max(n, 1 << 20), dtype=torch.uint8, pin_memory=True)
        self.size = self.tensor.numel()
        stages.count("pinned_MB", self.size / 2**20)

    def view(self, offset: int, n: int) -> memoryview:
        from .safetensors_io import tensor_memoryview

        return tensor_memoryview(self.tensor[offset : offset + n])
