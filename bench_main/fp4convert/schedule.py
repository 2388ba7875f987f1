"""Scheduling, torch-free: a part's work units as the items a backend quantizes, and the writer thread.

A work unit is one tensor or one fused group (:meth:`fp4convert.plan.Plan.units`). Consecutive plain
units (every member one whole 2-D matrix) are batched up to the backend's limits (:class:`Batch`: a
GPU launches all experts of a layer at once); any other quantized unit is an item of its own
(:class:`Complex`: 3-D stacked experts, gate/up halves, FP8 / MXFP4 inputs decoded first); a kept
tensor ends a batch and is copied by the writer, in pieces. Each item's writes are one job (a kept
copy's pieces one job each) for the part's :class:`WriteBehind` threads, which start them in plan
order and run them side by side.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable

from . import stages
from .plan import QUANTIZE, Decision, Matrix

Job = Callable[[], None]

WRITE_DEPTH = 2  # items whose writes may wait in the queue beyond those being written


def is_plain(unit: list[Decision]) -> bool:
    """Every member quantizes its whole 2-D tensor as one matrix (what a :class:`Batch` holds)."""
    for d in unit:
        if d.action != QUANTIZE or d.decode is not None or len(d.matrices) != 1 or len(d.info.shape) != 2:
            return False
        m = d.matrices[0]
        if (m.expert is not None or m.rows is not None or m.transpose or m.module != d.module
                or (m.group or d.group) != d.group or tuple(m.shape) != tuple(d.info.shape)):
            return False
    return True


def is_kept_copy(unit: list[Decision]) -> bool:
    """A kept tensor copied unchanged (a kept quantized input is decoded instead: a :class:`Complex`)."""
    return unit[0].action != QUANTIZE and unit[0].decode is None


class Batch:
    """Consecutive plain units: their members in plan order, and their shape groups (one launch each)."""

    def __init__(self, units: list[list[Decision]]) -> None:
        self.units = units
        self.members = [d for u in units for d in u]
        self.unit_of = [i for i, u in enumerate(units) for _ in u]
        self.groups = shape_groups([d.info for d in self.members])
        self.matrices: list[tuple[Decision, Matrix]] = [(d, d.matrices[0]) for d in self.members]
        self.keys: list[int | str | None] = list(self.unit_of)  # a unit (a fused group) shares one amax
        self.input_weights: list | None = None  # per matrix, backend.InputWeight or None (backend.attach_input_weights)

    def reads(self) -> list:
        """The tensors to read for this batch, in member order."""
        return [d.info for d in self.members]


class Complex:
    """One quantized unit whose tensors are not one whole matrix each (stacked experts, gate/up halves,
    FP8 / MXFP4 inputs), or a kept quantized input (written as the fp32 weight it encodes)."""

    def __init__(self, unit: list[Decision]) -> None:
        self.units = [unit]
        self.members = list(unit)
        self.kept = unit[0].action != QUANTIZE
        self.matrices = [] if self.kept else [(d, m) for d in unit for m in d.matrices]
        # matrices with the same group share one global scale; ungrouped ones have their own
        self.keys: list[int | str | None] = [m.group or d.group for d, m in self.matrices]
        self.input_weights: list | None = None  # per matrix, backend.InputWeight or None (backend.attach_input_weights)

    def reads(self) -> list:
        """Every on-disk tensor of the unit, member by member (a decoded input reads several)."""
        return [t for d in self.members for t in d.reads]


Item = Batch | Complex


def make_items(pending: list[list[Decision]], max_units: int, max_bytes: int) -> list[Item]:
    """The items of a part's pending units, in plan order: plain units batched, other quantized units
    (and kept quantized inputs, which are decoded) one each; kept copies are no item."""
    items: list[Item] = []
    run: list[list[Decision]] = []

    def flush() -> None:
        items.extend(Batch(b) for b in make_batches(run, max_units, max_bytes))
        run.clear()

    for u in pending:
        if is_kept_copy(u):
            flush()
        elif is_plain(u):
            run.append(u)
        else:
            flush()
            items.append(Complex(u))
    flush()
    return items


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
    """Where each tensor of a batch goes in its host buffer, and the buffer's size: the members of
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


