"""Scheduling of the overlapped work loop, torch-free: batches of work units and the writer thread.

Both CUDA paths (:mod:`fp4convert.pipeline` on torch, :mod:`fp4convert.direct` without it) and the
CPU path batch units the same way and hand each batch's writes to one :class:`WriteBehind` thread,
which runs them in plan order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import stages
from .plan import QUANTIZE, Decision
from .scheme import Scheme

Job = Callable[[], None]

# CUDA batching: consecutive units share launches up to these limits (pinned memory: 2 sets).
CUDA_BATCH_UNITS = 128
CUDA_BATCH_BYTES = 256 << 20
# CPU: one unit per batch, each member quantized in place (stacking would only add a copy).
CPU_BATCH_UNITS, CPU_BATCH_BYTES = 1, 0
WRITE_DEPTH = 2  # batches whose writes may wait in the queue


class WriteBehind:
    """A writer thread running queued jobs in order; its first error stops it and is re-raised.

    At most ``depth`` heavy jobs (a batch's writes) wait in the queue; light ones (a progress
    update, which must follow its unit's writes: a Hub source shard is deleted after its last use)
    take no slot.
    """

    def __init__(self, depth: int = WRITE_DEPTH, init: Callable[[], None] | None = None) -> None:
        self._init = init  # run first in the thread (CUDA: make this rank's GPU its current device)
        self._q: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fp4convert-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._init is not None:
            self._init()
        while True:
            item = self._q.get()
            if item is None:
                return
            job, light = item
            try:
                if self._error is None:  # else drain the queue without running: the writer failed
                    with stages.timed("writer_busy"):
                        job()
            except BaseException as exc:  # handed to the compute thread at its next submit/drain
                self._error = exc
            finally:
                if not light:
                    self._slots.release()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, job: Job, light: bool = False) -> None:
        self._raise()
        if not light:
            t0 = time.perf_counter()
            while not self._slots.acquire(timeout=0.1):
                self._raise()
                if not self._thread.is_alive():
                    raise RuntimeError("internal: the writer thread stopped")
            stages.add("quantize_waits_writer", time.perf_counter() - t0)
        self._q.put((job, light))

    def drain(self, ok: bool) -> None:
        """Run every queued job (they hold finished work: a shard they complete is kept for --resume),
        then stop; ok: re-raise a writer error (else the caller is raising its own)."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
        if ok:
            self._raise()


def make_batches(pending: list[list[Decision]], max_units: int, max_bytes: int) -> list[list[list[Decision]]]:
    """Consecutive pending quantize units, batched (each unit whole); a kept unit ends a batch."""
    out: list[list[list[Decision]]] = []
    cur: list[list[Decision]] = []
    size = 0
    for unit in pending:
        if unit[0].action != QUANTIZE:
            if cur:
                out.append(cur)
            cur, size = [], 0
            continue
        nbytes = sum(d.info.nbytes for d in unit)
        if cur and (len(cur) >= max_units or size + nbytes > max_bytes):
            out.append(cur)
            cur, size = [], 0
        cur.append(unit)
        size += nbytes
    if cur:
        out.append(cur)
    return out


def shape_groups(infos: list) -> list[list[int]]:
    """Member indices grouped by (dtype, shape), groups in order of first appearance (a launch each)."""
    groups: dict[tuple, list[int]] = {}
    for i, info in enumerate(infos):
        groups.setdefault((info.dtype, tuple(info.shape)), []).append(i)
    return list(groups.values())


def grouped_offsets(infos: list, align: int = 256) -> tuple[list[int], int]:
    """Where each tensor of a batch goes in its pinned buffer, and the buffer's size: the members of
    a shape group back to back (one [B, M, K] array, so a group is one launch straight from the
    buffer), each group at an ``align``-byte boundary. Reads still go in file order (scattered)."""
    offsets = [0] * len(infos)
    total = 0
    for g in shape_groups(infos):
        total = -(-total // align) * align
        for i in g:
            offsets[i] = total
            total += infos[i].nbytes
    return offsets, -(-total // align) * align


@dataclass
class Settings:
    """What the quantize stage needs from the config and the format."""

    scheme: Scheme
    rotate: str | None
    swizzle: bool
    extra: dict  # the backend keywords: {"scale_rule": the config's rule}


class Batch:
    """One batch's members in plan order, and their shape groups (one launch each)."""

    def __init__(self, units: list[list[Decision]]) -> None:
        self.units = units
        self.members = [d for u in units for d in u]
        self.unit_of = [i for i, u in enumerate(units) for _ in u]
        self.groups = shape_groups([d.info for d in self.members])

    def reads(self) -> list:
        """The tensors to read for this batch, in member order."""
        return [d.info for d in self.members]
