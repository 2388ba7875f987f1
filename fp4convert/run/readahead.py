"""Read-ahead: the next work units' source tensors are read while the current one is quantized.

File reads release the GIL, so a background thread hides disk (or page-cache) time behind
quantization and writing. Host memory holds at most ``SETS`` items (the one in work and the
next), in buffers the backend allocates (pinned for a GPU, so host-to-device copies run
asynchronously at full speed), two sets used in turn; a set is refilled only after its copies
completed (the consumer hands :meth:`ReadAhead.release` the event recorded after them, and the
reader waits on it). The reader never calls anyone: it is told, by item number. Imports no torch.

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
from typing import TYPE_CHECKING, Any

from fp4convert import timing

if TYPE_CHECKING:
    from fp4convert.storage.safetensors import TensorInfo

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
    """Yields each item's inputs (one host buffer, in order) from a background reader.

    ``units``: one list of tensor infos per item (a work unit, or several units batched together).
    ``alloc(nbytes)``: a host buffer (the backend's: pinned memory for a GPU); each of the ``SETS``
    buffer sets is allocated once, for the largest item (growing it item by item cost more pinned
    allocations, ~0.8 s per GB on the H100 machine). ``init``: run first in the reader's thread.
    An item's inputs are ``(buffer, [(offset, info)...])``, the members of a shape group back to back
    (:func:`~fp4convert.quantizer.items.grouped_offsets`).
    """

    def __init__(self, units: list[list[TensorInfo]], locate: Callable[[str], Path], alloc: Callable[[int], Any],
                 init: Callable[[], None] | None = None) -> None:
        from fp4convert.quantizer.items import grouped_offsets

        self._alloc, self._init = alloc, init
        self._units = units
        self._set_bytes = max((grouped_offsets(u)[1] for u in units), default=0)
        self._locate = locate
        self._buffers: dict[int, Any] = {}  # set -> its buffer
        self._pending: dict[int, Any] = {}  # set -> the event its last consumer recorded
        self._out: dict[int, int] = {}  # set -> the number of the item handed out in it, until released
        self._lock = threading.Lock()
        self._ready: queue.Queue = queue.Queue(maxsize=1)
        self._free = [threading.Event() for _ in range(SETS)]  # set k's last item has been released
        for e in self._free:
            e.set()
        self._stop = threading.Event()
        self.wait_s = 0.0  # how long the consumer waited for data: ~0 when reading is fully hidden
        self._thread = threading.Thread(target=self._run, name="fp4convert-readahead", daemon=True)
        self._thread.start()

    def _fill(self, set_index: int, unit: list[TensorInfo]) -> tuple[Any, list[tuple[int, TensorInfo]]]:
        """Read an item into set ``set_index``'s buffer, once the set's last copies have finished."""
        from fp4convert.quantizer.items import grouped_offsets
        from fp4convert.storage.reads import read_many

        with self._lock:
            event = self._pending.pop(set_index, None)
        if event is not None:
            with timing.timed("read_wait_copies"):
                event.synchronize()  # the host-to-device copies out of this set have finished
        offsets, total = grouped_offsets(unit)
        buf = self._buffers.get(set_index)
        if buf is None or buf.size < total:
            buf = self._buffers[set_index] = self._alloc(max(total, self._set_bytes))
        with timing.timed("read"):
            read_many([(self._locate(info.file), info, buf.view(off, info.nbytes)) for info, off in zip(unit, offsets)],
                      READ_THREADS)
        return buf, list(zip(offsets, unit))

    def _run(self) -> None:
        try:
            if self._init is not None:
                self._init()  # CUDA: this run's GPU, so pinned memory never opens a context on GPU 0
            for i, unit in enumerate(self._units):
                k = i % SETS
                t0 = time.perf_counter()
                while not self._free[k].wait(timeout=0.1):  # its set's previous item is released, whatever
                    if self._stop.is_set():  # the order items are released in (a CPU pool finishes them
                        return  # out of order)
                self._free[k].clear()
                timing.add("read_waits_buffer", time.perf_counter() - t0)  # both sets still in use
                if self._stop.is_set():
                    return
                got = self._fill(k, unit)
                with self._lock:
                    self._out[k] = i
                t0 = time.perf_counter()
                self._put(("ok", (got, i)))
                timing.add("read_waits_consumer", time.perf_counter() - t0)
        except BaseException as exc:  # handed to the consumer, which raises it with its context
            self._put(("error", exc))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def release(self, number: int, after: object | None = None) -> None:
        """Item ``number``'s buffer may be refilled: now, or (GPU) once event ``after`` completed.
        Only the first call for an item counts (an error path may release it again)."""
        k = number % SETS
        with self._lock:
            if self._out.get(k) != number:
                return
            del self._out[k]
            if after is not None:
                self._pending[k] = after
        self._free[k].set()

    def next(self) -> tuple[Any, int]:
        """The next item's inputs, and its number: :meth:`release` it once they are no longer needed
        (or with an event after which they are not)."""
        t0 = time.perf_counter()
        kind, value = self._ready.get()
        self.wait_s += time.perf_counter() - t0
        timing.add("quantize_waits_read", time.perf_counter() - t0)
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
