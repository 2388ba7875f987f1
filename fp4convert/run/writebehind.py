"""The writer threads of a part: each item's write jobs, started in plan order, run side by side.

The run loop (:mod:`fp4convert.run.work`) submits one job per quantized item (and one per piece of a
kept tensor's copy); jobs write at offsets the plan fixed, so the order they finish in never changes
the output.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable

from fp4convert import timing

Job = Callable[[], None]

WRITE_DEPTH = 2  # items whose writes may wait in the queue beyond those being written


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
                    with timing.timed("writer_busy"):
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
            timing.add("quantize_waits_writer", time.perf_counter() - t0)
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
