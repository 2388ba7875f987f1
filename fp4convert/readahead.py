"""Read-ahead: the next work unit's source tensors are read while the current one is quantized.

File reads release the GIL, so a background thread hides disk (or page-cache) time behind
quantization and writing. Host memory holds at most two units (the one in work and the next).
For CUDA the bytes land in pinned buffers, two sets used in turn, so host-to-device copies run
asynchronously at full speed; a set is refilled only after the main thread released it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .safetensors_io import DTYPES, TensorInfo, read_into, read_tensor

SETS = 2  # buffer sets: the unit in work and the next one


class ReadAhead:
    """Yields each unit's source tensors (host memory, in unit order) from a background reader."""

    def __init__(self, units: list[list[TensorInfo]], locate: Callable[[str], Path], pinned: bool) -> None:
        self._units = units
        self._locate = locate
        self._pinned = pinned
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._ready: queue.Queue = queue.Queue(maxsize=1)
        self._free = threading.Semaphore(SETS)
        self._stop = threading.Event()
        self.wait_s = 0.0  # how long the consumer waited for data: ~0 when reading is fully hidden
        self._thread = threading.Thread(target=self._run, name="fp4convert-readahead", daemon=True)
        self._thread.start()

    def _host(self, info: TensorInfo, set_index: int, slot: int) -> torch.Tensor:
        path = self._locate(info.file)
        if not self._pinned:
            return read_tensor(path, info)
        buf = self._buffers.get((set_index, slot))
        if buf is None or buf.numel() < info.nbytes:
            buf = torch.empty(max(info.nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
            self._buffers[(set_index, slot)] = buf
        host = buf[: info.nbytes]
        read_into(path, info, host)
        return host.view(DTYPES[info.dtype]).reshape(info.shape)

    def _run(self) -> None:
        try:
            for i, unit in enumerate(self._units):
                while not self._free.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                tensors = [self._host(info, i % SETS, slot) for slot, info in enumerate(unit)]
                self._put(("ok", tensors))
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
        """The next unit's tensors; call :meth:`release` once they are no longer needed."""
        t0 = time.perf_counter()
        kind, value = self._ready.get()
        self.wait_s += time.perf_counter() - t0
        if kind == "error":
            raise value
        return value

    def release(self) -> None:
        """The last unit's buffers may be refilled (for CUDA: its copies have completed)."""
        self._free.release()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
