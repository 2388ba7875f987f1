"""Progress display, owned by the library: a run (convert, export) or a long check (inspect) asks for it.

A caller only says whether to show progress (``progress=True``); what it looks like is decided here:
a tqdm bar on a terminal, one line every :data:`PROGRESS_ENV` seconds (10 by default) on a log or a
pipe, nothing when not shown. Every display is a :class:`Bar` (``total``, ``update(n)`` in bytes) used
as a context manager. The run loop (:mod:`fp4convert.run.runner`) updates it once per finished unit, in
plan order, by that unit's input bytes. Hidden progress is a :class:`NoProgress`, whose ``update`` is the
documented place to observe a run's progress without a display (tests/run/test_convert.py patches it).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Protocol

from fp4convert.config import human_bytes

PROGRESS_ENV = "FP4CONVERT_PROGRESS_INTERVAL"  # seconds between progress lines when stderr is not a TTY


class Bar(Protocol):
    """What the library advances: a total (which a long check may grow once it knows more) and updates, in bytes."""

    @property
    def total(self) -> float | None: ...

    def update(self, n: int) -> object: ...


class LineProgress:
    """Progress for logs and pipes: one line every N seconds (a ticker thread, so long downloads show too)."""

    def __init__(self, total: int, desc: str, interval: float) -> None:
        self.total, self.desc, self.interval = total, desc, interval
        self.done = 0
        self._clock = time.monotonic
        self._t0 = self._clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fp4convert-progress", daemon=True)

    def update(self, n: int) -> None:
        self.done += n

    def line(self) -> str:
        elapsed = self._clock() - self._t0
        pct = 100 * self.done / self.total if self.total else 100.0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = f", ETA {(self.total - self.done) / rate:.0f} s" if rate > 0 and self.done < self.total else ""
        return (f"{self.desc}: {human_bytes(self.done)} of {human_bytes(self.total)} ({pct:.0f}%), "
                f"{elapsed:.0f} s, {human_bytes(rate)}/s{eta}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            print(self.line(), file=sys.stderr, flush=True)  # sys.stderr as it is now (a test may swap it)

    def __enter__(self) -> LineProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class NoProgress:
    """Progress not shown: updates are counted nowhere (``update`` is the hook to observe them)."""

    total = 0

    def update(self, n: int) -> None:
        pass


@contextlib.contextmanager
def progress_bar(total: int, desc: str, show: bool) -> Iterator[Bar]:
    """The display for ``total`` bytes labelled ``desc``: a tqdm bar on a terminal, a line every N seconds
    otherwise (:data:`PROGRESS_ENV`), a :class:`NoProgress` when ``show`` is False (--quiet, --json)."""
    if not show:
        yield NoProgress()
        return
    if sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr) as bar:
            yield bar
        return
    try:
        interval = float(os.environ.get(PROGRESS_ENV, "10"))
    except ValueError:
        interval = 10.0
    with LineProgress(total, desc, max(interval, 0.01)) as line:
        yield line