def write_threads() -> int:
    """Writer threads of a part: enough to keep one file's writes going while others read, scan or
    wait for the GPU (the kernel serialises buffered writes into one file, so more do not help)."""
    return max(2, min(4, os.cpu_count() or 1))


class WriteBehind:
    """A part's writer threads: its units' write jobs, run side by side; the first error stops them.

    Jobs start in the order they were submitted, on ``threads`` threads, and finish in any order: they
    write at offsets the plan fixed, so the bytes never depend on it. Three kinds:

    - an item's writes (the default): it holds the item's results until it has run, so at most
      ``depth`` (``threads`` + :data:`WRITE_DEPTH` unless given) are submitted and not finished;
      a submit waits for a slot;
    - a piece of a kept tensor's copy (``held=False``): it holds nothing until it runs, so it takes no
      slot (a 1 GB embedding is 128 pieces, copied by every thread at once);
    - a light job (``light=True``, a progress update, which must follow its unit's writes: a Hub source
      shard is deleted after its last read): it runs once every job submitted before it has finished,
      light jobs one at a time and in order, on the thread that finished the last of those jobs.

    After an error, jobs not yet started are dropped (their shards stay unfinished) and the error is
    re-raised to the caller at its next submit or at :meth:`drain`.
    """

    def __init__(self, depth: int | None = None, init: Callable[[], None] | None = None,
                 threads: int | None = None) -> None:
        self._init = init  # run first in each thread (CUDA: make this rank's GPU its current device)
        n = threads or write_threads()
        self._slots = threading.Semaphore(depth if depth is not None else n + WRITE_DEPTH)
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()  # (seq, job, held) not yet started
        self._seq = 0  # jobs (not light) submitted
        self._frontier = 0  # every job numbered below it has finished
        self._finished: set[int] = set()  # finished jobs at or past the frontier
        self._lights: collections.deque = collections.deque()  # (jobs before it, job)
        self._light_lock = threading.Lock()
        self._stopping = False
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._run, name=f"fp4convert-writer{k}", daemon=True)
                         for k in range(n)]
        for t in self._threads:
            t.start()

    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc

    def _run(self) -> None:
        try:
            if self._init is not None:
                self._init()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller at its next submit/drain
            self._fail(exc)
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                seq, job, held = self._queue.popleft()
            try:
                if self._error is None:  # else drop it: the writes failed
                    with stages.timed("writer_busy"):
                        job()
            except BaseException as exc:  # noqa: BLE001 - handed to the compute thread at its next submit/drain
                self._fail(exc)
            finally:
                if held:
                    self._slots.release()
                self._done(seq)

    def _done(self, seq: int) -> None:
        with self._cv:
            self._finished.add(seq)
            while self._frontier in self._finished:
                self._finished.remove(self._frontier)
                self._frontier += 1
        self._run_lights()

    def _light_ready(self) -> bool:
        with self._cv:
            return bool(self._lights) and self._lights[0][0] <= self._frontier

    def _run_lights(self, block: bool = False) -> None:
        """Run the light jobs whose predecessors have all finished, in order, one thread at a time (a
        thread that finds another running them leaves them to it; that one looks again before it goes)."""
        while self._light_ready() or block:
            if not self._light_lock.acquire(blocking=block):
                return
            try:
                while self._light_ready():
                    with self._cv:
                        _, job = self._lights.popleft()
                    try:
                        if self._error is None:
                            job()
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        self._fail(exc)
            finally:
                self._light_lock.release()
            block = False

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, job: Job, light: bool = False, held: bool = True) -> None:
        self._raise()
        if light:
            with self._cv:
                self._lights.append((self._seq, job))
            self._run_lights()
            return
        if held:
            t0 = time.perf_counter()
            while not self._slots.acquire(timeout=0.1):
                self._raise()
                if not any(t.is_alive() for t in self._threads):
                    raise RuntimeError("internal: the writer threads stopped")
            stages.add("quantize_waits_writer", time.perf_counter() - t0)
        with self._cv:
            self._queue.append((self._seq, job, held))
            self._seq += 1
            self._cv.notify()

    def drain(self, ok: bool) -> None:
        """Run every queued job (they hold finished work: a shard they complete is kept for --resume)
        and the light jobs after them, then stop; ok: re-raise a writer error (else the caller is
        raising its own)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        self._run_lights(block=True)
        if ok:
            self._raise()
